"""Check mode: verify across ranks the assumption behind each promotion.

``patch(check="warn"|"raise")``. A ``"replicate"`` operand must be the same whole tensor on every
rank of the mesh; a ``"local"`` operand must have, on every rank, the shape its global shape
implies. Each check is a collective over the mesh (so every rank must run the same ops, as
DTensor code does anyway): one ``all_gather_object`` of a small digest per mesh dim. It is skipped while
torch.compile traces. ``check="off"`` (the default) costs nothing.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from typing import Any, List, Sequence, Tuple

import torch

from .._rules.errors import ReplicationCheckError, ReplicationCheckWarning, describe_mesh, describe_tensor

log = logging.getLogger("keras_dtensor_mixfix")

CHECK_MODES = ("off", "warn", "raise")

__all__ = ["CHECK_MODES", "ReplicationCheckError", "ReplicationCheckWarning", "check_local", "check_replicated"]


def _digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().contiguous().cpu()
    if data.dtype == torch.bfloat16:
        data = data.view(torch.int16)
    return hashlib.sha1(data.numpy().tobytes()).hexdigest() + str(tuple(tensor.shape))


def _gather(mesh: Any, mesh_dim: int, value: Any) -> List[Any]:
    import torch.distributed as dist

    group = mesh.get_group(mesh_dim)
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _gather_mesh(mesh: Any, value: Any) -> List[Tuple[int, Any]]:
    """``(rank, value)`` of every rank of the mesh, on every rank: gather along each mesh dim in turn.

    Every rank runs the same collectives whatever it finds, so nobody is left waiting.
    """
    import torch.distributed as dist

    items: List[Tuple[int, Any]] = [(dist.get_rank(), value)]
    for mesh_dim in range(mesh.ndim):
        items = [item for part in _gather(mesh, mesh_dim, items) for item in part]
    return sorted(items)


def _report(mode: str, op: str, label: str, tensor: torch.Tensor, mesh: Any, what: str) -> None:
    message = (f"keras_dtensor_mixfix check: {op}: plain operand {label} ({describe_tensor(tensor)}) {what} on mesh "
               f"{describe_mesh(mesh)}. It was promoted under a rule that assumes otherwise; the result would be "
               "wrong. Use the 'local' rule for per-rank data (or convert it with DTensor.from_local), or make the "
               "tensor identical on every rank.")
    if mode == "raise":
        raise ReplicationCheckError(message)
    # One channel only: with no logging configured a log.warning is printed to stderr as well, so
    # every mismatch appeared twice. logging.captureWarnings(True) routes the warning to logging.
    warnings.warn(message, ReplicationCheckWarning, stacklevel=4)
    log.debug(message)


def check_replicated(mode: str, op: str, label: str, tensor: torch.Tensor, mesh: Any) -> None:
    """Every rank of ``mesh`` holds exactly the same ``tensor``."""
    groups: dict = {}
    for rank, digest in _gather_mesh(mesh, _digest(tensor)):
        groups.setdefault(digest, []).append(rank)
    if len(groups) > 1:
        described = "; ".join(f"ranks {members} agree" for members in groups.values())
        _report(mode, op, label, tensor, mesh, f"differs between ranks ({described})")


def check_local(mode: str, op: str, label: str, tensor: torch.Tensor, mesh: Any, placements: Sequence[Any],
                global_shape: Tuple[int, ...]) -> None:
    """This rank's piece has the shape ``global_shape`` and ``placements`` give it on every rank."""
    from .._torch.api import compute_local_shape_and_global_offset

    expected, _ = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    mine = (tuple(expected) == tuple(tensor.shape), tuple(tensor.shape), tuple(expected))
    bad = [(rank, shape, want) for rank, (fine, shape, want) in _gather_mesh(mesh, mine) if not fine]
    if bad:
        detail = ", ".join(f"rank {rank} has {shape} (expected {want})" for rank, shape, want in bad)
        _report(mode, op, label, tensor, mesh, f"is not the piece of a {global_shape} tensor its placements "
                f"{tuple(placements)} imply: {detail}")

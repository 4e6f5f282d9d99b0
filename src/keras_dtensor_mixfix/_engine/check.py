"""Check mode: verify across ranks the assumption behind each promotion.

``patch(check="warn"|"raise")``. A ``"replicate"`` operand must be the same whole tensor on every
rank of the mesh; a ``"local"`` operand must have, on every rank, the shape its global shape
implies. Each check is a collective over the mesh (so every rank must run the same ops, as
DTensor code does anyway): one all-gather into a tensor per mesh dim of a few int64 numbers (the shape, and a
fingerprint of the bytes for a replicate check), on the mesh's device. Being tensor collectives, the checks also run
under torch's rank simulator (``LocalTensorMode``), where each simulated rank's value is its own. They are skipped
while torch.compile traces. ``check="off"`` (the default) costs nothing.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, List, Sequence, Tuple

import torch

from .._rules.errors import ReplicationCheckError, ReplicationCheckWarning, describe_mesh, describe_tensor

log = logging.getLogger("keras_dtensor_mixfix")

CHECK_MODES = ("off", "warn", "raise")

__all__ = ["CHECK_MODES", "ReplicationCheckError", "ReplicationCheckWarning", "check_local", "check_replicated"]


_PRIME = 2**31 - 1
_WORDS = {1: torch.uint8, 2: torch.int16}
"""The integer view of a tensor's bytes by element size (4 bytes and more: int32 words)."""


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """Three int64 numbers that tell, with near certainty, whether two tensors hold the same bytes at the same
    positions (an accidental difference between ranks, not an adversary: not a cryptographic digest). Computed with
    tensor ops on the tensor's device, so that each rank's value is its own wherever a rank is a value of a tensor
    (torch's rank simulator), and with no integer overflow (each word and position taken modulo 2**31 - 1)."""
    flat = tensor.detach().reshape(-1)
    words = flat.view(_WORDS.get(flat.element_size(), torch.int32)).to(torch.int64) % _PRIME
    positions = torch.arange(words.numel(), device=words.device, dtype=torch.int64) % _PRIME
    mixed = (words * 48271 + positions * 16807 + 1) % _PRIME
    squared = (mixed * mixed + positions * 69621) % _PRIME
    return torch.stack([words.sum(), mixed.sum(), squared.sum()])


def _report_tensor(numbers: Sequence[Any], device: torch.device) -> torch.Tensor:
    """``numbers`` (sizes: ints, or under the rank simulator per-rank symbolic ints) as one int64 tensor on
    ``device``."""
    return torch.stack([torch.full((), number, dtype=torch.int64) for number in numbers]).to(device)


def _gather_mesh(mesh: Any, report: torch.Tensor) -> List[Tuple[int, Tuple[int, ...]]]:
    """``(rank, report)`` of every rank of the mesh, on every rank: the 1-D int64 ``report`` gathered along each mesh
    dim in turn (a tensor collective: every rank runs the same ones whatever it finds, so nobody is left waiting)."""
    import torch.distributed as dist

    # all_gather_single (torch 2.13 and later) is all_gather_into_tensor renamed (the old name warns there)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    length = report.numel()
    gathered = report
    for mesh_dim in range(mesh.ndim):
        group = mesh.get_group(mesh_dim)
        if gathered.device.type != "cpu" and dist.get_backend(group) == "gloo":
            gathered = gathered.cpu()  # a device mesh on gloo alone: gloo gathers host tensors
        out = torch.empty((dist.get_world_size(group) * gathered.numel(),), dtype=gathered.dtype,
                          device=gathered.device)
        all_gather(out, gathered.contiguous(), group=group)
        gathered = out
    # gathered along dim 0 first: its axes are (size of the last mesh dim, ..., size of dim 0, report)
    by_coordinate = gathered.reshape(*reversed(mesh.shape), length).permute(*reversed(range(mesh.ndim)), mesh.ndim)
    ranks = mesh.mesh.reshape(-1).tolist()
    rows = by_coordinate.reshape(-1, length).cpu().tolist()
    return sorted((rank, tuple(row)) for rank, row in zip(ranks, rows))


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


def check_replicated(mode: str, op: str, label: str, tensor: torch.Tensor, mesh: Any, device: torch.device) -> None:
    """Every rank of ``mesh`` holds exactly the same ``tensor`` (compared on ``device``, the mesh's)."""
    groups: dict = {}
    report = torch.cat([_report_tensor(tensor.shape, device), _fingerprint(tensor).to(device)])
    for rank, digest in _gather_mesh(mesh, report):
        groups.setdefault(digest, []).append(rank)
    if len(groups) > 1:
        described = "; ".join(f"ranks {members} agree" for members in groups.values())
        _report(mode, op, label, tensor, mesh, f"differs between ranks ({described})")


def check_local(mode: str, op: str, label: str, tensor: torch.Tensor, mesh: Any, placements: Sequence[Any],
                global_shape: Tuple[int, ...], device: torch.device) -> None:
    """This rank's piece has the shape ``global_shape`` and ``placements`` give it on every rank."""
    from .._torch.api import compute_local_shape_and_global_offset

    expected, _ = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    if tensor.dim() != len(global_shape):
        _report(mode, op, label, tensor, mesh, f"has {tensor.dim()} dims where the {global_shape} tensor its "
                f"placements {tuple(placements)} describe has {len(global_shape)}")
        return
    rows = _gather_mesh(mesh, _report_tensor((*tensor.shape, *expected), device))
    ndim = len(global_shape)
    bad = [(rank, row[:ndim], row[ndim:]) for rank, row in rows if row[:ndim] != row[ndim:]]
    if bad:
        detail = ", ".join(f"rank {rank} has {shape} (expected {want})" for rank, shape, want in bad)
        _report(mode, op, label, tensor, mesh, f"is not the piece of a {global_shape} tensor its placements "
                f"{tuple(placements)} imply: {detail}")

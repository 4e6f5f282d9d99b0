"""Which CUDA device each rank computes on: chosen before the process group and the mesh are built, and
checked once that no two ranks of one host share one.

Where the Keras integration builds the process group (``initialize()``) or a torch ``DeviceMesh``
(``_to_backend_mesh``), each rank's current CUDA device is set first, with torchrun's ``LOCAL_RANK``
(:func:`select_device`): NCCL's communicator, ``DTensor.from_local`` and ``distribute_tensor`` (which move
a tensor to ``mesh.device_type``, i.e. the *current* device) and the batches (:mod:`.distribution_lib`) all
use the current device. torch's ``DeviceMesh`` sets it itself only while CUDA is untouched; here it is set
also when CUDA was touched before (on device 0) and when the process group already exists. A device the
program chose itself (current device neither 0 nor ``LOCAL_RANK``) is kept, and so is the one device of
a rank that sees only one (``CUDA_VISIBLE_DEVICES`` per rank).

Then, once per process group and only under NCCL, :func:`check_one_rank_per_device` exchanges each rank's
(host, GPU UUID, device index, ``LOCAL_RANK``) in one small ``all_gather`` and raises
:class:`DeviceAssignmentError` naming the ranks, the device and the fix when two ranks of one host share a
GPU (``LOCAL_RANK`` unset, or more processes than GPUs): NCCL would otherwise fail at its first collective
with ``Duplicate GPU detected`` (or leave the other ranks waiting). On a group with a CPU backend
(``cpu:gloo,cuda:nccl``, what ``initialize()`` builds) the exchange goes over gloo and never touches NCCL;
on an NCCL-only group it is the group's first NCCL collective, and NCCL's own duplicate-GPU error is
turned into ours. Nothing here runs in a program that does not use the Keras integration's
``initialize()`` or mesh, nor without CUDA.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from ..._rules.errors import DeviceAssignmentError

log = logging.getLogger("keras_dtensor_mixfix")

WHAT_TO_DO = ("each rank needs a GPU of its own: call torch.cuda.set_device(int(os.environ[\"LOCAL_RANK\"])) "
              "before building the process group or mesh (keras.distribution.initialize() does so when the "
              "launcher sets LOCAL_RANK, as torchrun does), and start at most as many processes per host as it has "
              "GPUs (torchrun --nproc-per-node <= torch.cuda.device_count())")


def local_rank() -> Optional[int]:
    """torchrun's ``LOCAL_RANK`` (this process's index on its host), or None where the launcher set none."""
    raw = os.environ.get("LOCAL_RANK", "").strip()
    return int(raw) if raw.lstrip("-").isdigit() else None


def device_to_set(rank_on_host: Optional[int], count: int, current: int) -> Optional[int]:
    """The CUDA device index to make current, or None to leave the current one.

    ``rank_on_host``: ``LOCAL_RANK`` (None: unset); ``count``: the devices this process sees; ``current``:
    the current device (0 while CUDA is untouched). ``LOCAL_RANK`` is used when it names a device this
    process sees and the current device is still the default (0); a process that sees one device (per-rank
    ``CUDA_VISIBLE_DEVICES``) keeps it; a device the program chose (neither 0 nor ``LOCAL_RANK``) is kept;
    ``LOCAL_RANK`` past the devices is left to :func:`check_one_rank_per_device` to name.
    """
    if rank_on_host is None or count <= 1 or rank_on_host >= count or current == rank_on_host or current != 0:
        return None
    return rank_on_host


def select_device() -> Optional[int]:
    """Make ``LOCAL_RANK``'s CUDA device current where :func:`device_to_set` says so; the current device's
    index afterwards (None without CUDA). Cheap and idempotent: called before every group or mesh is built."""
    if not torch.cuda.is_available():
        return None
    current = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    index = device_to_set(local_rank(), torch.cuda.device_count(), current)
    if index is None:
        return current
    torch.cuda.set_device(index)
    log.info("keras_dtensor_mixfix: CUDA device cuda:%d made current (LOCAL_RANK) before the process group/mesh",
             index)
    return index


class Placement(NamedTuple):
    """One rank's device, as exchanged: hashes of host name and GPU identity, the index, LOCAL_RANK (-1: unset)."""

    host: int
    gpu: int
    index: int  # type: ignore[assignment]  # a field named like tuple.index, on purpose: it is the CUDA index
    rank_on_host: int


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "little", signed=True)


def gpu_identity(index: int) -> str:
    """The physical GPU behind ``index`` (its UUID; else its PCI address): the same GPU seen through different
    ``CUDA_VISIBLE_DEVICES`` has different indices and one identity."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return str(uuid)
    return ":".join(str(getattr(props, name, "?")) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id"))


def shared_devices(placements: Sequence[Placement]) -> Dict[Placement, List[int]]:
    """Each (host, GPU) that more than one rank computes on, with those ranks (placement of the lowest rank)."""
    ranks: Dict[tuple, List[int]] = {}
    first: Dict[tuple, Placement] = {}
    for rank, placement in enumerate(placements):
        key = (placement.host, placement.gpu)
        ranks.setdefault(key, []).append(rank)
        first.setdefault(key, placement)
    return {first[key]: on for key, on in ranks.items() if len(on) > 1}


def duplicate_error(shared: Dict[Placement, List[int]], placements: Sequence[Placement], me: int,
                    host: str) -> DeviceAssignmentError:
    """The error naming every shared device, its ranks, and what to do."""
    lines, by_device = [], {}
    mine = placements[me]
    for placement, ranks in shared.items():
        where = f"host {host}" if placement.host == mine.host else "one host"
        device = f"cuda:{placement.index} on {where}"
        by_device[device] = ranks
        rank_words = ", ".join(f"{r} (LOCAL_RANK "
                               f"{placements[r].rank_on_host if placements[r].rank_on_host >= 0 else 'unset'})"
                               for r in ranks)
        lines.append(f"  ranks {rank_words} all compute on {device}")
    return DeviceAssignmentError(
        "keras_dtensor_mixfix: two ranks of one host share one CUDA device, which NCCL refuses ('Duplicate GPU "
        "detected'):\n" + "\n".join(lines) + f"\n  what to do: {WHAT_TO_DO}.", by_device)


def _is_nccl_duplicate(exc: BaseException) -> bool:
    return "Duplicate GPU" in str(exc)


_checked: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()
"""The process groups already checked (once per group)."""


def check_one_rank_per_device(group: Any = None) -> None:
    """Under NCCL with CUDA: raise :class:`DeviceAssignmentError` if two ranks of one host share a GPU.

    Once per process group (``group``: the default one); one ``all_gather`` of four integers per rank, over the
    group's CPU backend where it has one. No-op without CUDA, without an initialized group, or under another
    backend (gloo ranks may share anything).
    """
    if not (torch.cuda.is_available() and dist.is_available() and dist.is_initialized()):
        return
    group = group if group is not None else dist.group.WORLD
    backend = str(dist.get_backend(group))
    if "nccl" not in backend:
        return
    try:
        if _checked.get(group):
            return
    except TypeError:  # a group object that cannot be weakly referenced: checked every time (still cheap)
        pass
    index = torch.cuda.current_device()
    rank_on_host = local_rank()
    host = socket.gethostname()
    mine = Placement(_hash(host), _hash(gpu_identity(index)), index, -1 if rank_on_host is None else rank_on_host)
    device = torch.device("cpu") if "cpu:" in backend else torch.device("cuda", index)
    size = dist.get_world_size(group)
    sent = torch.tensor(list(mine), dtype=torch.int64, device=device)
    received = torch.empty(size * len(mine), dtype=torch.int64, device=device)
    try:
        dist.all_gather_into_tensor(received, sent, group=group)
    except Exception as exc:  # only NCCL's duplicate-GPU error is ours to explain
        if not _is_nccl_duplicate(exc):
            raise
        me = dist.get_rank(group)
        raise DeviceAssignmentError(
            f"keras_dtensor_mixfix: rank {me} (LOCAL_RANK {rank_on_host if rank_on_host is not None else 'unset'}) "
            f"computes on cuda:{index} on host {host}, and another rank of this host on the same GPU, which NCCL "
            f"refuses ({str(exc).strip().splitlines()[-1]}).\n  what to do: {WHAT_TO_DO}.",
            {f"cuda:{index} on host {host}": [me]}) from exc
    rows = received.tolist()  # once per group (on CUDA: one synchronization, at initialize)
    placements = [Placement(*rows[i * len(mine):(i + 1) * len(mine)]) for i in range(size)]
    shared = shared_devices(placements)
    try:
        _checked[group] = True
    except TypeError:
        pass
    if shared:
        raise duplicate_error(shared, placements, dist.get_rank(group), host)

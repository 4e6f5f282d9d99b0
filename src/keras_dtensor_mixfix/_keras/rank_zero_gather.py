"""Whole values on rank 0 only: the pieces of a sharded tensor sent to rank 0, which alone assembles them.

Saving a Keras file under a distribution runs Keras' own save on every rank in the same order (the same code on
the same model), so each weight the file stores is met by every rank at the same point. Rank 0 then assembles it
from the pieces the other ranks send, one weight at a time, and writes it; the other ranks send their pieces and
keep nothing. ``all_gather`` would leave the whole weight on every rank.

Before each weight rank 0 says whether it still gathers (:data:`GATHER`) or has ended (:data:`ENDED`, or
:data:`FAILED` when its save raised), so that a rank 0 that stops early never leaves the others waiting for it.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np

from .._rules.errors import MixfixError
from . import keras_modules

GATHER, ENDED, FAILED = 1, 2, 3


class RankZeroStopped(MixfixError, RuntimeError):
    """Rank 0 ended a collective save before this rank had sent all its pieces."""


def _signal(code: int) -> int:
    import torch
    import torch.distributed as dist

    word = torch.tensor([code], dtype=torch.int64)
    dist.broadcast(word, src=0)
    return int(word.item())


def announce_end(failed: bool) -> None:
    """Rank 0: the save is over (every weight written, or it raised)."""
    _signal(FAILED if failed else ENDED)


def await_end() -> None:
    """A rank other than 0, once its own save is over: wait for rank 0's."""
    code = _signal(0)
    if code != ENDED:
        raise _stopped(code)


def _stopped(code: int) -> RankZeroStopped:
    if code == FAILED:
        return RankZeroStopped("keras_dtensor_mixfix: rank 0 raised while saving the file (its traceback says why); "
                               "this rank stopped with it")
    return RankZeroStopped("keras_dtensor_mixfix: rank 0 asked for a weight this rank's save never met: the ranks "
                           "saved different models or took different paths through Keras' save; save the same "
                           "model on every rank")


def as_stored(value: Any) -> Any:
    """The tensor a Keras store receives for ``value`` (a Variable's tensor; anything else as it is)."""
    if isinstance(value, keras_modules.base_variable_class()):
        storage = keras_modules.variable_storage(value)
        return value if storage is None else storage
    return value


def gather_whole(value: Any) -> Any:
    """Rank 0: ``value``'s global value as a NumPy array if it is a DTensor, else ``value`` unchanged."""
    from torch.distributed.tensor import DTensor

    value = as_stored(value)
    if not isinstance(value, DTensor):
        return value
    _signal(GATHER)
    whole = _assemble(value)
    try:
        return whole.numpy()  # the same memory: Keras' conversion would copy it (two whole weights at once)
    except TypeError:  # bfloat16 and other dtypes NumPy lacks: Keras' own conversion
        return keras_modules.core().convert_to_numpy(whole)


def send_piece(value: Any) -> None:
    """A rank other than 0: send this rank's piece of ``value`` (if a DTensor) to rank 0, keep nothing."""
    from torch.distributed.tensor import DTensor

    value = as_stored(value)
    if not isinstance(value, DTensor):
        return
    code = _signal(0)
    if code != GATHER:
        raise _stopped(code)
    _assemble(value)


def send_piece_for_placeholder(value: Any) -> np.ndarray:
    """:func:`send_piece`, returning an array of ``value``'s shape that takes no memory (it is never written)."""
    send_piece(value)
    return np.broadcast_to(np.zeros((), dtype=np.float32), tuple(value.shape))


def _assemble(value: Any) -> Optional[Any]:
    """Every rank calls this on the same DTensor; rank 0 returns the whole tensor, the others None."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    from .._torch.api import compute_local_shape_and_global_offset  # imports torch: not at the module's import

    value = value.detach()
    if not all(isinstance(p, (Shard, Replicate)) for p in value.placements):  # Partial: reduce it first
        value = value.redistribute(value.device_mesh, [Replicate()] * value.device_mesh.ndim)
    mesh, placements = value.device_mesh, tuple(value.placements)
    rank = dist.get_rank()
    senders = _senders(mesh, placements)
    local = value.to_local()
    if all(isinstance(p, Replicate) for p in placements):
        return local.clone() if rank == 0 else None
    if rank != 0:
        if rank in senders:
            shape, offset = compute_local_shape_and_global_offset(value.shape, mesh, placements)
            dist.send(torch.tensor(list(shape) + list(offset), dtype=torch.int64), dst=0)
            if local.numel():
                dist.send(local.contiguous(), dst=0)
        return None
    whole = torch.empty(value.shape, dtype=local.dtype, device=local.device)
    for sender in senders:
        if sender == 0:
            shape, offset = compute_local_shape_and_global_offset(value.shape, mesh, placements)
            piece = local
        else:
            header = torch.empty(2 * value.ndim, dtype=torch.int64)
            dist.recv(header, src=sender)
            shape, offset = tuple(header[:value.ndim].tolist()), tuple(header[value.ndim:].tolist())
            if 0 in shape:
                continue
            piece = torch.empty(shape, dtype=local.dtype, device=local.device)
            dist.recv(piece, src=sender)
        whole[tuple(slice(o, o + s) for o, s in zip(offset, shape))] = piece
    return whole


def _senders(mesh: Any, placements: Tuple[Any, ...]) -> List[int]:
    """The ranks holding distinct pieces: the first of each group of replicas (coordinate 0 where replicated)."""
    from torch.distributed.tensor import Shard

    ranks = mesh.mesh
    index = tuple(slice(None) if isinstance(p, Shard) else 0 for p in placements)
    return sorted(int(r) for r in np.asarray(ranks[index]).reshape(-1))

"""Whole values on rank 0 only: the pieces of a sharded tensor sent to rank 0, which alone assembles them.

Saving a Keras file under a distribution runs Keras' own save on every rank in the same order (the same code on
the same model), so each weight the file stores is met by every rank at the same point. Rank 0 then assembles it
from the pieces the other ranks send, one weight at a time, and writes it; the other ranks send their pieces and
keep nothing. ``all_gather`` would leave the whole weight on every rank.

Before each weight rank 0 says whether it still gathers (:data:`GATHER`) or has ended (:data:`ENDED`, or
:data:`FAILED` when its save raised), so that a rank 0 that stops early never leaves the others waiting for it.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from ..boundary import keras_modules, keras_private
from ..ranks.agreement import RankZeroStopped, from_rank_zero
from .array_proxy import ArrayProxy

GATHER, ENDED, FAILED = 1, 2, 3


def announce_end(failed: bool) -> None:
    """Rank 0: the save is over (every weight written, or it raised)."""
    global _outstanding
    if not failed:
        flush()
    _outstanding = None
    from_rank_zero(FAILED if failed else ENDED)


def await_end() -> None:
    """A rank other than 0, once its own save is over: wait for rank 0's."""
    code = from_rank_zero(0)
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
        storage = keras_private.variable_storage(value)
        return value if storage is None else storage
    return value


def gather_whole(value: Any) -> Any:
    """Rank 0: ``value``'s global value as a NumPy array if it is a DTensor, else ``value`` unchanged."""
    from torch.distributed.tensor import DTensor

    value = as_stored(value)
    if not isinstance(value, DTensor):
        return value
    flush()
    from_rank_zero(GATHER)
    return _as_numpy(_assemble(value))


def _as_numpy(whole: Any) -> np.ndarray:
    try:
        return whole.numpy()  # the same memory: Keras' conversion would copy it (two whole weights at once)
    except TypeError:  # bfloat16 and other dtypes NumPy lacks: Keras' own conversion
        return keras_modules.core().convert_to_numpy(whole)


def numpy_dtype(value: Any) -> Optional[np.dtype]:
    """The NumPy dtype of a tensor's values, or None where NumPy has none (bfloat16)."""
    import torch

    try:
        return torch.empty(0, dtype=value.dtype).numpy().dtype
    except TypeError:
        return None


class PendingWhole(ArrayProxy):
    """Rank 0: a sharded weight Keras asked for as an array (``variable.numpy()``), not gathered yet.

    A weight store streams it piece by piece into the file (:meth:`stream_into`); anything else that uses it as an
    array gets it gathered whole (:class:`ArrayProxy`). It is gathered, in the ranks' common order, before any later
    weight is.
    """

    def __init__(self, value: Any) -> None:
        self._value = value
        self._whole: Optional[np.ndarray] = None

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self._value.shape)

    @property
    def ndim(self) -> int:
        return self._value.ndim

    @property
    def dtype(self) -> Any:
        return numpy_dtype(self._value)

    @property
    def gathered(self) -> bool:
        return self._whole is not None or _outstanding is not self

    def whole_array(self) -> np.ndarray:
        global _outstanding
        if self._whole is None:
            if _outstanding is self:
                _outstanding = None
            from_rank_zero(GATHER)
            self._whole = _as_numpy(_assemble(self._value))
        return self._whole

    def stream_into(self, write: Callable[[Tuple[slice, ...], np.ndarray], None]) -> None:
        """Hand each distinct piece to ``write(index, values)`` as it arrives (no whole weight held)."""
        global _outstanding
        if self.gathered:
            write(tuple(slice(0, n) for n in self.shape), self.whole_array())
            return
        _outstanding = None
        from_rank_zero(GATHER)
        _pieces(self._value, lambda index, piece: write(index, piece.numpy()))


_outstanding: Optional[PendingWhole] = None


def pending_whole(value: Any) -> Any:
    """Rank 0: a DTensor (or a Variable holding one) as a :class:`PendingWhole`, or as :func:`gather_whole` gives it
    where NumPy has no dtype for it; anything else unchanged."""
    global _outstanding
    from torch.distributed.tensor import DTensor, Shard

    value = as_stored(value)
    if not isinstance(value, DTensor):
        return value
    if numpy_dtype(value) is None or not any(isinstance(p, Shard) for p in value.placements):
        return gather_whole(value)  # no NumPy dtype to stream with, or nothing to gather: rank 0 holds it whole
    flush()
    _outstanding = PendingWhole(value)
    return _outstanding


def flush() -> None:
    """Rank 0: gather the weight still pending, keeping the ranks' order (before any other, and at the end)."""
    if _outstanding is not None:
        _outstanding.whole_array()


def send_piece(value: Any) -> None:
    """A rank other than 0: send this rank's piece of ``value`` (if a DTensor) to rank 0, keep nothing."""
    from torch.distributed.tensor import DTensor

    value = as_stored(value)
    if not isinstance(value, DTensor):
        return
    code = from_rank_zero(0)
    if code != GATHER:
        raise _stopped(code)
    _pieces(value, None)


def send_piece_for_placeholder(value: Any) -> np.ndarray:
    """:func:`send_piece`, returning an array of ``value``'s shape that takes no memory (it is never written)."""
    send_piece(value)
    return np.broadcast_to(np.zeros((), dtype=np.float32), tuple(value.shape))


def _assemble(value: Any) -> Any:
    """Rank 0: the whole tensor, from its own piece and the pieces the other ranks send (:func:`_pieces`)."""
    import torch

    assembled: List[Any] = []

    def write(index: Tuple[slice, ...], piece: Any) -> None:
        if not assembled:
            if tuple(piece.shape) == tuple(value.shape):  # a replicated weight: rank 0's own copy, not a new one
                assembled.append(piece)
                return
            assembled.append(torch.empty(value.shape, dtype=value.dtype, device=piece.device))
        assembled[0][index] = piece

    _pieces(value, write)
    return assembled[0] if assembled else torch.empty(value.shape, dtype=value.dtype)


def _pieces(value: Any, write: Optional[Callable[[Tuple[slice, ...], Any], None]]) -> None:
    """Every rank calls this on the same DTensor: rank 0's ``write(index, piece)`` receives each distinct piece of
    it (its own and those the others send, one at a time); the other ranks send theirs (``write`` is None)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    from ..._engine.specs import region  # imports torch: not at the module's import
    from ..._torch.api import compute_local_shape_and_global_offset

    value = value.detach()
    if not all(isinstance(p, (Shard, Replicate)) for p in value.placements):  # Partial: reduce it first
        value = value.redistribute(value.device_mesh, [Replicate()] * value.device_mesh.ndim)
    mesh, placements = value.device_mesh, tuple(value.placements)
    rank = dist.get_rank()
    local = value.to_local()
    if all(isinstance(p, Replicate) for p in placements):
        if write is not None:
            write(tuple(slice(0, n) for n in value.shape), local)
        return
    senders = _senders(mesh, placements)
    if write is None:
        if rank in senders:
            shape, offset = compute_local_shape_and_global_offset(value.shape, mesh, placements)
            dist.send(torch.tensor(list(shape) + list(offset), dtype=torch.int64), dst=0)
            if local.numel():
                dist.send(local.contiguous(), dst=0)
        return
    for sender in senders:
        if sender == rank:
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
        if 0 not in shape:
            write(region(offset, shape), piece)


def _senders(mesh: Any, placements: Tuple[Any, ...]) -> List[int]:
    """The ranks holding distinct pieces: the first of each group of replicas (coordinate 0 where replicated)."""
    from torch.distributed.tensor import Shard

    ranks = mesh.mesh
    index = tuple(slice(None) if isinstance(p, Shard) else 0 for p in placements)
    return sorted(int(r) for r in np.asarray(ranks[index]).reshape(-1))

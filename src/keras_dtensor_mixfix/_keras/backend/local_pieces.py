"""Keras ops computed on each rank's own pieces: the one way out of DTensor and back in.

Where the integration knows an op's sharding better than DTensor's op-by-op propagation (an einsum whose
operands are split along one label, attention per batch row and head, a lookup in this rank's part of a
vocabulary, a loss over this rank's classes), it takes each operand's local piece, runs plain torch on the
pieces, and wraps the result as a DTensor with the placements that sharding gives: the pattern torch's
``local_map`` names. Every such op goes through the functions here:

- :func:`piece` takes a tensor to the placements the computation needs (a DTensor is redistributed, a plain
  tensor is taken as the same whole value on every rank) and returns this rank's piece, with the placements its
  gradient will have (a whole operand of a split computation gets a partial sum);
- :func:`from_pieces` wraps a piece as the DTensor it is a part of, given the global shape, so uneven pieces
  and partial sums need no collective to find it;
- :func:`on_pieces` is the two around one function; :func:`reduced` and :func:`gathered` are the collectives a
  computation may need between its local steps (one all-reduce or all-gather over one mesh dim).

All of it is differentiable (``to_local``, ``from_local`` and ``redistribute`` carry gradients), so the backward
is local too, and it traces under ``torch.compile`` (Keras' ``jit_compile``). torch's own ``local_map`` is not used:
it infers each result's global shape from its local one, which is wrong for uneven pieces.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple


def piece(tensor: Any, mesh: Any, placements: Sequence[Any], gradient: Optional[Sequence[Any]] = None) -> Any:
    """This rank's piece of ``tensor`` laid out with ``placements`` on ``mesh``; anything not a tensor as it is.

    Args:
        tensor: a DTensor (redistributed to ``placements`` first if it is laid out otherwise), a plain tensor (the
            same whole value on every rank: sliced, no communication) or anything else (returned unchanged).
        placements: one per mesh dim.
        gradient: the placements of the gradient that arrives at the piece (default: ``placements``), e.g. a
            partial sum for a whole operand of a computation split along a dim it lacks.

    Returns:
        The local tensor; its gradient flows back to ``tensor`` laid out as ``tensor`` is.
    """
    import torch
    from torch.distributed.tensor import DTensor, Replicate

    from .layouts import TorchLayout, relayout  # imports torch: not at the integration's import

    if not isinstance(tensor, torch.Tensor):
        return tensor
    if not isinstance(tensor, DTensor) and gradient is None and all(isinstance(p, Replicate) for p in placements):
        return tensor  # the whole value is this rank's piece
    laid_out = relayout(tensor, TorchLayout(mesh, tuple(placements)))
    if not isinstance(laid_out, DTensor):  # a symbolic tensor (tracing, shape inference): no pieces
        return laid_out
    return laid_out.to_local(grad_placements=None if gradient is None else tuple(gradient))


def from_pieces(local: Any, mesh: Any, placements: Sequence[Any], shape: Sequence[int],
                stride: Optional[Sequence[int]] = None) -> Any:
    """``local``, this rank's piece of a tensor of global ``shape`` laid out with ``placements``, as that DTensor.

    Args:
        local: this rank's piece (of a ``Partial`` placement: this rank's addend).
        shape: the global shape (``from_local`` is told it: no check, no communication).
        stride: the global stride; default contiguous, in which case a piece laid out otherwise (torch's
            attention returns a transposed view) is made contiguous first, since DTensor lowers a reshape it
            believes a view to ``view`` on the piece, which refuses a non-contiguous one (as when keras_hub's
            GPT-NeoX reshapes its attention output).

    Returns:
        The DTensor, differentiable with respect to ``local``.
    """
    import torch
    from torch.distributed.tensor import DTensor

    shape = torch.Size(shape)
    if stride is None:
        if not local.is_contiguous():
            local = local.contiguous()
        stride = contiguous_stride(shape)
    return DTensor.from_local(local, mesh, tuple(placements), run_check=False, shape=shape, stride=tuple(stride))


def on_pieces(function: Callable[..., Any], operands: Sequence[Any], mesh: Any,
              placements: Sequence[Optional[Sequence[Any]]], result_placements: Sequence[Any],
              result_shape: Sequence[int], gradients: Optional[Sequence[Optional[Sequence[Any]]]] = None) -> Any:
    """``function(*pieces)`` on this rank's pieces of ``operands``, as the DTensor of ``result_shape`` it is a part of.

    Args:
        operands: tensors (or anything else, passed as it is); ``placements[i]`` lays out ``operands[i]``
            (None: passed as it is) and ``gradients[i]`` names its gradient's placements (see :func:`piece`).
        result_placements: the placements the result's pieces have (a ``Partial`` where each rank holds an addend).

    Returns:
        A DTensor; gradients reach the operands laid out as they are.
    """
    gradients = gradients or [None] * len(operands)
    pieces = [operand if wanted is None else piece(operand, mesh, wanted, gradient)
              for operand, wanted, gradient in zip(operands, placements, gradients)]
    return from_pieces(function(*pieces), mesh, result_placements, result_shape)


def reduced(local: Any, mesh: Any, mesh_dim: int, reduce_op: str, placements: Sequence[Any],
            shape: Sequence[int]) -> Any:
    """``local``, this rank's addend of a tensor of global ``shape`` laid out with ``placements`` elsewhere, reduced
    with ``reduce_op`` (``"sum"``, ``"max"``, ...) over the ranks of ``mesh_dim``: one all-reduce; a local tensor."""
    from torch.distributed.tensor import Partial

    partial = [Partial(reduce_op) if dim == mesh_dim else p for dim, p in enumerate(placements)]
    return from_pieces(local, mesh, partial, shape).redistribute(mesh, tuple(placements)).to_local()


def gathered(local: Any, mesh: Any, mesh_dim: int, axis: int, placements: Sequence[Any],
             shape: Sequence[int]) -> Any:
    """Every rank of ``mesh_dim``'s ``local`` (size 1 along ``axis``) side by side along ``axis``, in rank order: one
    all-gather; a local tensor, laid out with ``placements`` on the other mesh dims (``shape``: the global shape
    of the tensor ``local`` is a piece of; its size along ``axis`` is not read)."""
    import torch
    from torch.distributed.tensor import Replicate, Shard

    ranks = mesh.size(mesh_dim)
    spread = [Shard(axis) if dim == mesh_dim else p for dim, p in enumerate(placements)]
    spread_shape = torch.Size(ranks if dim == axis else size for dim, size in enumerate(shape))
    whole = [Replicate() if dim == mesh_dim else p for dim, p in enumerate(placements)]
    return from_pieces(local, mesh, spread, spread_shape).redistribute(mesh, whole).to_local()


def first_index_here(length: int, mesh: Any, mesh_dim: int) -> int:
    """Where this rank's piece starts in a dim of ``length`` split by a plain ``Shard`` over ``mesh_dim``.

    ``torch.chunk``'s split, as DTensor's ``Shard`` makes it: pieces of ``ceil(length / ranks)``, the
    last ones short or empty. In Python integers: torch's own ``compute_local_shape_and_global_offset``
    reads the offset out of a tensor (``int(offsets[0])``, torch 2.13), which breaks TorchDynamo's graph,
    and inside Keras' ``name_scope`` such a break sends the whole frame back to be traced again.
    """
    size = -(-length // mesh.size(mesh_dim))
    return min(mesh.get_local_rank(mesh_dim) * size, length)


def contiguous_stride(shape: Sequence[int]) -> Tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (a dim of size 0 counted as 1, as torch does)."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))

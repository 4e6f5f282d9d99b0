"""Views a torch release's DTensor cannot run, refused with an error that names the release that runs them.

torch 2.11's DTensor cannot view a tensor so that a split dim folds into the dim before it (``(batch, heads, rows,
dim)`` with the heads split, viewed as ``(batch * heads, rows, dim)``): it raises ``Attempted to flatten multiple
dimensions, with dimension 1 being sharded``, with every operand a DTensor too
(``repros/torch_view_flatten_split_dim.py``; torch 2.12 and later give the flattened dim a strided split and run it
on local pieces). ``torch.matmul`` (``@``) of a tensor of more than three dims, or of one of three beside a matrix,
and ``scaled_dot_product_attention``'s math path (a mask that needs a gradient) make that view on their way to
``bmm``, so a user meets torch's text with nothing naming the op they called or what to do. 2.11's strided splits
cannot be carried further (its redistribution and ``mm`` refuse them), so the call is refused here, before DTensor's
own refusal, by :class:`~keras_dtensor_mixfix.ReleaseLimitationError`, which keeps torch's text and adds the shapes,
placements, mesh, the releases that run it and how to run it on this one.

The rules are dispatch rules for the view ops (single-tensor ops, which the promotion rules never hook), installed by
the lifecycle only on the releases the upstream-defect table lists for the defect; they return ``NotImplemented``
(torch's own path) for every view torch runs.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from .._rules.errors import ReleaseLimitationError, describe_mesh
from .._torch.versions import has_defect, running_torch_version

FLATTEN_DEFECT = "view_flatten_split_dim"
"""The upstream defect (``_upstream.DEFECTS``) these rules answer."""

VIEW_OPS = ("aten::view", "aten::_unsafe_view")
"""The view ops ``reshape``, ``flatten`` and ``matmul`` reach DTensor through."""

__all__ = ["FLATTEN_DEFECT", "VIEW_OPS", "folded_split_dim", "release_rules"]


def _resolved(size: Sequence[int], numel: int) -> Optional[Tuple[int, ...]]:
    """``size`` with its ``-1`` resolved against ``numel``; None where the view is invalid (torch then says why)."""
    sizes = tuple(size)
    if sizes.count(-1) > 1:
        return None
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if known == 0 or numel % known:
            return None
        sizes = tuple(numel // known if s == -1 else s for s in sizes)
    return sizes if math.prod(sizes) == numel else None


def _runs(shape: Sequence[int], out: Sequence[int]) -> Iterator[Tuple[List[int], List[int]]]:
    """The runs of a view of ``shape`` as ``out`` (equal element counts): input dims and output dims of equal
    products, in order; dims of size 1 join no run."""
    ins = [d for d, n in enumerate(shape) if n != 1]
    outs = [d for d, n in enumerate(out) if n != 1]
    a = b = 0
    while a < len(ins) and b < len(outs):
        run_in, run_out = [ins[a]], [outs[b]]
        product_in, product_out = shape[ins[a]], out[outs[b]]
        a, b = a + 1, b + 1
        while product_in != product_out:  # the totals are equal: a smaller side has dims left
            if product_in < product_out:
                run_in.append(ins[a])
                product_in *= shape[ins[a]]
                a += 1
            else:
                run_out.append(outs[b])
                product_out *= out[outs[b]]
                b += 1
        yield run_in, run_out


def folded_split_dim(shape: Sequence[int], size: Sequence[int], placements: Sequence[Any]) -> Optional[Tuple[int, int]]:
    """``(input dim, mesh dim)`` of a split dim that viewing ``shape`` as ``size`` folds into a dim before it: a run
    of several input dims (:func:`_runs`) is flattened, and only its first may be split. None where no split dim is
    folded, or the sizes are not plain integers, or the view is invalid (torch's own path then decides)."""
    from torch.distributed.tensor.placement_types import Shard

    if not all(type(s) is int for s in (*shape, *size)):
        return None
    numel = math.prod(shape)
    out = _resolved(size, numel)
    if out is None or numel == 0:
        return None
    split_on: Dict[int, int] = {}
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard) and len(shape):
            split_on.setdefault(placement.dim % len(shape), mesh_dim)
    for run_in, _ in _runs(shape, out):
        for dim in run_in[1:]:
            if dim in split_on:
                return dim, split_on[dim]
    return None


def _refusal(op_name: str, tensor: Any, size: Sequence[int], dim: int, mesh_dim: int) -> ReleaseLimitationError:
    from torch.distributed.tensor import Replicate

    placements = tuple(tensor.placements)
    replicated = list(placements)
    replicated[mesh_dim] = Replicate()
    version = running_torch_version()
    return ReleaseLimitationError(
        f"keras_dtensor_mixfix: {op_name}: torch {version}'s DTensor cannot view a tensor of shape "
        f"{tuple(tensor.shape)} as {tuple(size)}: the view folds dim {dim}, split over mesh dim {mesh_dim} "
        f"(placements {placements}, {describe_mesh(tensor.device_mesh)}, device {tensor.device}), into the dim "
        f"before it (torch: Attempted to flatten multiple dimensions, with dimension {dim} being sharded). "
        "torch.matmul (@) of a tensor of more than three dims, or of one of three beside a matrix, and "
        "scaled_dot_product_attention with a mask that needs a gradient make this view. torch 2.12 and later run "
        "it on each rank's pieces (repros/torch_view_flatten_split_dim.py). On this release, replicate that dim "
        "first: "
        f"x = x.redistribute(x.device_mesh, {replicated}) (its whole length on every rank of mesh dim {mesh_dim}), "
        "or upgrade torch to 2.12 or later.")


def _flatten_refusal_rule(op_name: str) -> Callable[..., Any]:
    from torch.distributed.tensor import DTensor

    def refuse_folding_a_split_dim(cls: Any, func: Any, types: Any, args: Tuple[Any, ...],
                                   kwargs: Dict[str, Any]) -> Any:
        if len(args) < 2 or type(args[0]) is not DTensor:
            return NotImplemented
        tensor, size = args[0], args[1]
        found = folded_split_dim(tuple(tensor.shape), tuple(size), tuple(tensor.placements))
        if found is None:
            return NotImplemented
        raise _refusal(op_name, tensor, size, *found)

    return refuse_folding_a_split_dim


def release_rules() -> Dict[str, Callable[..., Any]]:
    """The dispatch rule of each view op (qualified name -> rule) for the running torch: the defect table's releases
    of :data:`FLATTEN_DEFECT` get the refusal; every other release, none."""
    if not has_defect(FLATTEN_DEFECT, running_torch_version()):
        return {}
    return {qualname: _flatten_refusal_rule(qualname.replace("::", ".")) for qualname in VIEW_OPS}

"""Keras' ``reshape`` of a DTensor whose split DTensor cannot carry into the new shape: the split is gathered first.

DTensor keeps the split of a dimension that a reshape breaks into several only on the first of them, and only where
that first size divides the split's ranks. Grouped-query attention that reshapes queries split by heads into (key/value
heads, queries per head), as keras_hub's Gemma attentions do, breaks that rule once the query heads are split over
more ranks than there are key/value heads (4 query heads over 4 ranks, 2 key/value heads): DTensor raises "Cannot
unflatten unevenly sharded tensor ... Please redistribute the tensor before this operation". JAX reshards there by
itself, so a Keras model that trains sharded on JAX would stop here on torch.

Where DTensor refuses, the dimensions the reshape changes (those between the unchanged leading and trailing ones)
are gathered -- their ``Shard`` placements made ``Replicate`` -- and the reshape runs on that; the unchanged
dimensions keep their split. Values are the same; the cost is one gather of the activation, said once in a warning.
Where DTensor keeps the split, which is every reshape of a split it can carry, Keras' reshape runs as it is, and plain
tensors never reach the fallback.

The backward of a reshape is a reshape too, of the gradient, whose placements DTensor chose op by op and may differ
from the forward's. Where the gradient arrives split along a dimension the reshape changed more than the forward
output was (Mixtral's flattened tokens: split over "batch" forward, over "batch" and "model" in the gradient), the
reshape back can fail, and on a 2-D mesh with both axes on one dimension DTensor accepts it and computes a wrong local
shape ("shape '[1, 8, 16]' is invalid for input of size 64": ``repros/torch_view_two_axes_one_dim.py``). So the
gradient of a reshaped DTensor is laid out on those mesh axes as the forward output was before it is reshaped back
(an all-gather of the gradient there; none where it already is). In eager steps only: under ``torch.compile`` the
backward is traced, not hooked.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, List, Sequence, Tuple, cast

from ..._lifecycle.recorder import PatchRecorder
from ..boundary import keras_modules
from ..boundary.defects import running_release_has
from ..boundary.overrides import Override
from ..boundary.patches import rebind_everywhere

log = logging.getLogger("keras_dtensor_mixfix")

_warned: List[bool] = []

#: How DTensor's refusals in planning an op begin their second part (torch 2.12 to 2.15). Only such a refusal is
#: retried: every rank raises it alike, before any collective or local compute, so every rank retries; a failure in
#: the local compute may come on some ranks only, and a retry there would leave the others waiting in its gather.
_PLANNING_REFUSED = "Sharding propagation failed"


def _gathering_reshape(patches: PatchRecorder) -> None:
    original = keras_modules.backend_numpy().reshape
    # the gradient's layout only where torch has the defect the repro shows
    gradient_as_forward = running_release_has("view_two_axes_one_dim")
    rebind_everywhere(patches, original, _gathering_where_refused(original, gradient_as_forward))


OVERRIDE = Override(
    name="reshape", attributes=("reshape",),
    description="ops: reshape of a DTensor whose split DTensor cannot keep in the new shape gathers the reshaped "
                "dimensions first",
    apply=_gathering_reshape)


def _gathering_where_refused(original: Any, gradient_as_forward: bool) -> Any:
    laid_out = _gradient_split_as_forward if gradient_as_forward else _as_it_is

    @functools.wraps(original)
    def reshape(x: Any, newshape: Any) -> Any:
        try:
            return laid_out(x, original(x, newshape))
        except RuntimeError as refused:
            from torch.distributed.tensor import DTensor

            if not isinstance(x, DTensor) or _PLANNING_REFUSED not in str(refused):
                raise
            target = _resolved(tuple(x.shape), newshape)
            if target is None:  # not a shape this tensor can take: DTensor's error is the right one
                raise
            gathered = _placements_without_changed_splits(x, target)
            if gathered == tuple(x.placements):
                raise
            try:
                result = original(x.redistribute(x.device_mesh, gathered), newshape)
            except RuntimeError:
                raise refused from None
            _warn_once(x, target, gathered)
            return laid_out(x, result)

    return reshape


def _as_it_is(x: Any, result: Any) -> Any:
    return result


def _gradient_split_as_forward(x: Any, result: Any) -> Any:
    """Hook the reshape's backward node (not the tensor: the model may change the result in place, which a wrapping
    autograd function would forbid and after which a tensor hook no longer fires) to lay its gradient out first."""
    import torch
    from torch.distributed.tensor import DTensor

    if (torch.compiler.is_compiling() or not isinstance(result, DTensor) or not isinstance(x, DTensor)
            or result.grad_fn is None):
        return result
    changed = _changed_dims(tuple(result.shape), tuple(x.shape))
    if changed:
        result.grad_fn.register_prehook(functools.partial(_laid_out_as_forward, tuple(result.placements), changed))
    return result


def _laid_out_as_forward(placements: Tuple[Any, ...], changed: range, gradients: Tuple[Any, ...]) -> Any:
    """The gradient, laid out as the forward output was on each mesh axis where it is split along a dimension the
    reshape changed and the forward output was not split so (None: as it is)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    gradient = gradients[0]
    if not isinstance(gradient, DTensor) or len(gradient.placements) != len(placements):
        return None
    wanted = tuple((forward if forward.is_shard() else Replicate())
                   if arrived.is_shard() and cast(Shard, arrived).dim in changed and arrived != forward else arrived
                   for arrived, forward in zip(gradient.placements, placements))
    if wanted == tuple(gradient.placements):
        return None
    return (gradient.redistribute(gradient.device_mesh, wanted),) + tuple(gradients[1:])


def _changed_dims(shape: Sequence[int], other: Sequence[int]) -> range:
    """The dims of ``shape`` between those it shares with ``other`` at the front and at the back."""
    leading = 0
    while leading < min(len(shape), len(other)) and shape[leading] == other[leading]:
        leading += 1
    trailing = 0
    while (trailing < min(len(shape), len(other)) - leading
           and shape[len(shape) - 1 - trailing] == other[len(other) - 1 - trailing]):
        trailing += 1
    return range(leading, len(shape) - trailing)


def _resolved(shape: Sequence[int], newshape: Any) -> Any:
    """``newshape`` with its one -1 filled in, or None where it cannot be the shape of ``shape``'s elements."""
    newshape = tuple(int(size) for size in (newshape if isinstance(newshape, (list, tuple)) else (newshape,)))
    count = math.prod(shape)
    unknown = [i for i, size in enumerate(newshape) if size == -1]
    known = math.prod(size for size in newshape if size != -1)
    if len(unknown) > 1 or any(size < -1 for size in newshape):
        return None
    if unknown:
        if known == 0 or count % known:
            return None
        newshape = newshape[:unknown[0]] + (count // known,) + newshape[unknown[0] + 1:]
    return newshape if math.prod(newshape) == count else None


def _placements_without_changed_splits(x: Any, target: Tuple[int, ...]) -> Tuple[Any, ...]:
    from torch.distributed.tensor import Replicate

    changed = _changed_dims(tuple(x.shape), target)
    return tuple(Replicate() if placement.is_shard() and placement.dim in changed else placement
                 for placement in x.placements)


def _warn_once(x: Any, target: Tuple[int, ...], gathered: Tuple[Any, ...]) -> None:
    if _warned:
        return
    _warned.append(True)
    log.warning(
        "keras_dtensor_mixfix: reshape of a DTensor of shape %s, placements %s on mesh %s to %s: DTensor cannot "
        "keep that split in the new shape, so the reshaped dimensions are gathered first (placements %s) each time "
        "such a reshape runs. Values are unchanged. To save the gather, lay out the weight that produces it whole "
        "along that dimension, or split it over a number of ranks that divides the new shape's first factor there "
        "(grouped-query attention: the number of key/value heads)",
        tuple(x.shape), tuple(x.placements), x.device_mesh, target, gathered)

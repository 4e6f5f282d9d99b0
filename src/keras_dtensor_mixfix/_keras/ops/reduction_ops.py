"""Keras' extreme and logical reductions (``min``, ``max``, ``amin``, ``amax``, ``all``, ``any``, ``argmax``,
``argmin``) of a DTensor over a sharded axis.

- ``min``, ``max``, ``amin``, ``amax``, ``all`` and ``any`` over a sharded axis (a batch-sharded
  prompt under ``DataParallel``): DTensor returns a ``Partial`` result, and in torch 2.13 turning
  a ``Partial`` DTensor into a Python number (``item()``, ``int()``, ``bool()``, or indexing with it,
  as ``mask[:, index]`` does) reads this rank's unreduced value, with or without the package.
  keras_hub's ``generate()`` starts at ``index = ops.min(row_lengths)`` and so wrote each rank's
  tokens at its own (wrong) positions. These results are reduced at once (one all-reduce of a
  small result, which the next op that reads it would have needed anyway); ``sum``, ``mean`` and
  ``prod``, whose partial sums DTensor carries on into losses and gradients, are left as they are.
- ``max`` and ``min`` of a DTensor while compiling: Keras 3.12-3.15's break the graph (they read
  ``getattr(result, "values", None)``), which left keras_hub GPT-OSS's row maximum a graph output torch's
  backward fails on; the same reduction runs as ``amax``/``amin`` instead.
- ``argmax`` and ``argmin`` over a dim split on a 2-D mesh (a sparse categorical accuracy over
  vocabulary-split logits, one batch row per rank): DTensor's handler gathers the pieces and fails
  reshaping them ("shape '[1, 8, 2, 2, 8, 1]' is invalid for input of size 16"; torch 2.11 to 2.14, fixed in 2.15:
  repro ``repros/torch_argmax_2d.py``). On those releases an input split over two or more mesh dims is gathered
  along the reduced dim first (the mesh dims that split it become ``Replicate``); an input split
  over one mesh dim, and any input on a release without the defect, keeps DTensor's own handler, which gathers
  only each piece's winner.
"""

from __future__ import annotations

import functools
from typing import Any, cast

from ..._lifecycle.recorder import PatchRecorder
from ..backend.local_pieces import first_index_here, from_pieces, gathered, piece
from ..boundary import keras_modules
from ..boundary.defects import running_release_has
from ..boundary.overrides import Override
from ..boundary.patches import rebind_everywhere


def _settled_reductions(patches: PatchRecorder) -> None:
    numpy_module = keras_modules.backend_numpy()
    # max/min traced as amax/amin where torch gives a DTensor output no gradient reaches a plain tangent
    traceable = running_release_has("compile_dtensor_output_without_gradient")
    for name in SETTLED_REDUCTIONS:
        original = getattr(numpy_module, name, None)
        if original is not None:  # Keras 3.16 has no amin/amax of its own: ops.amin is ops.min
            settled = _settled_reduction(original)
            if traceable and name in ONE_VALUE_FORM and hasattr(numpy_module, ONE_VALUE_FORM[name]):
                settled = _traceable_extreme(settled, numpy_module, ONE_VALUE_FORM[name])
            rebind_everywhere(patches, original, settled)
    for name in ARG_REDUCTIONS:
        original = getattr(numpy_module, name)
        rebind_everywhere(patches, original, _whole_along_reduced(original))


SETTLED_REDUCTIONS = ("min", "max", "amin", "amax", "all", "any")


def _settled_reduction(original: Any) -> Any:
    @functools.wraps(original)
    def reduction(*args: Any, **kwargs: Any) -> Any:
        return settle_partial(original(*args, **kwargs))

    return reduction


ONE_VALUE_FORM = {"max": "amax", "min": "amin"}
"""Keras' ``max``/``min`` and the reduction that computes the same, with no ``initial``, on a non-empty tensor."""


def _traceable_extreme(settled: Any, numpy_module: Any, one_value_name: str) -> Any:
    """Keras' ``max``/``min`` of a DTensor, while TorchDynamo traces, as ``amax``/``amin``.

    Keras 3.12 to 3.15's ``max`` and ``min`` read ``getattr(result, "values", None)`` of their result, which
    TorchDynamo cannot type: a graph break in every model that takes a row maximum (keras_hub GPT-OSS's attention
    sinks). Breaking there leaves the maximum an output of the graph before the break, and when no gradient
    reaches it (it is subtracted for stability, without one) torch's backward fails on the plain zero it is given
    (``repros/torch_compile_dtensor_output_without_gradient.py``). ``amax``/``amin`` is the reduction Keras' own
    ``max``/``min`` runs along an axis (over every dim, ``torch.max(x)`` and ``torch.amax(x)`` give the same value
    and both split the gradient evenly among ties), so the value and its gradient are unchanged.
    """
    import torch
    from torch.distributed.tensor import DTensor

    @functools.wraps(settled)
    def extreme(x: Any, axis: Any = None, keepdims: bool = False, initial: Any = None) -> Any:
        if (initial is None and isinstance(x, DTensor) and 0 not in x.shape
                and torch.compiler.is_compiling()):
            return settle_partial(getattr(numpy_module, one_value_name)(x, axis=axis, keepdims=keepdims))
        return settled(x, axis=axis, keepdims=keepdims, initial=initial)

    return extreme


def settle_partial(value: Any) -> Any:
    """A DTensor with ``Partial`` placements, reduced to ``Replicate`` on those mesh dims
    (differentiably); anything else as is."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import Partial

    if not isinstance(value, DTensor) or not any(isinstance(p, Partial) for p in value.placements):
        return value
    return value.redistribute(value.device_mesh,
                              [Replicate() if isinstance(p, Partial) else p for p in value.placements])


ARG_REDUCTIONS = ("argmax", "argmin")


def _whole_along_reduced(original: Any) -> Any:
    from ..._torch.versions import has_defect, running_torch_version

    largest = original.__name__ == "argmax"
    # where DTensor's own handler cannot reduce a dim split on a 2-D mesh (the upstream-defect table says where)
    whole_first = has_defect("argmax_2d_mesh_one_row_per_rank", running_torch_version())
    # where its compiled argmax reads the piece's offset out of a tensor (a data-dependent graph break)
    pieces_when_compiled = running_release_has("dtensor_argmax_compiled")

    @functools.wraps(original)
    def reduction(x: Any, axis: Any = None, keepdims: bool = False) -> Any:
        found = winner_across_pieces(x, axis, keepdims, largest) if pieces_when_compiled else None
        if found is not None:
            return found
        return original(whole_along(x, axis) if whole_first else x, axis, keepdims)

    return reduction


def winner_across_pieces(value: Any, axis: Any, keepdims: bool, largest: bool) -> Any:
    """While compiling, ``argmax`` (``largest``) or ``argmin`` of a floating DTensor along an ``axis`` split by
    a plain ``Shard`` over one mesh dim, as Keras' int32; ``None`` where this does not apply.

    DTensor's own handler finds each piece's winner too, but reads the piece's offset out of a tensor
    (``int(offsets[0])``): a data-dependent graph break, which inside Keras' ``name_scope`` (a metric's
    sparse categorical accuracy over vocabulary-split logits) sends the whole frame back to be traced
    again. Here each rank takes its piece's winner and value, both are gathered over that mesh dim (one
    small all-gather each), and the best piece's index is kept: the first of equal values, as in one
    process, since pieces are in index order (``NaN`` wins, as in torch).
    """
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if (axis is None or not torch.compiler.is_compiling() or not isinstance(value, DTensor)
            or not value.dtype.is_floating_point or value.ndim == 0):
        return None
    axis = axis % value.ndim
    split = [mesh_dim for mesh_dim, p in enumerate(value.placements) if isinstance(p, Shard) and p.dim == axis]
    if (len(split) != 1 or type(value.placements[split[0]]) is not Shard
            or not all(isinstance(p, (Shard, Replicate)) for p in value.placements)):
        return None
    mesh, pieces_dim = value.device_mesh, split[0]
    local = piece(value, mesh, value.placements).detach()
    if local.shape[axis]:
        best, index = (local.max if largest else local.min)(dim=axis, keepdim=True)
    else:  # an empty last piece (uneven split): it never wins
        shape = tuple(1 if dim == axis else size for dim, size in enumerate(local.shape))
        best = local.new_full(shape, float("-inf") if largest else float("inf"))
        index = torch.zeros(shape, dtype=torch.int64, device=local.device)
    index = index + first_index_here(value.shape[axis], mesh, pieces_dim)
    best, index = (gathered(part, mesh, pieces_dim, axis, value.placements, value.shape) for part in (best, index))
    winner = (best.argmax if largest else best.argmin)(dim=axis, keepdim=True)
    found = index.gather(axis, winner)
    if not keepdims:
        found = found.squeeze(axis)
    placements = [Replicate() if mesh_dim == pieces_dim or isinstance(p, Replicate)
                  else Shard(cast(Shard, p).dim - (cast(Shard, p).dim > axis and not keepdims))
                  for mesh_dim, p in enumerate(value.placements)]
    shape = torch.Size(1 if dim == axis else size for dim, size in enumerate(value.shape) if keepdims or dim != axis)
    return from_pieces(found.to(torch.int32), mesh, placements, shape)


def whole_along(value: Any, axis: Any) -> Any:
    """A DTensor split over two or more mesh dims, gathered along ``axis`` (every dim when None); anything
    else as is."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(value, DTensor) or sum(isinstance(p, Shard) for p in value.placements) < 2:
        return value
    reduced = set(range(value.ndim)) if axis is None else {axis % max(value.ndim, 1)}
    wanted = tuple(Replicate() if isinstance(p, Shard) and p.dim in reduced else p for p in value.placements)
    if wanted == tuple(value.placements):
        return value
    return value.redistribute(value.device_mesh, wanted)


OVERRIDE = Override(
    name="reductions", attributes=SETTLED_REDUCTIONS + ARG_REDUCTIONS,
    description="ops: min, max, all and any over a sharded axis settled at once; argmax and argmin over a split dim",
    apply=_settled_reductions)

"""RMS normalization over an axis a DTensor splits: the rows made whole along that axis first.

Keras' ``ops.rms_normalization`` (the ``RMSNormalization`` layer) runs torch's ``F.rms_norm`` on the torch
backend. For a DTensor split along the normalized axis, DTensor takes the mean of squares over the pieces as a
pending average (``Partial(avg)``), and torch's CPU kernel then adds epsilon to it in place, which DTensor refuses:
"aten.add_.Scalar: in-place operations that require placement changes are not supported" (torch 2.12-2.15,
with or without the package). keras_hub's SmolLM3 meets it on a (2, 2) mesh wherever its activations come out of
an embedding whose hidden dim the layout splits over "batch": Keras' build call, before the first step, and
``generate()``.

Each row is normalized on its own, so the input is gathered along the normalized axes first (and a pending sum
reduced), and the norm runs on whole rows: one process's values, differentiably (the gradient goes back to the
input's placements). Everything else (plain tensors, DTensors whole along those axes) goes to Keras' own function
unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence, Set

from ..._lifecycle.recorder import PatchRecorder
from ..boundary import keras_private
from ..boundary.overrides import Override
from ..boundary.patches import rebind_everywhere


def _rms_normalization_on_whole_rows(patches: PatchRecorder) -> None:
    original = keras_private.rms_normalization_function()
    rebind_everywhere(patches, original, _on_whole_rows(original))


OVERRIDE = Override(
    name="rms_normalization", attributes=(keras_private.RMS_NORMALIZATION,),
    description="ops: rms_normalization of a DTensor split along the normalized axis runs on whole rows",
    apply=_rms_normalization_on_whole_rows)


def _on_whole_rows(original: Any) -> Any:
    @functools.wraps(original)
    def _rms_normalization(x: Any, scale: Any = None, axis: Any = -1, epsilon: Any = None) -> Any:
        return original(whole_along_axes(x, axis), scale=scale, axis=axis, epsilon=epsilon)

    return _rms_normalization


def whole_along_axes(x: Any, axis: Any) -> Any:
    """``x`` with every mesh dim that splits one of ``axis`` (an int or a sequence) made ``Replicate``, and pending
    sums reduced; anything else as is."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if not isinstance(x, DTensor) or x.ndim == 0:
        return x
    axes: Set[int] = {a % x.ndim for a in (axis if isinstance(axis, Sequence) else (axis,))}
    wanted = tuple(Replicate() if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim in axes) else p
                   for p in x.placements)
    if wanted == tuple(x.placements):
        return x
    return x.redistribute(x.device_mesh, wanted)

"""Keras' ``repeat`` of a DTensor by a whole number along an axis, as Keras 3.15 computes it, on older Keras.

Keras 3.12 to 3.14 make an ``int`` ``repeats`` a tensor and call ``torch.repeat_interleave``, which runs
as an ``index_select`` with a plain index tensor. On a DTensor split along another dimension (the
batch-split keys and values that keras_hub's grouped-query attention repeats over its heads, on a (2, 2)
mesh or under ``DataParallel``) its backward fails ("shape '[1, 8, 2, 2, 2]' is invalid for input of
size 256", "narrow unexpectedly changed concrete size"). Keras 3.15 repeats by an ``int`` with
``unsqueeze``, ``expand`` and ``reshape``, which DTensor shards along; the same is done here, for a
DTensor and an ``int`` with an axis only. Everything else is Keras' own ``repeat``; on a Keras whose
``repeat`` already expands (:func:`.keras_modules.repeat_expands_whole_numbers`) nothing is installed.
"""

from __future__ import annotations

import functools
from typing import Any

from ..._lifecycle.recorder import PatchRecorder
from ..boundary import keras_modules
from ..boundary.overrides import Override
from ..boundary.patches import rebind_everywhere


def _expanded_repeat_rebound(patches: PatchRecorder) -> None:
    original = keras_modules.backend_numpy().repeat
    rebind_everywhere(patches, original, _expanded_repeat(original))


OVERRIDE = Override(
    name="repeat",
    attributes=("repeat",), description="ops: repeat of a DTensor by a whole number expands it (as Keras 3.15 does)",
    apply=_expanded_repeat_rebound, needed=lambda: not keras_modules.repeat_expands_whole_numbers())
"""Before Keras 3.15."""


def _expanded_repeat(original: Any) -> Any:
    from torch.distributed.tensor import DTensor

    @functools.wraps(original)
    def repeat(x: Any, repeats: Any, axis: Any = None) -> Any:
        if not (isinstance(x, DTensor) and isinstance(repeats, int) and not isinstance(repeats, bool)
                and axis is not None):
            return original(x, repeats, axis=axis)
        axis = axis % x.ndim
        shape = list(x.shape)
        shape[axis] *= repeats
        expanded = [-1] * (x.ndim + 1)
        expanded[axis + 1] = repeats
        return x.unsqueeze(axis + 1).expand(expanded).reshape(shape)

    return repeat

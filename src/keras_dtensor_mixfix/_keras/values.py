"""Global values out: ``convert_to_numpy`` (so ``get_weights``, saving, History, ``predict``) gathers DTensors."""

from __future__ import annotations

import functools
from typing import Any

from . import keras_modules
from .._lifecycle.recorder import PatchRecorder
from .patches import rebind_everywhere


def install(patches: PatchRecorder) -> None:
    from torch.distributed.tensor import DTensor

    original = keras_modules.core().convert_to_numpy

    def _global(value: Any) -> Any:
        return value.full_tensor() if isinstance(value, DTensor) else value

    @functools.wraps(original)
    def convert_to_numpy(x: Any) -> Any:
        if isinstance(x, (list, tuple)):
            x = type(x)(_global(item) for item in x)
        else:
            x = _global(x)
        return original(x)

    rebind_everywhere(patches, original, convert_to_numpy)  # imported by name into several Keras namespaces

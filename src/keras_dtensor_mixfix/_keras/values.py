"""Global values out: ``convert_to_numpy`` (so ``get_weights``, saving, History, ``predict``) gathers DTensors."""

from __future__ import annotations

import functools
import sys
from typing import Any

from . import keras_modules
from .patches import Patches


def install(patches: Patches) -> None:
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

    # The function is imported by name into several Keras namespaces: rebind each of them.
    for name, module in list(sys.modules.items()):
        if (name == "keras" or name.startswith("keras.")) and getattr(module, "convert_to_numpy", None) is original:
            patches.set(module, "convert_to_numpy", convert_to_numpy)

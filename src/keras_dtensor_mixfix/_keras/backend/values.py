"""Global values out: ``convert_to_numpy`` (so ``get_weights``, saving, History, ``predict``) gathers DTensors."""

from __future__ import annotations

import functools
from typing import Any

from ..._lifecycle.recorder import PatchRecorder
from ..boundary import keras_modules
from ..boundary.overrides import Override
from ..boundary.patches import rebind_everywhere


def _gathering_conversion(patches: PatchRecorder) -> None:
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


OVERRIDE = Override(
    name="convert_to_numpy",
    attributes=("convert_to_numpy",), description="convert_to_numpy: gathers DTensors to global values",
    apply=_gathering_conversion, needed=lambda: not keras_modules.native_distribution_lib(),
    kept="convert_to_numpy: Keras' own kept")
"""Keras 3.16's own ``convert_to_numpy`` gathers DTensors already."""

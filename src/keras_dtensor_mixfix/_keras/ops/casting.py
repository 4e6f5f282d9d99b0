"""Keras' ``cast`` of a NumPy value while TorchDynamo traces: given as a torch tensor first.

A graph break at such a cast makes the cast value's consumer an input of the resumed graph, modified in place, which
torch's AOTAutograd gets wrong for a DTensor (``repros/torch_compile_mutated_dtensor_input.py``): installed on the
torch releases the upstream-defect table says have that defect.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from ..._lifecycle.recorder import PatchRecorder
from ..boundary import keras_modules
from ..boundary.defects import running_release_has
from ..boundary.overrides import Override
from ..boundary.patches import rebind_everywhere


def _cast_traceable(patches: PatchRecorder) -> None:
    core = keras_modules.core()
    rebind_everywhere(patches, core.cast, _traceable_cast(core.cast))


OVERRIDE = Override(
    name="cast", attributes=("cast",),
    description="ops: cast of a NumPy value traced as a tensor while compiling", apply=_cast_traceable,
    needed=lambda: running_release_has("compile_mutated_dtensor_input"),
    kept="ops: cast as Keras has it (this torch compiles an in-place change of a DTensor input right)")


def _traceable_cast(original: Callable[..., Any]) -> Callable[..., Any]:
    """Keras' ``cast``, given a NumPy value as a torch tensor first while TorchDynamo traces.

    TorchDynamo traces NumPy values as arrays, and Keras' ``convert_to_tensor`` reads ``x.dtype`` of one,
    which it cannot trace: a graph break. keras_hub Gemma's attention casts a NumPy scalar
    (``q *= ops.cast(1 / np.sqrt(head_dim), q.dtype)``), and the break there made ``q`` an input of the
    resumed graph, modified in place, which torch's AOTAutograd gets wrong for a DTensor
    (``repros/torch_compile_mutated_dtensor_input.py``). Same values: ``cast`` converts to the dtype it is
    given either way, on the device Keras would put the tensor on; in eager nothing changes.
    """
    import numpy as np
    import torch

    get_device = keras_modules.core().get_device

    @functools.wraps(original)
    def cast(x: Any, dtype: Any) -> Any:
        if isinstance(x, (np.ndarray, np.generic)) and torch.compiler.is_compiling():
            # Keras' own conversion places the tensor on its device; a CPU tensor would stay on the CPU
            x = torch.as_tensor(x, device=get_device())
        return original(x, dtype)

    return cast

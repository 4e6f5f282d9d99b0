"""A warning, once per variable, when ``ModelParallel``'s layout map leaves a large weight whole on every rank.

A user shards a model because it does not fit one device; a large weight no rule of the layout map matches (Llama3's
untied output projection under keras_hub's own map) is silently replicated, with its optimizer slots, and every
rank computes its whole matmul. The warning names the variable and a rule that would shard it.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from typing import Any, Optional, Set, Tuple

from ..._lifecycle.recorder import PatchRecorder
from ..boundary import keras_modules, keras_private
from ..boundary.overrides import Override

log = logging.getLogger("keras_dtensor_mixfix")

LARGE_WEIGHT_ELEMENTS = 1 << 24
"""Weights of this many elements or more (64 MB in float32) are worth a warning when left whole."""

_warned: Set[str] = set()


def _warning_when_left_whole(patches: PatchRecorder) -> None:
    model_parallel = keras_modules.distribution_module().ModelParallel
    original = model_parallel.get_variable_layout

    @functools.wraps(original)
    def get_variable_layout(self: Any, variable: Any) -> Any:
        layout = original(self, variable)
        _warn_if_left_whole(self, variable, layout)
        return layout

    patches.set(model_parallel, "get_variable_layout", get_variable_layout)


OVERRIDE = Override(
    name="large weights left whole", attributes=("get_variable_layout",),
    description="layouts: a large weight the layout map leaves whole is named in a warning",
    apply=_warning_when_left_whole)

def _warn_if_left_whole(distribution: Any, variable: Any, layout: Any) -> None:
    shape = tuple(int(d) for d in variable.shape)
    if math.prod(shape) < LARGE_WEIGHT_ELEMENTS or variable.path in _warned:
        return
    if layout is None or any(axis is not None for axis in getattr(layout, "axes", (None,))):
        return
    layout_map = keras_private.layout_map_of(distribution)
    if layout_map is not None and layout_map[variable.path] is not None:
        return  # the map says so: whole by choice
    suggestion = _sharding_rule(distribution, shape)
    if suggestion is None:
        return
    _warned.add(variable.path)
    rule_key = re.escape(variable.path)  # layout map keys are regular expressions matching the whole path
    log.warning(
        "keras_dtensor_mixfix: variable %s %s (%.0f MB) matches no rule of the layout map, so every rank holds it "
        "whole, with its optimizer slots, and computes all of its matmul: memory and time; layout_map[%r] = %r "
        "would shard both",
        variable.path, "x".join(map(str, shape)), math.prod(shape) * itemsize(variable) / 2**20, rule_key, suggestion)


def _sharding_rule(distribution: Any, shape: Tuple[int, ...]) -> Optional[Tuple[Optional[str], ...]]:
    """A layout putting the largest model axis on the largest dim it divides, or None if none divides."""
    mesh = distribution.device_mesh
    batch = getattr(distribution, "batch_dim_name", None)
    axes = [(size, name) for name, size in zip(mesh.axis_names, mesh.shape) if name != batch and size > 1]
    if not axes:
        return None
    size, axis = max(axes)
    dims = [d for d in range(len(shape)) if shape[d] % size == 0]
    if not dims:
        return None
    dim = max(dims, key=lambda d: (shape[d], d))
    return tuple(axis if d == dim else None for d in range(len(shape)))


def itemsize(variable: Any) -> int:
    """The bytes of one element of ``variable``'s dtype."""
    return dtype_itemsize(str(variable.dtype))


def dtype_itemsize(dtype: str) -> int:
    """The bytes of one element of a Keras dtype name: NumPy's, or for a dtype NumPy does not name, the bits its name
    gives (``"bfloat16"``: 2, ``"float8_e4m3fn"``: 1)."""
    import numpy as np

    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        bits = re.search(r"\d+", dtype)
        return max(1, int(bits.group()) // 8) if bits else 1

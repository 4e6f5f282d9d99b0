"""Initial values of Keras' element-wise random initializers, drawn piece by piece with values keyed by position.

Keras' ``RandomNormal``, ``TruncatedNormal``, ``RandomUniform`` and every ``VarianceScaling`` (Glorot, He, Lecun)
make a variable's value with one call of ``keras.random.normal``, ``truncated_normal`` or ``uniform`` of the
variable's whole shape, scaled by numbers computed from that shape. :func:`drawn_piece` runs the initializer with
those three functions answered by :mod:`.position_draws` for one box of the whole shape, so a rank draws only its
own piece, with the values the same positions of the whole tensor have: a function of the initializer's seed, the
variable's shape and dtype, and each element's position, whatever the mesh and the number of processes.

:func:`sharding_independent_initial_values` makes a process without a distribution draw the same way, whole: the
one-process reference a distributed job is compared with starts from the weights the job starts from.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, List, Optional, Sequence

from ..._lifecycle.thread_switch import ThreadSwitch
from ..boundary import keras_modules
from ..boundary.patches import replaced_for_the_call
from . import position_draws

log = logging.getLogger("keras_dtensor_mixfix")

_ELEMENTWISE = ("RandomNormal", "TruncatedNormal", "RandomUniform", "VarianceScaling")
"""Keras' initializers whose ``__call__`` is one draw of the whole shape, scaled: a subclass that keeps one of
these ``__call__`` methods (GlorotUniform and the rest of VarianceScaling's) draws the same way."""

_RANDOM_FUNCTIONS = {"normal": "normal", "truncated_normal": "truncated_normal", "uniform": "uniform"}
"""``keras.random``'s functions those initializers call, by the position-keyed kind that answers each."""

_SHARDING_INDEPENDENT = ThreadSwitch()
"""On within :func:`sharding_independent_initial_values`, in the thread that entered it."""


class _NotElementwise(Exception):
    """The initializer asked for something other than one draw of the variable's shape."""


def draws_by_position(initializer: Any) -> bool:
    """Whether ``initializer`` is one of Keras' element-wise random initializers with an int seed."""
    random_initializers = keras_modules.random_initializers_module()
    calls = {getattr(random_initializers, name).__call__ for name in _ELEMENTWISE
             if hasattr(random_initializers, name)}
    return (isinstance(getattr(initializer, "seed", None), int)
            and type(initializer).__module__.startswith(keras_modules.INITIALIZERS_PACKAGE)
            and type(initializer).__call__ in calls)


def drawn_piece(initializer: Any, shape: Sequence[int], dtype: Any, box: Sequence[slice]) -> Optional[Any]:
    """The piece ``box`` of ``initializer(shape, dtype)``, drawn alone (a CPU tensor of the box's shape); None where
    the initializer did not make its value with one draw of ``shape`` (Keras changed it), which the caller then
    draws as Keras does."""
    import torch

    core = keras_modules.core()
    shape = tuple(int(size) for size in shape)
    calls: List[str] = []

    def answering(kind: str) -> Any:
        def draw(*args: Any, **kwargs: Any) -> Any:
            bound = _bind(kind, *args, **kwargs)
            if calls or tuple(int(size) for size in bound["shape"]) != shape or not isinstance(bound["seed"], int):
                raise _NotElementwise(kind)
            calls.append(kind)
            torch_dtype = core.to_torch_dtype(bound["dtype"] or keras_modules.floatx())
            low, high = ((bound["minval"], bound["maxval"]) if kind == "uniform"
                         else (bound["mean"], bound["stddev"]))
            return position_draws.draw(kind, bound["seed"], shape, box, torch_dtype, float(low), float(high))

        return draw

    random_package = keras_modules.random_package()
    try:
        with replaced_for_the_call() as patches:
            for name, kind in _RANDOM_FUNCTIONS.items():
                patches.set(random_package, name, answering(kind))
            value = initializer(shape, dtype=dtype)
    except _NotElementwise as refused:
        log.debug("keras_dtensor_mixfix: %s drew more than one %s of shape %s; drawn as Keras does",
                  type(initializer).__name__, refused, shape)
        return None
    if len(calls) != 1 or not isinstance(value, torch.Tensor):
        return None
    return value.to(core.to_torch_dtype(dtype or keras_modules.floatx()))


def _bind(kind: str, *args: Any, **kwargs: Any) -> dict:
    """The backend's ``random.<kind>``'s arguments by name (its signature: shape, the two parameters, dtype, seed)."""
    names = ("shape",) + (("minval", "maxval") if kind == "uniform" else ("mean", "stddev")) + ("dtype", "seed")
    defaults = {"minval": 0.0, "maxval": 1.0, "mean": 0.0, "stddev": 1.0, "dtype": None, "seed": None}
    bound = dict(defaults)
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


@contextlib.contextmanager
def sharding_independent_initial_values() -> Iterator[None]:
    """Within (this thread): Keras' element-wise random initializers draw, with or without a distribution, the
    values a distributed job draws: a function of the seed, the shape, the dtype and each element's position, not of
    the mesh. A one-process reference built within starts from the weights a distributed job built from the same
    seeds starts from. Outside, without a distribution, Keras draws as it always does."""
    with _SHARDING_INDEPENDENT.on():
        yield


def sharding_independent() -> bool:
    """Whether :func:`sharding_independent_initial_values` is active in this thread."""
    return bool(_SHARDING_INDEPENDENT)

"""Layout-aware variables for a Keras whose torch ``Variable`` ignores layouts (3.12 to 3.15).

A variable with a layout holds an ``nn.Parameter`` wrapping a DTensor (on a mesh of one device in a one-process job,
Keras' own plain parameter: ``distribution_lib.on_one_device``); ``assign``,
``set_weights`` and loading keep the layout; printing never gathers. Before Keras 3.15 the torch
``Variable`` dropped its ``layout`` argument (the one optimizers pass to give a slot variable its
reference's layout): there it is kept as ``_layout``, as 3.15 keeps it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from ..._lifecycle.recorder import PatchRecorder
from ..boundary import keras_modules
from ..boundary.keras_private import (VARIABLE_DIRECT_ASSIGN, VARIABLE_INITIALIZE, VARIABLE_INITIALIZE_WITH_INITIALIZER,
                            convert_for_variable, set_variable_layout, set_variable_shape,
                            set_variable_storage, validated_shape, variable_dtype, variable_layout, variable_shape,
                            variable_storage)
from ..boundary.overrides import Override
from ..ranks.agreement import RankZeroStopped
from . import initial_values

log = logging.getLogger("keras_dtensor_mixfix")


def _layout_aware_variables(patches: PatchRecorder) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    from . import initial_pieces  # imports torch: not at the integration's import

    global_state = keras_modules.global_state()
    KerasVariable = keras_modules.base_variable_class()
    core = keras_modules.core()
    variable_class = core.Variable
    original_initialize = getattr(variable_class, VARIABLE_INITIALIZE)
    original_initialize_with_initializer = getattr(variable_class, VARIABLE_INITIALIZE_WITH_INITIALIZER)
    original_assign = getattr(variable_class, VARIABLE_DIRECT_ASSIGN)
    original_repr = KerasVariable.__repr__

    def _resolve_layout(self: Any, shape: Any) -> None:
        if variable_layout(self, None) is None:  # a subclass may skip __init__'s (copies, deserialization)
            distribution = global_state.get_global_attribute("distribution")
            if distribution is not None:
                if variable_shape(self, None) is None:  # array initializers arrive before the shape is set
                    set_variable_shape(self, validated_shape(self, shape))
                set_variable_layout(self, distribution.get_variable_layout(self))

    def _initialize_with_initializer(self: Any, initializer: Any) -> None:
        fill = _constant_fill(initializer)
        if fill is not None:
            _resolve_layout(self, variable_shape(self))
            layout = variable_layout(self, None)
            if layout is not None and not keras_modules.lib().on_one_device(layout):
                # zeros, ones, a constant (biases, an optimizer's slots): each rank fills its own piece, no collective
                set_variable_storage(self, initial_pieces.distribute_constant_variable(
                    variable_shape(self), fill, core.to_torch_dtype(variable_dtype(self)), layout,
                    trainable=self.trainable))
                return
        elif initial_values.draws_by_position(initializer):
            if _drawn_by_position(self, initializer):
                return
        if fill is None and _pure_random(initializer):
            shape = variable_shape(self)
            _resolve_layout(self, shape)
            lib = keras_modules.lib()
            layout = variable_layout(self, None)
            if layout is not None and initial_pieces.shards_across_processes(shape, layout):
                # a function of (seed, shape, dtype) alone: rank 0 draws it, the others only receive their pieces
                whole, failure = None, None
                if lib.process_id() == 0:
                    try:
                        whole = convert_for_variable(self, initializer(shape, dtype=variable_dtype(self)))
                    except Exception as error:  # noqa: BLE001  # said to the other ranks, then raised here
                        failure = error
                if not initial_pieces.rank_zero_succeeded(failure is None):
                    if failure is not None:
                        raise failure
                    raise RankZeroStopped(f"keras_dtensor_mixfix: rank 0 raised while drawing the initial value of "
                                         f"{self.path} (its traceback says why); this rank stopped with it")
                set_variable_storage(self, initial_pieces.distribute_variable_from_rank_zero(
                    whole, shape, core.to_torch_dtype(variable_dtype(self)), layout, trainable=self.trainable))
                return
        original_initialize_with_initializer(self, initializer)

    def _drawn_by_position(self: Any, initializer: Any) -> bool:
        """Under a distribution (or within ``sharding_independent_initial_values``): the variable's value drawn by
        position, each rank drawing only its own piece; False where the initializer turns out not to be one draw of
        the variable's shape (the caller draws as Keras does)."""
        shape = variable_shape(self)
        _resolve_layout(self, shape)
        layout = variable_layout(self, None)
        if layout is None and not initial_values.sharding_independent():
            return False
        dtype = variable_dtype(self)
        lib = keras_modules.lib()
        if layout is not None and not lib.on_one_device(layout):
            storage = initial_pieces.distribute_drawn_variable(
                lambda box: initial_values.drawn_piece(initializer, shape, dtype, box), tuple(shape), layout,
                trainable=self.trainable)
            if storage is None:
                return False
            set_variable_storage(self, storage)
            return True
        whole = initial_values.drawn_piece(initializer, shape, dtype, ())
        if whole is None:
            return False
        _initialize(self, whole)  # one device or no distribution: the whole value, through Keras' own path
        return True

    def _initialize(self: Any, value: Any) -> None:
        _resolve_layout(self, value.shape)
        layout = variable_layout(self)
        if layout is None or keras_modules.lib().on_one_device(layout):
            return original_initialize(self, value)  # (on one device: Keras' own variable, as without a distribution)
        if isinstance(value, torch.nn.Parameter) and not isinstance(value, DTensor):
            # A parameter shared with a torch module (TorchModuleWrapper): distributing a copy would
            # train a disconnected tensor, so it stays as it is.
            log.warning("keras_dtensor_mixfix: variable %s wraps a torch module's parameter; its layout is ignored",
                        self.path)
            return original_initialize(self, value)
        if isinstance(value, DTensor) and isinstance(value, torch.nn.Parameter):
            set_variable_storage(self, value)
            return
        tensor = core.convert_to_tensor(value, dtype=variable_dtype(self))
        set_variable_storage(self, keras_modules.lib().distribute_variable(tensor, layout, trainable=self.trainable))

    def _direct_assign(self: Any, value: Any) -> None:
        current = variable_storage(self)
        if not isinstance(current, DTensor):
            return original_assign(self, value)
        with torch.no_grad():
            if not isinstance(value, DTensor):
                value = core.convert_to_tensor(value, dtype=variable_dtype(self))
            # in place: the optimizer and the layer's ParameterDict hold this very object
            current.copy_(keras_modules.lib().distribute_tensor(value, (current.device_mesh, current.placements)))

    def __repr__(self: Any) -> str:
        value = variable_storage(self)
        if isinstance(value, DTensor):  # gathering here would hang when one rank prints alone
            return (f"<Variable path={self.path}, shape={self.shape}, dtype={self.dtype}, "
                    f"placements={tuple(value.placements)} (values not gathered)>")
        return original_repr(self)

    patches.set(variable_class, VARIABLE_INITIALIZE, _initialize)
    patches.set(variable_class, VARIABLE_INITIALIZE_WITH_INITIALIZER, _initialize_with_initializer)
    patches.set(variable_class, VARIABLE_DIRECT_ASSIGN, _direct_assign)
    patches.set(KerasVariable, "__repr__", __repr__)



OVERRIDE = Override(
    name="variables", attributes=(VARIABLE_INITIALIZE, VARIABLE_INITIALIZE_WITH_INITIALIZER, VARIABLE_DIRECT_ASSIGN,
                "__repr__"),
    description="variables: layouts become DTensor parameters", apply=_layout_aware_variables,
    needed=lambda: not keras_modules.native_layout_variables(),
    kept="variables: Keras' own layout-aware variables kept")
"""On Keras 3.12 to 3.15; 3.16's variables make DTensor parameters themselves."""


def _layout_argument_kept(patches: PatchRecorder) -> None:
    variable_class = keras_modules.core().Variable
    original_init = variable_class.__init__

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, layout: Any = None, **kwargs: Any) -> None:
        set_variable_layout(self, layout)  # read by _initialize, which the common __init__ calls
        original_init(self, *args, **kwargs)

    patches.set(variable_class, "__init__", __init__)


LAYOUT_ARGUMENT = Override(
    name="variable layout argument", attributes=("__init__",),
    description="variables: the layout given to a new variable kept (an optimizer's slot variables take their "
                "reference's)",
    apply=_layout_argument_kept,
    needed=lambda: not (keras_modules.native_layout_variables() or keras_modules.variables_take_layouts()))
"""On Keras 3.12 to 3.14, whose torch ``Variable`` drops its ``layout`` argument."""

def _constant_fill(initializer: Any) -> Any:
    """The one value a Keras Zeros, Ones or scalar Constant initializer fills with, else None."""
    import keras

    kind = type(initializer)
    if kind is keras.initializers.Zeros:
        return 0
    if kind is keras.initializers.Ones:
        return 1
    if kind is keras.initializers.Constant and isinstance(getattr(initializer, "value", None), (int, float)):
        return initializer.value
    return None


def _pure_random(initializer: Any) -> bool:
    """A Keras random initializer whose values depend on its int seed, the shape and the dtype only (no generator
    state: skipping the call changes no later draw)."""
    kind = type(initializer)
    return (isinstance(initializer, keras_modules.random_initializer_class())
            and kind.__module__.startswith(keras_modules.INITIALIZERS_PACKAGE)
            and isinstance(getattr(initializer, "seed", None), int))

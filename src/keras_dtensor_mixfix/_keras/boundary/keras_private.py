"""The private attributes of Keras objects the integration reads or writes, in one module.

:mod:`.keras_modules` names Keras' private *modules* (``keras.src``) and the releases supported; this module
names the private *attributes* of Keras objects (a ``Variable``'s ``_value``, a layer's ``_losses``, a weight
store's ``_h5_entry_group``...). Every other module of the integration goes through the accessors here
(``tests/unit/keras_integration/boundary/test_boundary_keras.py`` refuses a private read of a Keras object
elsewhere), and each accessor and name is exercised by a per-release check of the Keras self-check
(:mod:`..gate.checks`; a unit test holds that every name of :data:`__all__` appears in one). All are the same on
every release checked (:data:`.keras_modules.CHECKED_RELEASES`) unless said otherwise.

The methods the integration replaces on Keras classes are named by constants (``VARIABLE_DIRECT_ASSIGN``...):
the override reads the original with ``getattr(owner, NAME)`` and sets its replacement under the same name.
The accessors are plain functions on purpose: none is on a per-op path (a variable's are called when it is
made or assigned, a model's once per step).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from . import keras_modules

__all__ = [
    "VARIABLE_INITIALIZE", "VARIABLE_INITIALIZE_WITH_INITIALIZER", "VARIABLE_DIRECT_ASSIGN",
    "VARIABLE_INITIALIZE_DISTRIBUTED", "TRAINER_USE_TORCH_COMPILE", "TRAINER_INITIALIZE_DDP", "RMS_NORMALIZATION",
    "variable_storage", "set_variable_storage", "variable_layout", "set_variable_layout", "variable_shape",
    "set_variable_shape", "variable_dtype", "validated_shape", "convert_for_variable",
    "sublayers", "layer_tree", "CHANGED_BY_A_CALL", "python_state",
    "python_state_changes", "traceback_excluded_paths", "rms_normalization_function", "ddp_initializer",
    "dtensor_promotion_mode", "TRACEBACK_EXCLUDED_PATHS", "LAYOUT_MAP", "layout_map_of", "IS_MULTI_PROCESS",
    "is_multi_process",
    "h5_entry_group", "open_h5_entry_group",
]

VARIABLE_INITIALIZE = "_initialize"
"""The torch ``Variable``'s method that turns an initial value into the tensor it holds."""
VARIABLE_INITIALIZE_WITH_INITIALIZER = "_initialize_with_initializer"
"""The torch ``Variable``'s method that draws the initial value from an initializer, then initializes."""
VARIABLE_DIRECT_ASSIGN = "_direct_assign"
"""The torch ``Variable``'s method ``assign`` ends in (copies a value into the tensor held)."""
VARIABLE_INITIALIZE_DISTRIBUTED = "_initialize_distributed"
"""Keras 3.16's torch ``Variable`` method that makes a DTensor parameter under a layout (absent before 3.16)."""
TRAINER_USE_TORCH_COMPILE = "_use_torch_compile"
"""Keras 3.16's torch trainer method that says whether a step is compiled (absent before 3.16)."""
TRAINER_INITIALIZE_DDP = "_initialize_ddp"
"""Keras 3.16's torch trainer method that wraps a model in ``DistributedDataParallel`` (absent before 3.16)."""
RMS_NORMALIZATION = "_rms_normalization"
"""The function of ``keras.src.ops.nn`` that ``ops.rms_normalization`` calls on torch."""


# ----------------------------------------------------------------------------- a torch-backend Keras Variable

def variable_storage(variable: Any) -> Any:
    """The tensor a torch-backend Keras ``Variable`` holds (its ``_value``: an ``nn.Parameter``, whose data is a
    DTensor under a layout), or None before the variable is initialized."""
    return getattr(variable, "_value", None)


def set_variable_storage(variable: Any, tensor: Any) -> None:
    """Make a torch-backend Keras ``Variable`` hold ``tensor`` (its ``_value``), as it holds the one it was made
    with."""
    variable._value = tensor


def variable_layout(variable: Any, *default: Any) -> Any:
    """The layout a ``Variable`` was made with (``_layout``: a ``TensorLayout``, a backend layout or None; before
    3.15 the integration's ``__init__`` keeps it); ``default``, if given, where it keeps none, as ``getattr``."""
    return getattr(variable, "_layout", *default)


def set_variable_layout(variable: Any, layout: Any) -> None:
    """Keep ``layout`` as the ``Variable``'s ``_layout`` (what its initialization and an optimizer's slots read)."""
    variable._layout = layout


def variable_shape(variable: Any, *default: Any) -> Any:
    """The ``Variable``'s shape as its ``__init__`` validated it (``_shape``, a tuple); ``default``, if given, where it
    is not set yet, as ``getattr``."""
    return getattr(variable, "_shape", *default)


def set_variable_shape(variable: Any, shape: Any) -> None:
    variable._shape = shape


def variable_dtype(variable: Any) -> Any:
    """The ``Variable``'s own dtype (``_dtype``; its ``dtype`` property gives the autocast dtype inside an
    autocast scope)."""
    return variable._dtype


def validated_shape(variable: Any, shape: Any) -> Any:
    """``shape`` as the ``Variable``'s ``_validate_shape`` gives it (a tuple of ints)."""
    return variable._validate_shape(shape)


def convert_for_variable(variable: Any, value: Any) -> Any:
    """``value`` as the torch tensor the ``Variable`` would hold (its ``_convert_to_tensor``)."""
    return variable._convert_to_tensor(value)


# ----------------------------------------------------------------------------- layers, models, distributions

def sublayers(layer: Any) -> List[Any]:
    """A layer's direct sublayers, in the order it tracks them (``_flatten_layers``)."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def layer_tree(layer: Any) -> List[Any]:
    """A layer and every layer inside it, in the order Keras tracks them (``_flatten_layers``)."""
    return list(layer._flatten_layers(include_self=True, recursive=True))


CHANGED_BY_A_CALL = frozenset({"_called", "_parent_path", "_losses", "_loss_ids"})
"""What Keras sets on a layer at every call (``Layer.__call__``; ``add_loss``, whose losses the caller collects)."""


def python_state(layer: Any) -> Dict[Tuple[int, str], Any]:
    """Each layer of ``layer``'s tree: its plain attribute values and the lengths of its containers, by position and
    attribute name, apart from what Keras itself sets at every call (:data:`CHANGED_BY_A_CALL`): compared before and
    after a call, what the call changed of the layer's own Python state (a counter, a cache)."""
    plain = (type(None), bool, int, float, complex, str, bytes)
    state: Dict[Tuple[int, str], Any] = {}
    for index, sublayer in enumerate(layer_tree(layer)):
        for key, value in vars(sublayer).items():
            if key in CHANGED_BY_A_CALL:
                continue
            if isinstance(value, plain):
                state[index, key] = value
            elif isinstance(value, (list, dict, set)):
                state[index, key] = ("length", len(value))
    return state


def python_state_changes(before: Dict[Tuple[int, str], Any], layer: Any) -> List[str]:
    """The attribute names whose :func:`python_state` entries ``layer`` no longer has as in ``before`` (changed,
    added or gone), sorted."""
    after = python_state(layer)
    return sorted({key for _, key in set(before) ^ set(after)}
                  | {key for (index, key), value in before.items() if (index, key) in after
                     and after[index, key] != value})


LAYOUT_MAP = "_layout_map"
"""Where a ``ModelParallel`` keeps its ``LayoutMap`` (set by its ``__init__``)."""
IS_MULTI_PROCESS = "_is_multi_process"
"""Where a ``DataParallel`` or ``ModelParallel`` keeps whether it spans processes (set by its ``__init__``)."""


def layout_map_of(distribution: Any) -> Any:
    """A ``ModelParallel``'s ``LayoutMap`` (kept as ``_layout_map``), or None."""
    return getattr(distribution, LAYOUT_MAP, None)


def is_multi_process(distribution: Any) -> Any:
    """Whether a distribution spans processes, as Keras decided when it was made (``_is_multi_process``); False
    for an object that does not say."""
    return getattr(distribution, IS_MULTI_PROCESS, False)


TRACEBACK_EXCLUDED_PATHS = "_EXCLUDED_PATHS"
"""The tuple of paths in ``traceback_utils`` whose frames Keras' traceback filter hides."""


def traceback_excluded_paths() -> Any:
    """The paths whose frames Keras' traceback filter hides (``traceback_utils._EXCLUDED_PATHS``, a tuple)."""
    return getattr(keras_modules.traceback_utils(), TRACEBACK_EXCLUDED_PATHS)


def rms_normalization_function() -> Any:
    """``ops.nn._rms_normalization(x, scale, axis, epsilon)``, which ``ops.rms_normalization`` calls on torch."""
    return getattr(keras_modules.ops_nn(), RMS_NORMALIZATION)


def ddp_initializer() -> Any:
    """The trainer's ``_initialize_ddp`` (3.16: wraps a model in ``DistributedDataParallel``), or None."""
    return getattr(keras_modules.trainer_class(), TRAINER_INITIALIZE_DDP, None)


def dtensor_promotion_mode(core_module: Any) -> Any:
    """Keras 3.16's promotion mode on this thread's dispatch stack (``core_module._get_dtensor_promotion_mode()``,
    ``core_module`` being :func:`.keras_modules.core`), or None."""
    return core_module._get_dtensor_promotion_mode()


# ----------------------------------------------------------------------------- saving_lib's H5IOStore

def h5_entry_group(store: Any) -> Any:
    """The h5 group (or, for an entry with no weights, the empty dict) an ``H5IOStore`` reads and writes the
    current entry's weights in (``_h5_entry_group``), or None."""
    return getattr(store, "_h5_entry_group", None)


def open_h5_entry_group(store: Any) -> Any:
    """The h5 group an ``H5IOStore`` in a writing mode writes the current entry in, created first if it is not yet
    (as the store's own ``__setitem__`` does: ``_h5_entry_initialized``, ``_create_h5_group(_h5_entry_path)``)."""
    if not store._h5_entry_initialized:
        store._create_h5_group(store._h5_entry_path)
    return store._h5_entry_group

"""The Keras self-check's checks: one per Keras private name or behaviour the integration relies on.

Each check returns what it saw (one line) or raises when the running Keras does not have or do what the
integration's modules expect; :mod:`.selfcheck` runs them, in a process of their own. A name the integration
uses only where a Keras release has it (3.16's ``_initialize_ddp``, its promotion mode) is reported as present
or absent: both pass, since the integration reads :mod:`..boundary.keras_modules`' feature tests too. The names
are reached through the boundary, :mod:`..boundary.keras_modules`, as the integration reaches them.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Dict, Iterable, cast

from ..boundary import keras_modules, keras_private


@dataclasses.dataclass(frozen=True)
class KerasCheck:
    """One check: ``run()`` returns what it saw, or raises when Keras does not behave as the integration expects."""

    name: str
    relies_on: str
    run: Callable[[], str]


def _require(owner: Any, names: Iterable[str], what: str) -> None:
    missing = [name for name in names if not hasattr(owner, name)]
    if missing:
        raise AttributeError(f"{what} has no {', '.join(missing)}")


def _takes(function: Any, *parameters: str) -> None:
    found = inspect.signature(function).parameters
    missing = [name for name in parameters if name not in found]
    if missing:
        raise TypeError(f"{getattr(function, '__qualname__', function)} takes no {', '.join(missing)} "
                        f"(its parameters: {', '.join(found)})")


def _source_has(code: Any, *fragments: str) -> None:
    """``code``'s source holds each fragment (what an override relies on Keras' code doing, where no attribute or
    signature shows it)."""
    source = inspect.getsource(code)
    missing = [fragment for fragment in fragments if fragment not in source]
    if missing:
        raise AttributeError(f"{getattr(code, '__qualname__', code)} no longer has {', '.join(missing)}")


def check_modules() -> str:
    found = []
    for function in (keras_modules.core, keras_modules.backend_numpy, keras_modules.backend_nn,
                     keras_modules.trainer_module, keras_modules.backend_package, keras_modules.torch_backend_package,
                     keras_modules.distribution_module, keras_modules.global_state, keras_modules.data_adapters,
                     keras_modules.data_adapter_utils, keras_modules.saving_lib, keras_modules.rng_utils,
                     keras_modules.tree):
        found.append(function().__name__)
    return "found " + ", ".join(found)


def check_backend_distribution_lib() -> str:
    backend, distribution = keras_modules.backend_package(), keras_modules.distribution_module()
    _require(backend, ("distribution_lib",), backend.__name__)
    _require(distribution, ("distribution_lib",), distribution.__name__)
    if keras_modules.native_distribution_lib():
        return f"Keras' own torch distribution_lib ({keras_modules.lib().__name__}): kept and completed"
    return "None on the torch backend: the integration installs its own there"


def check_distribution_api() -> str:
    module = keras_modules.distribution_module()
    _require(module, ("distribution", "set_distribution", "DeviceMesh", "TensorLayout", "LayoutMap", "ModelParallel",
                      "DataParallel", "Distribution"), module.__name__)
    _require(module.Distribution, ("get_variable_layout", "get_data_layout", "batch_dim_name", "auto_shard_dataset"),
             "Distribution")
    _require(module.TensorLayout, ("axes", "device_mesh", "backend_layout"), "TensorLayout")
    _require(module.DeviceMesh, ("axis_names", "shape", "devices", "backend_mesh"), "DeviceMesh")
    _require(keras_modules.global_state(), ("get_global_attribute",), "global_state")
    mesh = module.DeviceMesh((1,), ["model"], ["cpu:0"])
    layout = module.TensorLayout([None, "model"], mesh)
    if tuple(layout.axes) != (None, "model") or tuple(mesh.axis_names) != ("model",):
        raise ValueError(f"TensorLayout/DeviceMesh keep axes {layout.axes!r}, {mesh.axis_names!r}")
    for distribution_class in (module.DataParallel, module.ModelParallel):
        _sets_in_init(distribution_class, keras_private.IS_MULTI_PROCESS)
    _sets_in_init(module.ModelParallel, keras_private.LAYOUT_MAP)
    if keras_private.layout_map_of(mesh) is not None or keras_private.is_multi_process(mesh) is not False:
        raise ValueError("layout_map_of/is_multi_process of an object that keeps neither are not None/False")
    return ("distribution(), DeviceMesh, TensorLayout (axes, backend_layout), Distribution layouts; DataParallel's and "
            "ModelParallel's _is_multi_process, ModelParallel's _layout_map")


def _sets_in_init(cls: type, attribute: str) -> None:
    """``cls``'s ``__init__`` (its own or inherited) sets ``self.<attribute>``: read from the source, since a
    distribution cannot be made here (before 3.15 it asks the backend's distribution_lib, None with the package
    off, for the process count)."""
    sources = [inspect.getsource(cast(Any, klass).__init__) for klass in cls.__mro__ if "__init__" in vars(klass)
               and klass is not object]
    if not any(f"self.{attribute} =" in source for source in sources):
        raise AttributeError(f"{cls.__qualname__}.__init__ sets no {attribute}")


def check_variable_internals() -> str:
    variable_class = keras_modules.core().Variable
    base = keras_modules.base_variable_class()
    if not issubclass(variable_class, base):
        raise TypeError(f"{variable_class.__qualname__} does not derive from the common Variable")
    _require(variable_class, (keras_private.VARIABLE_INITIALIZE, keras_private.VARIABLE_INITIALIZE_WITH_INITIALIZER,
                              keras_private.VARIABLE_DIRECT_ASSIGN, "_convert_to_tensor"), "the torch Variable")
    _require(keras_modules.core(), ("to_torch_dtype",), "the torch backend's core module")
    _require(base, ("_validate_shape", "__repr__", "path", "trainable", "value"), "the common Variable")
    variable = variable_class(initializer=[[1.0, 2.0]], dtype="float32", name="selfcheck_variable")
    for name in ("_value", "_dtype", "_shape"):
        if name not in vars(variable):
            raise AttributeError(f"a Variable keeps no {name} (has {', '.join(sorted(vars(variable)))})")
    import torch

    stored = keras_private.variable_storage(variable)
    if not isinstance(stored, torch.nn.Parameter):
        raise TypeError(f"a torch Variable holds a {type(stored).__name__}, not an nn.Parameter")
    shape, dtype = keras_private.variable_shape(variable), keras_private.variable_dtype(variable)
    if shape != (1, 2) or dtype != "float32" or keras_private.variable_shape(object(), None) is not None:
        raise ValueError(f"a Variable made with shape (1, 2), float32 keeps _shape {shape!r}, _dtype {dtype!r}")
    if keras_private.validated_shape(variable, [1, 2]) != (1, 2):
        raise ValueError("Variable._validate_shape([1, 2]) is not (1, 2)")
    converted = keras_private.convert_for_variable(variable, [[3.0, 4.0]])
    if not isinstance(converted, torch.Tensor) or converted.dtype != torch.float32:
        raise TypeError(f"Variable._convert_to_tensor gives {type(converted).__name__}, not a float32 tensor")
    keras_private.set_variable_shape(variable, shape)
    kept = keras_private.variable_layout(variable, None)  # None: made with no layout (or before 3.15, no _layout)
    marker = object()
    keras_private.set_variable_layout(variable, marker)
    if kept is not None or keras_private.variable_layout(variable) is not marker:
        raise ValueError(f"a Variable made with no layout keeps _layout {kept!r}")
    return ("torch Variable _initialize, _initialize_with_initializer, _direct_assign, _convert_to_tensor, "
            "_validate_shape; _value (an nn.Parameter), _dtype, _shape, _layout")


def check_variable_layouts() -> str:
    if keras_modules.native_layout_variables():
        _require(keras_modules.core().Variable, (keras_private.VARIABLE_INITIALIZE_DISTRIBUTED,), "the torch Variable")
        return "Keras' own layout-aware variables (_initialize_distributed): kept, its parameters hooked"
    if keras_modules.variables_take_layouts():
        return "the common Variable takes layout= and keeps it as _layout"
    _takes(keras_modules.base_variable_class().__init__, "kwargs")
    return "the common Variable drops layout= (before 3.15): the integration keeps it as _layout"


def check_optimizer_slot_layouts() -> str:
    source = inspect.getsource(keras_modules.base_optimizer_class().add_variable_from_reference)
    if "_layout" not in source:
        raise ValueError("BaseOptimizer.add_variable_from_reference no longer passes its reference's _layout: "
                         "optimizer slots of sharded variables would be whole on every rank")
    return "BaseOptimizer.add_variable_from_reference gives a slot its reference's _layout"


def check_trainer_steps() -> str:
    trainer_class = keras_modules.trainer_class()
    for kind in ("train", "test", "predict"):
        _takes(getattr(trainer_class, f"make_{kind}_function"), "force")
    _require(trainer_class, ("train_step", "_compute_loss", "compute_metrics"), trainer_class.__qualname__)
    _takes(trainer_class._compute_loss, "x", "y", "y_pred", "sample_weight", "training")  # the forked step calls it
    return f"{trainer_class.__qualname__}.make_*_function(force), train_step, _compute_loss, compute_metrics"


def check_compiled_step_state() -> str:
    import keras

    model = keras.Sequential([keras.layers.Dense(1, name="selfcheck_dense")], name="selfcheck_model")
    model.build((None, 2))
    model.compile(optimizer=keras.optimizers.SGD(name="selfcheck_sgd"), loss="mse")
    _require(model, ("_loss_tracker", "_call_has_training_arg", "_flatten_layers", "_clear_losses", "jit_compile",
                     "run_eagerly", "zero_grad", "train_function", "test_function", "predict_function"),
             "a compiled model")
    _require(model.layers[0], ("_losses",), "a layer")
    _require(model.optimizer, ("scale_loss", "apply"), "an optimizer")
    _require(keras_modules.data_adapter_utils(), ("unpack_x_y_sample_weight",), "data_adapter_utils")
    return ("model _loss_tracker, _call_has_training_arg, _flatten_layers, _clear_losses, zero_grad, *_function; "
            "layer _losses")


def check_compile_hooks() -> str:
    trainer_class = keras_modules.trainer_class()
    if keras_modules.native_promotion_mode():
        _require(trainer_class, (keras_private.TRAINER_USE_TORCH_COMPILE,), trainer_class.__qualname__)
        _require(keras_modules.core(), ("_get_dtensor_promotion_mode",), "the torch backend's core")
        mode = keras_private.dtensor_promotion_mode(keras_modules.core())
        if mode is not None:
            raise ValueError(f"_get_dtensor_promotion_mode() gives {mode!r} outside any distribution")
        return "Keras' promotion mode (activate_dtensor_promotion) and _use_torch_compile: replaced while patched"
    ddp = "present" if keras_private.ddp_initializer() is not None else "absent"
    return f"no promotion mode of Keras' own; {keras_private.TRAINER_INITIALIZE_DDP} {ddp}"


def check_backend_ops() -> str:
    from ..ops.activations import AFFECTED as ACTIVATIONS
    from ..ops.reduction_ops import ARG_REDUCTIONS

    _require(keras_modules.core(), ("convert_to_numpy", "convert_to_tensor", "cast", "get_device", "slice_update"),
             "the torch backend's core")
    _require(keras_modules.backend_numpy(),
             ("take", "einsum", "repeat", "reshape", "min", "max", "all", "any") + ARG_REDUCTIONS,
             "the torch backend's numpy")
    _require(keras_modules.backend_nn(), ("dot_product_attention", "one_hot", "sparse_categorical_crossentropy",
                                          "conv", "conv_transpose") + ACTIVATIONS,
             "the torch backend's nn")
    _require(keras_modules.ops_nn(), (keras_private.RMS_NORMALIZATION,), "Keras' ops.nn")
    _takes(keras_private.rms_normalization_function(), "x", "scale", "axis", "epsilon")
    for convolution in (keras_modules.backend_nn().conv, keras_modules.backend_nn().conv_transpose):
        _takes(convolution, "inputs", "kernel")
    _takes(keras_modules.backend_numpy().reshape, "x", "newshape")
    return ("core, numpy and nn functions rebound by name where Keras imported them; numpy.reshape (x, newshape); "
            "ops.nn._rms_normalization "
            "(x, scale, axis, epsilon); nn.conv and conv_transpose (inputs, kernel, ...)")


def check_traceback_filter() -> str:
    excluded = keras_private.traceback_excluded_paths()
    if not isinstance(excluded, tuple) or not all(isinstance(path, str) for path in excluded):
        raise TypeError(f"traceback_utils.{keras_private.TRACEBACK_EXCLUDED_PATHS} is {excluded!r}, not a tuple of "
                        "paths")
    return "traceback_utils._EXCLUDED_PATHS, a tuple of paths Keras' traceback filter hides"


def check_layer_call() -> str:
    layer = keras_modules.layer_class()
    if "__call__" not in vars(layer):
        raise AttributeError("Layer.__call__ is inherited, not Layer's own")
    return "Layer.__call__"


def check_layer_compile() -> str:
    import keras

    class Doubling(keras.layers.Layer):
        def call(self, x):
            return 2 * x

    outer = keras.Sequential([keras.layers.Dense(1, name="selfcheck_inner")], name="selfcheck_outer")
    outer.build((None, 1))
    tree = keras_private.layer_tree(outer)
    if tree[0] is not outer or outer.layers[0] not in tree:
        raise ValueError(f"_flatten_layers(include_self=True, recursive=True) gives {tree!r}")
    direct = keras_private.sublayers(outer)
    if outer in direct or outer.layers[0] not in direct:
        raise ValueError(f"_flatten_layers(include_self=False, recursive=False) gives {direct!r}")
    kernel = outer.layers[0].kernel
    stored = keras_private.variable_storage(kernel)
    keras_private.set_variable_storage(kernel, stored.detach() * 0)
    try:
        if float(keras.ops.sum(kernel.value)) != 0.0:
            raise ValueError("a Variable does not read the tensor set as its _value")
    finally:
        keras_private.set_variable_storage(kernel, stored)
    before = keras_private.python_state(outer)
    outer(keras.ops.ones((2, 1)))
    changed = keras_private.python_state_changes(before, outer)
    if changed:
        raise ValueError(f"a call sets {changed} beyond keras_private.CHANGED_BY_A_CALL")
    layer = Doubling()
    object.__setattr__(layer, "call", lambda x: 3 * x)  # what layer_compile does to a member of a group
    if float(layer(keras.ops.ones(()))) != 3.0:
        raise ValueError("Layer.__call__ does not call the call found on the instance")
    _check_stateless_scope(outer.layers[0])
    _require(keras_modules.initializer_class(), ("__call__", "get_config"), "Initializer")
    return ("_flatten_layers(include_self, recursive); a Variable reads the _value set on it; a call changes "
            "nothing of a layer's Python state but CHANGED_BY_A_CALL; Layer.__call__ calls the instance's call; "
            "StatelessScope (a Variable reads the value mapped to it, an assign goes to add_update, add_loss to its "
            "losses); Initializer")


def _check_stateless_scope(dense: Any) -> None:
    import keras

    scope_class = keras_modules.stateless_scope_class()
    _require(scope_class, ("add_update", "get_current_value", "add_loss"), "StatelessScope")
    kernel, bias = dense.kernel, dense.bias
    updates = []

    class Recording(scope_class):  # type: ignore[misc, valid-type]
        def add_update(self, update: Any) -> None:
            updates.append(update[0])
            super().add_update(update)

    zeros = keras.ops.zeros(kernel.shape)
    with Recording(state_mapping=[(kernel, zeros), (bias, keras.ops.zeros(bias.shape))],
                   collect_losses=True) as scope:
        if float(keras.ops.sum(dense(keras.ops.ones((1, 1))))) != 0.0:
            raise ValueError("a Variable in a StatelessScope does not read the value mapped to it")
        bias.assign(keras.ops.ones(bias.shape))
        dense.add_loss(keras.ops.ones(()))
        if updates != [bias] or float(keras.ops.sum(scope.get_current_value(bias))) != float(bias.shape[0]):
            raise ValueError("an assign in a StatelessScope does not go to its add_update")
        if len(scope.losses) != 1:
            raise ValueError("add_loss in a StatelessScope(collect_losses=True) does not go to its losses")


def check_data_and_saving() -> str:
    _require(keras_modules.data_adapters(), ("get_data_adapter", "is_tf_dataset"), "data_adapters")
    saving = keras_modules.saving_lib()
    for name in ("save_model", "save_weights_only"):
        _takes(getattr(saving, name), "model", "filepath")
    _require(saving, ("load_model", "load_weights_only", "H5IOStore", "ShardedH5IOStore", "safe_get_h5_dataset",
                      "is_memory_sufficient"), "saving_lib")
    for name in ("__getitem__", "__setitem__", "make"):
        if name not in vars(saving.H5IOStore):
            raise AttributeError(f"saving_lib.H5IOStore has no {name} of its own")
    _require(keras_modules.base_variable_class(), ("assign", "numpy"), "the common Variable")
    _require(keras_modules.random_initializer_class(), ("__init__",), "RandomInitializer")
    _require(keras_modules.rng_utils(), ("get_random_seed", "set_random_seed"), "rng_utils")
    _check_h5_entries(saving.H5IOStore)
    return ("get_data_adapter, is_tf_dataset; saving_lib.save_model/save_weights_only(model, filepath), "
            "load_model, load_weights_only, H5IOStore (make, __getitem__, __setitem__), ShardedH5IOStore, "
            "safe_get_h5_dataset, is_memory_sufficient, its entry's h5 group (_h5_entry_group, created by "
            "_create_h5_group(_h5_entry_path) unless _h5_entry_initialized); Variable.assign/numpy; "
            "RandomInitializer; rng_utils")


def check_callback_files() -> str:
    from ..files.callback_files import FILE_CALLBACKS, LOOKS, WRITES

    file_utils = keras_modules.file_utils()
    _require(file_utils, WRITES + LOOKS + ("File",), "file_utils")
    _takes(file_utils.File, "path", "mode")
    callbacks = keras_modules.callbacks_package()
    present = [name for name in FILE_CALLBACKS if hasattr(callbacks, name)]
    for name in ("BackupAndRestore", "ModelCheckpoint", "CSVLogger", "TensorBoard"):
        if name not in present:
            raise AttributeError(f"Keras' callbacks package has no {name}")
    # TensorBoard's writers write under the log_dir that set_model reads; OrbaxCheckpoint saves through its
    # checkpointer's save_checkpointables(_async)
    _source_has(callbacks.TensorBoard.set_model, "self.log_dir")
    if "OrbaxCheckpoint" in present:
        _source_has(callbacks.OrbaxCheckpoint, "self.checkpointer.save_checkpointables(",
                    "self.checkpointer.save_checkpointables_async(", "self.checkpointer.close()")
    return f"file_utils.{', '.join(WRITES + LOOKS)}, File(path, mode); callbacks {', '.join(present)}"


def _check_h5_entries(store_class: type) -> None:
    """An ``H5IOStore`` written through :func:`.keras_private.open_h5_entry_group` (as the streaming store writes a
    sharded weight) reads back the same, and its entry's group is :func:`.keras_private.h5_entry_group`."""
    import tempfile

    import numpy as np

    with tempfile.TemporaryDirectory() as directory:
        path = f"{directory}/selfcheck.weights.h5"
        store = store_class(path, mode="w")
        try:
            store.make("selfcheck_layer/vars")
            group = keras_private.open_h5_entry_group(store)
            group.create_dataset("0", shape=(2,), dtype="float32")[:] = np.array([1.0, 2.0], "float32")
        finally:
            store.close()
        store = store_class(path, mode="r")
        try:
            store.get("selfcheck_layer/vars")
            group = keras_private.h5_entry_group(store)
            if group is None or isinstance(group, dict) or list(np.asarray(store["0"])) != [1.0, 2.0]:
                raise ValueError(f"an H5IOStore entry written through its _h5_entry_group reads back {group!r}")
        finally:
            store.close()


CHECKS: Dict[str, KerasCheck] = {check.name: check for check in (
    KerasCheck("modules", "the Keras modules keras_modules names (torch backend, distribution, trainer, saving)",
               check_modules),
    KerasCheck("backend_distribution_lib", "the backend package's distribution_lib and the distribution module's",
               check_backend_distribution_lib),
    KerasCheck("distribution_api", "DeviceMesh, TensorLayout, Distribution's layouts, global_state",
               check_distribution_api),
    KerasCheck("variable_internals", "torch Variable _initialize, _direct_assign, _value, _dtype, _shape",
               check_variable_internals),
    KerasCheck("variable_layouts", "the Variable's layout argument / _layout, or _initialize_distributed",
               check_variable_layouts),
    KerasCheck("optimizer_slot_layouts", "BaseOptimizer.add_variable_from_reference passes _layout",
               check_optimizer_slot_layouts),
    KerasCheck("trainer_steps", "the torch trainer's make_*_function(force), train_step, _compute_loss",
               check_trainer_steps),
    KerasCheck("compiled_step_state", "a model's _loss_tracker, _call_has_training_arg, _flatten_layers, "
                                      "_clear_losses, *_function; a layer's _losses",
               check_compiled_step_state),
    KerasCheck("compile_hooks", "3.16's promotion mode and _use_torch_compile; _initialize_ddp", check_compile_hooks),
    KerasCheck("backend_ops", "the torch backend's core/numpy/nn functions the integration rebinds", check_backend_ops),
    KerasCheck("layer_call", "Layer.__call__", check_layer_call),
    KerasCheck("layer_compile", "_flatten_layers, a Variable's _value, Layer.__call__ calling the instance's call, "
                                "SeedGenerator, Initializer (compiling repeated blocks once)", check_layer_compile),
    KerasCheck("traceback_filter", "traceback_utils._EXCLUDED_PATHS (the paths Keras' filter hides)",
               check_traceback_filter),
    KerasCheck("data_and_saving", "get_data_adapter, saving_lib's save and load functions and weight stores (an "
                                  "H5IOStore entry's _h5_entry_group), Variable.assign/numpy, RandomInitializer, "
                                  "rng_utils", check_data_and_saving),
    KerasCheck("callback_files", "file_utils' write functions and File(path, mode); the file-writing callbacks",
               check_callback_files),
)}
"""Every check by name, in the order they run (tests replace one to simulate a Keras where it fails)."""

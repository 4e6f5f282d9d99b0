"""The train/test/predict step functions under a distribution.

Each ``make_*_function`` is wrapped so that its step, while a distribution is in force:

- brings Keras' own promotion mode in line with the patch state in the running thread
  (:func:`.promotion_mode.sync`; Keras 3.16);
- compiles with static shapes where :func:`.compile.static_shapes` says so;
- (made once per model) warns about layout map keys that match none of the model's variables
  (:func:`.sharding_report.warn_about_coverage`);
- on a Keras without data distribution of its own (3.12 to 3.15): receives its batches distributed along
  the batch axis, and returns logs and predictions as plain global tensors. Each process feeds the
  global batch and keeps its slice (no communication); with ``distribution.auto_shard_dataset =
  False`` each process feeds its own shard. Non-tf.data inputs are accepted in multi-process runs.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Dict, Tuple, cast

from ..._lifecycle.recorder import PatchRecorder
from ..boundary import keras_modules, keras_private
from ..boundary.overrides import Override
from ..layout_maps import sharding_report
from . import compile as compile_step
from . import layer_compile, promotion_mode


MakeWrapper = Callable[[Callable[..., Any], str], Callable[..., Any]]
"""Given a trainer's ``make_<kind>_function`` and the attribute it sets (``<kind>_function``), its replacement."""


def _each_make_function(wrapper: MakeWrapper) -> Callable[[PatchRecorder], None]:
    """An override's ``apply`` replacing the trainer's three ``make_*_function`` by ``wrapper``'s."""
    def apply(patches: PatchRecorder) -> None:
        trainer_class = keras_modules.trainer_class()
        for kind in ("train", "test", "predict"):
            original_make = getattr(trainer_class, f"make_{kind}_function")
            patches.set(trainer_class, f"make_{kind}_function", wrapper(original_make, f"{kind}_function"))

    return apply


def _wrapped_make(original_make: Callable[..., Any], attribute: str) -> Callable[..., Any]:
    def make(self: Any, force: bool = False) -> Any:
        existing = getattr(self, attribute)
        if existing is not None and not force:
            return existing
        promotion_mode.sync()  # whether Keras compiles depends on it
        active = keras_modules.distribution()
        if active is not None:
            sharding_report.warn_about_coverage(self, active)
        per_layer = False
        if compile_step.static_shapes(self):
            per_layer = compile_step.make_with_static_shapes(original_make, self, force)
        else:
            original_make(self, force=force)
        inner = getattr(self, attribute)
        if per_layer:
            inner = layer_compile.compiling_layers_in(inner)
        if compile_step.compiles_sharded_weights(self):
            inner = compile_step.keyed_by_rank(inner, self)

        def step(data: Any) -> Any:
            if keras_modules.distribution() is not None:
                promotion_mode.sync()
            return inner(data)

        setattr(self, attribute, step)  # Keras' own attribute, as Keras sets it (kept at uninstall: see below)
        return step

    return make


def _batches_distributed_by(original_make: Callable[..., Any], attribute: str) -> Callable[..., Any]:
    def make(self: Any, force: bool = False) -> Any:
        existing = getattr(self, attribute)
        if existing is not None and not force:
            return existing
        original_make(self, force=force)
        inner = getattr(self, attribute)

        def step(data: Any) -> Any:
            active = keras_modules.distribution()
            if active is None:
                return inner(data)
            return _make_global(inner(_distribute_batch(data, active)))

        setattr(self, attribute, step)
        return step

    return make


def _distribute_batch(data: Any, distribution: Any) -> Any:
    import torch
    from torch.distributed.tensor import DTensor

    tree = keras_modules.tree()
    convert_to_tensor = keras_modules.core().convert_to_tensor
    is_global = bool(getattr(distribution, "auto_shard_dataset", True))
    layouts = _layout_cache(distribution)
    lib = keras_modules.lib()

    def one(leaf: Any) -> Any:
        if leaf is None or isinstance(leaf, DTensor):
            return leaf
        if not isinstance(leaf, torch.Tensor):
            if not hasattr(leaf, "shape"):
                return leaf
            leaf = convert_to_tensor(leaf)
        if leaf.ndim == 0:
            return leaf
        shape = tuple(leaf.shape)
        layout = layouts.get(shape)
        if layout is None:
            layout = layouts[shape] = distribution.get_data_layout(shape).backend_layout
        return lib.distribute_data_input(leaf, layout, distribution.batch_dim_name, is_global=is_global)

    return tree.map_structure(one, data)


_layouts_of: "weakref.WeakKeyDictionary[Any, Dict[Tuple[int, ...], Any]]" = weakref.WeakKeyDictionary()
"""Per distribution, its data layout per batch shape; held here, not on the distribution (a user's object), and
forgotten at uninstall."""


def _layout_cache(distribution: Any) -> Dict[Tuple[int, ...], Any]:
    # get_data_layout builds a new TensorLayout (and its placements) per call: once per shape is enough.
    cache = _layouts_of.get(distribution)
    if cache is None:
        cache = _layouts_of[distribution] = {}
    return cache


def _forget_models_and_distributions() -> None:
    """At uninstall: the layers' replaced ``call`` removed (:func:`.layer_compile.uninstall`), the layout caches
    dropped. A model's step function made while installed stays Keras' ``train_function`` (and test, predict) until
    Keras makes it again (``compile()``): it is Keras' own attribute, which Keras sets itself."""
    layer_compile.uninstall()
    _layouts_of.clear()


def _make_global(result: Any) -> Any:
    import torch
    from torch.distributed.tensor import DTensor

    tree = keras_modules.tree()

    def one(leaf: Any) -> Any:
        if isinstance(leaf, DTensor):
            return cast(DTensor, leaf.detach()).full_tensor()  # detach() keeps the DTensor
        return leaf.detach() if isinstance(leaf, torch.Tensor) else leaf

    return tree.map_structure(one, result)


def _global_batches_accepted(patches: PatchRecorder) -> None:
    data_adapters = keras_modules.data_adapters()
    original = data_adapters.get_data_adapter

    @functools.wraps(original)
    def get_data_adapter(x: Any, *args: Any, **kwargs: Any) -> Any:
        distribution = keras_modules.distribution()
        if (distribution is not None and keras_private.is_multi_process(distribution)
                and getattr(distribution, "auto_shard_dataset", False) and not data_adapters.is_tf_dataset(x)):
            # Keras requires tf.data here; each process iterates the global batch instead and the
            # step keeps this process's slice (see _distribute_batch).
            distribution.auto_shard_dataset = False
            try:
                return original(x, *args, **kwargs)
            finally:
                distribution.auto_shard_dataset = True
        return original(x, *args, **kwargs)

    patches.set(data_adapters, "get_data_adapter", get_data_adapter)


STEP_FUNCTIONS = Override(
    name="step functions", attributes=("make_train_function", "make_test_function", "make_predict_function"),
    description="trainer: step functions wrapped", apply=_each_make_function(_wrapped_make),
    undo=_forget_models_and_distributions)
"""Every step: the promotion mode synced, compiled with static shapes (or per layer)."""

BATCHES_DISTRIBUTED = Override(
    name="batches distributed", attributes=("make_train_function", "make_test_function", "make_predict_function"),
    description="trainer: batches distributed on the batch axis; logs and predictions made global",
    apply=_each_make_function(_batches_distributed_by), after=("step functions",),
    needed=lambda: not keras_modules.native_data_distribution(), kept="trainer: Keras' own data distribution kept")
"""On a Keras without data distribution of its own (3.12 to 3.15): each step's batches are distributed before the
wrapped step (:data:`STEP_FUNCTIONS`) runs, and its results made global after."""

DATA_ADAPTER = Override(
    name="data adapter", attributes=("get_data_adapter",),
    description="trainer: inputs other than tf.data accepted in multi-process runs (each process iterates the "
                "global batch)",
    apply=_global_batches_accepted, needed=lambda: not keras_modules.native_data_distribution())
"""On a Keras without data distribution of its own (3.12 to 3.15)."""

"""Make ``keras.distribution`` (ModelParallel, DataParallel) train on the torch backend.

``install()`` (run automatically when Keras is imported with the torch backend and
auto-activation is on) adds, only where the installed Keras lacks them:

- a torch ``distribution_lib`` (:mod:`keras_dtensor_mixfix._keras_distribution_lib`);
- layout-aware variables: a variable with a layout holds an ``nn.Parameter`` wrapping a DTensor;
  ``assign``/``set_weights``/loading keep the layout;
- global values out: ``convert_to_numpy`` (so ``get_weights``, saving, History, ``predict``)
  gathers DTensors; printing a variable never gathers;
- input batches distributed along the batch axis before each train/test/predict step,
  with logs and predictions returned as plain global tensors;
- non-tf.data inputs accepted in multi-process runs (each process iterates the global batch
  and keeps its slice; with ``distribution.auto_shard_dataset = False`` each process feeds its own shard);
- ``jit_compile=True`` under a distribution compiles with ``aot_eager`` and static shapes;
- saving writes files from rank 0 only (every rank still takes part in gathering).

``uninstall()`` restores every attribute it replaced.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
import tempfile
import threading
from typing import Any, Callable, List, Optional, Tuple

log = logging.getLogger("keras_dtensor_mixfix")

__all__ = ["install", "uninstall", "is_installed", "report"]

_lock = threading.RLock()
_installed: Optional["_Patches"] = None
_report: List[str] = []
_patched_here = False


class _Patches:
    """Records replaced attributes and restores them in reverse order, only where still ours."""

    def __init__(self) -> None:
        self._undo: List[Tuple[Any, str, Any, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        previous = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, _MISSING)
        setattr(owner, name, value)
        self._undo.append((owner, name, previous, value))

    def restore(self) -> None:
        while self._undo:
            owner, name, previous, ours = self._undo.pop()
            current = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, _MISSING)
            if current is not ours:
                log.warning("keras_dtensor_mixfix: %s.%s was replaced by someone else; left as it is",
                            getattr(owner, "__name__", owner), name)
                continue
            if previous is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)


_MISSING = object()

REQUIRED_LIB_NAMES = (
    "list_devices", "get_device_count", "initialize", "num_processes", "process_id", "distribute_tensor",
    "distribute_variable", "distribute_data_input", "_to_backend_mesh", "_to_backend_layout", "_to_backend_device",
)


def is_installed() -> bool:
    return _installed is not None


def report() -> List[str]:
    """What ``install()`` added (for ``doctor``)."""
    return list(_report)


def install() -> bool:
    """Install into the imported Keras; returns False (and does nothing) unless its backend is torch."""
    global _installed
    with _lock:
        if _installed is not None:
            return True
        from keras.src.backend.config import backend

        if backend() != "torch":
            log.debug("keras_dtensor_mixfix: Keras backend is %s, not torch: nothing to install", backend())
            return False
        patches = _Patches()
        added: List[str] = []
        try:
            _install_distribution_lib(patches, added)
            if _native_layout_variables():
                added.append("variables: Keras' own layout-aware variables kept")
            else:
                _install_variables(patches)
                added.append("variables: layouts become DTensor parameters")
            _install_numpy(patches)
            added.append("convert_to_numpy: gathers DTensors to global values")
            if _native_data_distribution():
                added.append("trainer: Keras' own data distribution kept")
            else:
                _install_trainer(patches)
                _install_data_adapter(patches)
                added.append("trainer: batches distributed on the batch axis; logs and predictions made global")
            _install_saving(patches)
            added.append("saving: rank 0 writes")
        except BaseException:
            patches.restore()
            raise
        _installed = patches
        _report[:] = added
        from ._lifecycle.patching import is_patched, patch

        global _patched_here
        if not is_patched():
            patch()  # promotion is the safety net for plain tensors that still meet DTensors
            _patched_here = True
        log.info("keras_dtensor_mixfix: Keras distribution support installed (%s)", "; ".join(added))
        return True


def uninstall() -> None:
    global _installed
    with _lock:
        if _installed is None:
            return
        _installed.restore()
        _installed = None
        _report.clear()
        global _patched_here
        if _patched_here:  # undo only the patch install() made
            from ._lifecycle.patching import unpatch

            _patched_here = False
            unpatch()


# --------------------------------------------------------------------------- distribution_lib


def _install_distribution_lib(patches: _Patches, added: List[str]) -> None:
    import keras.src.backend as backend_module
    import keras.src.distribution.distribution_lib as distribution_module

    from . import _keras_distribution_lib as ours
    native = getattr(backend_module, "distribution_lib", None)
    if native is None:
        patches.set(backend_module, "distribution_lib", ours)
        patches.set(distribution_module, "distribution_lib", ours)
        added.append("distribution_lib: torch backend installed")
        return
    missing = [name for name in REQUIRED_LIB_NAMES if not hasattr(native, name)]
    for name in missing:
        patches.set(native, name, getattr(ours, name))
    if getattr(distribution_module, "distribution_lib", None) is None:
        patches.set(distribution_module, "distribution_lib", native)
    added.append(f"distribution_lib: Keras' own kept, added {missing or 'nothing'}")


def _lib() -> Any:
    import keras.src.backend as backend_module

    return backend_module.distribution_lib


def _distribution() -> Any:
    from keras.src.distribution import distribution_lib

    return distribution_lib.distribution()


# --------------------------------------------------------------------------- variables


def _native_layout_variables() -> bool:
    from keras.src.backend.torch import core

    return "_initialize_layout" in vars(core.Variable)


def _install_variables(patches: _Patches) -> None:
    import torch
    from keras.src.backend.common import global_state
    from keras.src.backend.common.variables import Variable as KerasVariable
    from keras.src.backend.torch import core
    from torch.distributed.tensor import DTensor

    variable_class = core.Variable
    original_initialize = variable_class._initialize
    original_assign = variable_class._direct_assign
    original_repr = KerasVariable.__repr__

    def _initialize(self: Any, value: Any) -> None:
        if self._layout is None:
            distribution = global_state.get_global_attribute("distribution")
            if distribution is not None:
                if getattr(self, "_shape", None) is None:  # array initializers arrive before the shape is set
                    self._shape = self._validate_shape(value.shape)
                self._layout = distribution.get_variable_layout(self)
        if self._layout is None:
            return original_initialize(self, value)
        if isinstance(value, torch.nn.Parameter) and not isinstance(value, DTensor):
            # A parameter shared with a torch module (TorchModuleWrapper): distributing a copy would
            # train a disconnected tensor, so it stays as it is.
            log.warning("keras_dtensor_mixfix: variable %s wraps a torch module's parameter; its layout is ignored",
                        self.path)
            return original_initialize(self, value)
        if isinstance(value, DTensor) and isinstance(value, torch.nn.Parameter):
            self._value = value
            return
        tensor = core.convert_to_tensor(value, dtype=self._dtype)
        self._value = _lib().distribute_variable(tensor, self._layout, trainable=self.trainable)

    def _direct_assign(self: Any, value: Any) -> None:
        current = self._value
        if not isinstance(current, DTensor):
            return original_assign(self, value)
        with torch.no_grad():
            if not isinstance(value, DTensor):
                value = core.convert_to_tensor(value, dtype=self._dtype)
            # in place: the optimizer and the layer's ParameterDict hold this very object
            current.copy_(_lib().distribute_tensor(value, (current.device_mesh, current.placements)))

    def __repr__(self: Any) -> str:
        value = getattr(self, "_value", None)
        if isinstance(value, DTensor):  # gathering here would hang when one rank prints alone
            return (f"<Variable path={self.path}, shape={self.shape}, dtype={self.dtype}, "
                    f"placements={tuple(value.placements)} (values not gathered)>")
        return original_repr(self)

    patches.set(variable_class, "_initialize", _initialize)
    patches.set(variable_class, "_direct_assign", _direct_assign)
    patches.set(KerasVariable, "__repr__", __repr__)


# --------------------------------------------------------------------------- numpy


def _install_numpy(patches: _Patches) -> None:
    from keras.src.backend.torch import core
    from torch.distributed.tensor import DTensor

    original = core.convert_to_numpy

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


# --------------------------------------------------------------------------- trainer and data


def _native_data_distribution() -> bool:
    from keras.src.backend.torch import trainer

    return any(hasattr(trainer.TorchTrainer, name) for name in ("_distribute_data", "_get_distributed_iterator"))


def _distribute_batch(data: Any, distribution: Any) -> Any:
    import torch
    from keras.src import tree
    from keras.src.backend.torch.core import convert_to_tensor
    from torch.distributed.tensor import DTensor

    is_global = bool(getattr(distribution, "auto_shard_dataset", True))
    layouts = _layout_cache(distribution)

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
        return _lib().distribute_data_input(leaf, layout, distribution.batch_dim_name, is_global=is_global)

    return tree.map_structure(one, data)


def _layout_cache(distribution: Any) -> dict:
    # get_data_layout builds a new TensorLayout (and its placements) per call: once per shape is enough.
    cache = getattr(distribution, "_keras_dtensor_mixfix_layouts", None)
    if cache is None:
        cache = {}
        distribution._keras_dtensor_mixfix_layouts = cache
    return cache


def _make_global(result: Any) -> Any:
    import torch
    from keras.src import tree
    from torch.distributed.tensor import DTensor

    def one(leaf: Any) -> Any:
        if isinstance(leaf, DTensor):
            return leaf.detach().full_tensor()
        return leaf.detach() if isinstance(leaf, torch.Tensor) else leaf

    return tree.map_structure(one, result)


def _install_trainer(patches: _Patches) -> None:
    import torch
    from keras.src.backend.torch import trainer as torch_trainer

    trainer_class = torch_trainer.TorchTrainer
    for kind in ("train", "test", "predict"):
        original_make = getattr(trainer_class, f"make_{kind}_function")
        patches.set(trainer_class, f"make_{kind}_function", _wrapped_make(original_make, f"{kind}_function"))

    original_train_step = trainer_class.train_step

    def train_step(self: Any, data: Any) -> Any:
        if _distribution() is None or not self.jit_compile:
            return original_train_step(self, data)
        return _compiled_train_step(self, data)

    patches.set(trainer_class, "train_step", train_step)
    _ = torch


def _wrapped_make(original_make: Callable[..., Any], attribute: str) -> Callable[..., Any]:
    def make(self: Any, force: bool = False) -> Any:
        existing = getattr(self, attribute)
        if existing is not None and not force:
            return existing
        distribution = _distribution()
        if distribution is None or not self.jit_compile:
            original_make(self, force=force)
        else:
            _make_with_static_aot_compile(original_make, self, force)
        inner = getattr(self, attribute)

        def step(data: Any) -> Any:
            active = _distribution()
            if active is None:
                return inner(data)
            return _make_global(inner(_distribute_batch(data, active)))

        setattr(self, attribute, step)
        return step

    return make


def _make_with_static_aot_compile(original_make: Callable[..., Any], trainer: Any, force: bool) -> None:
    # Under a distribution, Keras' torch.compile uses aot_eager with static shapes: inductor gave
    # wrong numbers for model-sharded DTensor steps on CPU (also without this package), and
    # dynamic shapes fail to retrace DTensor specs.
    import torch

    real_compile = torch.compile
    torch.compile = functools.partial(real_compile, backend="aot_eager", dynamic=False)  # type: ignore[assignment]
    try:
        original_make(trainer, force=force)
    finally:
        torch.compile = real_compile  # type: ignore[assignment]


def _compiled_train_step(trainer: Any, data: Any) -> Any:
    """The torch train step, with predictions detached before ``backward()``.

    Under torch.compile the step is split at ``backward()``; a DTensor prediction returned by the
    forward graph but unused by the loss's backward receives a plain zero tangent, which the
    compiled backward rejects ("Expected a DTensor tangent"). Metrics need no gradient, so the
    predictions they see are detached first.
    """
    import torch
    from keras.src import tree
    from keras.src.trainers.data_adapters import data_adapter_utils

    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    y_pred = trainer(x, training=True) if trainer._call_has_training_arg else trainer(x)
    trainer.zero_grad()
    loss = trainer._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
    first_input = next(leaf for leaf in tree.flatten(x) if leaf is not None)
    trainer._loss_tracker.update_state(loss, sample_weight=first_input.shape[0])
    y_pred = tree.map_structure(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, y_pred)
    if trainer.optimizer is not None:
        loss = trainer.optimizer.scale_loss(loss)
    weights = trainer.trainable_weights[:]
    if weights:
        loss.backward()
        gradients = [variable.value.grad for variable in weights]
        with torch.no_grad():
            trainer.optimizer.apply(gradients, weights)
    return trainer.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _install_data_adapter(patches: _Patches) -> None:
    from keras.src.trainers import data_adapters

    original = data_adapters.get_data_adapter

    @functools.wraps(original)
    def get_data_adapter(x: Any, *args: Any, **kwargs: Any) -> Any:
        distribution = _distribution()
        if (distribution is not None and getattr(distribution, "_is_multi_process", False)
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


# --------------------------------------------------------------------------- saving


def _install_saving(patches: _Patches) -> None:
    from keras.src.saving import saving_lib

    for name in ("save_model", "save_weights_only"):
        patches.set(saving_lib, name, _rank_zero_writes(getattr(saving_lib, name)))


def _rank_zero_writes(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def save(model: Any, filepath: Any, *args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        if _distribution() is None or not dist.is_initialized() or dist.get_world_size() == 1:
            return original(model, filepath, *args, **kwargs)
        if dist.get_rank() == 0:
            try:
                return original(model, filepath, *args, **kwargs)
            finally:
                dist.barrier()
        # Every rank gathers the same values (collectives); only rank 0's file is kept.
        scratch = tempfile.mkdtemp(prefix="mixfix-save-")
        try:
            return original(model, os.path.join(scratch, os.path.basename(str(filepath))), *args, **kwargs)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            dist.barrier()

    return save

"""The Keras boundary's modules: the one module that names ``keras.src``, Keras' private package.

Every other module of the integration reaches Keras' private modules through the functions and names
here, and the private attributes of Keras objects through :mod:`.keras_private`, so a Keras release that
moves something is met in one of the two (``tests/unit/keras_integration`` fails when another module of the
package names ``keras.src`` or a private attribute of a Keras object). Every import happens inside a function:
importing the package, and ``import torch`` (which auto-activates it), never imports Keras.
The imports are plain ``import`` statements wherever the name is the same in every release
checked, so a compiled Keras step (TorchDynamo) that reaches one traces it as before; only names
that moved go through :func:`importlib.import_module` (which TorchDynamo cannot trace), and never
inside a compiled step.

The Keras releases the integration supports, :data:`OLDEST_KERAS` to :data:`NEWEST_KERAS` (the gate,
:mod:`..gate.keras_gate`, reads them), were checked on :data:`CHECKED_RELEASES` (3.12.4, 3.13.2, 3.14.1, 3.15.1 and
keras-nightly 3.16.0.dev2026102704; CI runs the first and the last). Keras 3.12.4 to 3.14.1 differ
from 3.15.1 in two behaviours used here: their common ``Variable`` takes no ``layout`` argument
(:func:`variables_take_layouts`), and their torch ``repeat`` of an ``int`` runs ``repeat_interleave``
(:func:`repeat_expands_whole_numbers`). What differs between 3.15.1 and 3.16, per name:

==========================================  ==================================================================
name here                                   3.15.1 / 3.16
==========================================  ==================================================================
:func:`core` (:data:`CORE_MODULES`)         ``keras.src.backend.torch.core`` / moved to ``...torch.ops.core``;
                                            3.16's ``Variable`` adds ``_initialize_distributed`` and the
                                            module adds ``KerasDTensorPromotionMode`` and
                                            ``activate_dtensor_promotion``
:func:`backend_numpy`, :func:`backend_nn`   ``...torch.numpy``, ``...torch.nn`` / moved under ``...torch.ops``
:func:`trainer_module`,                     ``keras.src.backend.torch.trainer`` in both; the class is
:func:`trainer_class`                       ``TorchTrainer`` / ``Trainer``, and 3.16's module adds
                                            ``_distribute_data`` (its own data distribution)
:func:`backend_package`, :func:`lib`        ``keras.src.backend``: ``distribution_lib`` is None (no torch
                                            distribution; ours is installed) / Keras' own torch module
:data:`TORCH_DISTRIBUTION_LIB`              ``keras.src.backend.torch.distribution_lib``: absent (ours is
                                            registered under this name) / Keras' own module
:func:`torch_backend_package`               ``keras.src.backend.torch`` in both
:func:`distribution_module`                 ``keras.src.distribution.distribution_lib`` in both; its
                                            ``distribution_lib`` attribute is None / Keras' torch module
:func:`distribution`,                       same in both (``distribution_lib.distribution``,
:func:`data_parallel_class`                 ``distribution_lib.DataParallel``)
:func:`tensor_layout_class`                 ``keras.src.distribution.TensorLayout``, same in both
:func:`backend_name`                        ``keras.src.backend.config.backend``, same in both
:func:`tree`                                ``keras.src.tree``, same in both
:func:`layer_class`                         ``keras.src.layers.layer.Layer``, same in both
:func:`global_state`                        ``keras.src.backend.common.global_state``, same in both
:func:`base_variable_class`                 ``keras.src.backend.common.variables.Variable``, same in both
:func:`base_optimizer_class`                ``keras.src.optimizers.base_optimizer.BaseOptimizer``, same in both
:func:`running_keras_version`               ``keras.src.version.__version__``, same in both
:func:`traceback_utils`                     ``keras.src.utils.traceback_utils`` (``_EXCLUDED_PATHS``), same in both
:func:`repeat_expands_whole_numbers`        whether ``backend_numpy().repeat`` expands an ``int`` repeat: yes
                                            in both (before 3.15: ``repeat_interleave``)
:func:`data_adapters`,                      ``keras.src.trainers.data_adapters`` (``get_data_adapter``,
:func:`data_adapter_utils`                  ``is_tf_dataset``) and its ``data_adapter_utils``
                                            (``unpack_x_y_sample_weight``), same in both
:func:`saving_lib`                          ``keras.src.saving.saving_lib`` (``save_model``,
                                            ``save_weights_only``, ``load_model``, ``load_weights_only``, the
                                            weight stores ``H5IOStore``, ``ShardedH5IOStore`` and
                                            ``NpzIOStore`` (not in 3.16), ``safe_get_h5_dataset``,
                                            ``is_memory_sufficient``), same in both
:func:`rng_utils`                           ``keras.src.utils.rng_utils`` (``get_random_seed``,
                                            ``set_random_seed``), same in both
:func:`random_initializer_class`            ``keras.src.initializers.random_initializers.RandomInitializer``
                                            (its ``seed``: an int unless a ``SeedGenerator`` was given), same in
                                            both
:func:`stateless_scope_class`               ``keras.StatelessScope`` (public), same in both
:func:`is_serialized_initializer`           whether a ``get_config()`` value is a serialized initializer (its
                                            ``module``: ``keras.initializers`` or ``keras.src.initializers``)
:data:`INSTALL_TRIGGERS`                    the modules above whose loading means Keras is being imported
==========================================  ==================================================================
"""

from __future__ import annotations

import importlib
from typing import Any, List, Tuple

OLDEST_KERAS: Tuple[int, int] = (3, 12)
"""Oldest supported Keras (major, minor); CI runs the Keras tests on 3.12.4."""
NEWEST_KERAS: Tuple[int, int] = (3, 16)
"""Newest supported Keras minor release; CI runs the Keras tests on keras-nightly 3.16.0.dev2026102704."""
CHECKED_RELEASES = ("3.12.4", "3.13.2", "3.14.1", "3.15.1", "3.16.0.dev2026102704")
"""The Keras releases the integration's tests passed on (CI runs the first and the last)."""

CORE_MODULES = ("keras.src.backend.torch.ops.core", "keras.src.backend.torch.core")
"""The torch backend's core module, newest location first."""

NUMPY_MODULES = ("keras.src.backend.torch.ops.numpy", "keras.src.backend.torch.numpy")
"""The torch backend's numpy module, newest location first."""

NN_MODULES = ("keras.src.backend.torch.ops.nn", "keras.src.backend.torch.nn")
"""The torch backend's nn module, newest location first."""

TORCH_DISTRIBUTION_LIB = "keras.src.backend.torch.distribution_lib"
"""The torch ``distribution_lib``'s module name in Keras 3.16 (where ours is also registered on 3.15.1)."""

INSTALL_TRIGGERS: Tuple[Tuple[str, ...], ...] = (
    CORE_MODULES,
    ("keras.src.backend.torch.trainer",),
    ("keras.src.distribution.distribution_lib",),
    ("keras.src.trainers.data_adapters",),
    ("keras.src.saving.saving_lib",),
)
"""The Keras modules the integration patches, each with the names it has had in other releases; once
one name of each has loaded (during ``import keras``), auto-activation installs the integration."""


def running_keras_version() -> str:
    """The version of the Keras this process imports (``keras-nightly`` installs the same package)."""
    from keras.src.version import __version__

    return str(__version__)


def _first_module(names: Tuple[str, ...]) -> Any:
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"keras_dtensor_mixfix: this Keras has none of {names}")


def core() -> Any:
    return _first_module(CORE_MODULES)


def backend_numpy() -> Any:
    """The torch backend's numpy module (``ops.numpy`` from Keras 3.16)."""
    return _first_module(NUMPY_MODULES)


def backend_nn() -> Any:
    """The torch backend's nn module (``ops.nn`` from Keras 3.16)."""
    return _first_module(NN_MODULES)


def ops_nn() -> Any:
    """Keras' ``keras.src.ops.nn`` (the ops, above the backends: ``_rms_normalization`` lives there)."""
    from keras.src.ops import nn

    return nn


def trainer_module() -> Any:
    from keras.src.backend.torch import trainer

    return trainer


def trainer_class() -> Any:
    module = trainer_module()
    return getattr(module, "TorchTrainer", None) or module.Trainer


def backend_package() -> Any:
    """``keras.src.backend``, whose ``distribution_lib`` is the one Keras calls."""
    import keras.src.backend as backend_module

    return backend_module


def torch_backend_package() -> Any:
    import keras.src.backend.torch as torch_backend

    return torch_backend


def backend_name() -> str:
    """The backend the imported Keras runs on (``"torch"``, ``"jax"``, ...)."""
    from keras.src.backend.config import backend

    return backend()


def lib() -> Any:
    """The torch ``distribution_lib`` Keras calls (``keras.src.backend.distribution_lib``)."""
    return backend_package().distribution_lib


def native_distribution_lib() -> bool:
    """Keras ships its own torch ``distribution_lib`` (3.16 and later)."""
    return getattr(backend_package(), "distribution_lib", None) is not None


def distribution_module() -> Any:
    """``keras.src.distribution.distribution_lib`` (``DeviceMesh``, ``ModelParallel``, the distribution in force)."""
    from keras.src.distribution import distribution_lib

    return distribution_lib


def distribution() -> Any:
    """The distribution in force in this thread, or None."""
    return distribution_module().distribution()


def data_parallel_class() -> Any:
    from keras.src.distribution.distribution_lib import DataParallel

    return DataParallel


def tensor_layout_class() -> Any:
    from keras.src.distribution import TensorLayout

    return TensorLayout


def native_layout_variables() -> bool:
    return any(name in vars(core().Variable) for name in ("_initialize_layout", "_initialize_distributed"))


def variables_take_layouts() -> bool:
    """Keras' common ``Variable`` takes a ``layout`` argument and keeps it as ``_layout`` (3.15 and later).

    Before 3.15 only the JAX backend's ``Variable`` took it; the torch one dropped it with its other
    unknown keyword arguments, so an optimizer's slot variables lost their reference's layout.
    """
    import inspect

    return "layout" in inspect.signature(base_variable_class().__init__).parameters


def repeat_expands_whole_numbers() -> bool:
    """The torch backend's ``repeat`` repeats by an ``int`` along an axis with ``expand`` (3.15 and later).

    Read from its source: before 3.15 the same call runs ``torch.repeat_interleave`` with a tensor of repeats.
    """
    import inspect

    return ".expand(" in inspect.getsource(backend_numpy().repeat)


def native_data_distribution() -> bool:
    module = trainer_module()
    return hasattr(module, "_distribute_data") or any(
        hasattr(trainer_class(), name) for name in ("_distribute_data", "_get_distributed_iterator"))


def native_promotion_mode() -> bool:
    """Keras enters its own mixed-operand dispatch mode under a distribution (3.16 and later)."""
    module = core()
    return hasattr(module, "KerasDTensorPromotionMode") and hasattr(module, "activate_dtensor_promotion")


def tree() -> Any:
    """Keras' nested-structure utilities (``map_structure``, ``flatten``)."""
    from keras.src import tree as tree_module

    return tree_module


def layer_class() -> Any:
    from keras.src.layers.layer import Layer

    return Layer


def stateless_scope_class() -> Any:
    """``keras.StatelessScope`` (public): variables read the values it maps them to, and their updates and the losses
    added within it are collected instead of applied."""
    import keras

    return keras.StatelessScope


def uninitialized_variables() -> List[Any]:
    """The variables made in a ``StatelessScope(initialize_variables=False)`` that the next scope to close with
    ``initialize_variables=True`` initializes (Keras keeps them in a global list)."""
    return list(global_state().get_global_attribute("uninitialized_variables", None) or [])


def set_uninitialized_variables(variables: List[Any]) -> None:
    global_state().set_global_attribute("uninitialized_variables", list(variables))


def global_state() -> Any:
    from keras.src.backend.common import global_state as global_state_module

    return global_state_module


def base_variable_class() -> Any:
    """The backend-independent ``Variable`` every backend's ``Variable`` derives from."""
    from keras.src.backend.common.variables import Variable

    return Variable


def base_optimizer_class() -> Any:
    """The backend-independent ``BaseOptimizer`` (``add_variable_from_reference`` gives slots their layout)."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    return BaseOptimizer


def data_adapters() -> Any:
    from keras.src.trainers import data_adapters as data_adapters_module

    return data_adapters_module


def data_adapter_utils() -> Any:
    from keras.src.trainers.data_adapters import data_adapter_utils as data_adapter_utils_module

    return data_adapter_utils_module


def file_utils() -> Any:
    """``keras.src.utils.file_utils``: the file functions Keras' callbacks and saving go through."""
    from keras.src.utils import file_utils as file_utils_module

    return file_utils_module


def callbacks_package() -> Any:
    """``keras.src.callbacks``: Keras' callback classes."""
    from keras.src import callbacks as callbacks_package_module

    return callbacks_package_module


def saving_lib() -> Any:
    from keras.src.saving import saving_lib as saving_lib_module

    return saving_lib_module


def traceback_utils() -> Any:
    """``keras.src.utils.traceback_utils`` (its ``_EXCLUDED_PATHS``: the frames Keras' traceback filter hides)."""
    from keras.src.utils import traceback_utils as traceback_utils_module

    return traceback_utils_module


def rng_utils() -> Any:
    from keras.src.utils import rng_utils as rng_utils_module

    return rng_utils_module


def initializer_class() -> Any:
    """The base of Keras' initializers (``keras.src.initializers.initializer.Initializer``), same in both."""
    from keras.src.initializers.initializer import Initializer

    return Initializer


INITIALIZERS_PACKAGE = "keras.src.initializers."
"""Where Keras' own initializers are defined (a class defined elsewhere is a user's, which may draw as it likes)."""


def is_serialized_initializer(value: Any) -> bool:
    """Whether ``value`` (from a ``get_config()``) is a serialized Keras initializer (its ``module``: Keras'
    public ``keras.initializers`` or the package that defines them)."""
    module = str(value.get("module", "")) if isinstance(value, dict) else ""
    return module.startswith(("keras.initializers", INITIALIZERS_PACKAGE.rstrip(".")))


def random_initializer_class() -> Any:
    """The base of Keras' random initializers; ``seed`` is an int drawn at construction unless a SeedGenerator."""
    from keras.src.initializers.random_initializers import RandomInitializer

    return RandomInitializer


def random_initializers_module() -> Any:
    """The module defining Keras' random initializers (RandomNormal, VarianceScaling, ...)."""
    from keras.src.initializers import random_initializers

    return random_initializers


def random_package() -> Any:
    """The random module Keras' initializers call by attribute (``random.normal(...)``, ``random.uniform(...)``):
    the backend's own (``keras.src.backend.torch.random``), which the initializers' module imports as ``random``."""
    return random_initializers_module().random


def floatx() -> str:
    """Keras' default float dtype."""
    import keras

    return keras.config.floatx()

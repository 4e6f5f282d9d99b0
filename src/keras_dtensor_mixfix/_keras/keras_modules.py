"""The Keras boundary: the one module that names ``keras.src``, Keras' private package.

Every other module of the integration reaches Keras' internals through the functions and names
here, so a Keras release that moves something is met in one file (``tests/unit`` fails when
another module of the package names ``keras.src``). Every import happens inside a function:
importing the package, and ``import torch`` (which auto-activates it), never imports Keras.
The imports are plain ``import`` statements wherever the name is the same in every release
checked, so a compiled Keras step (TorchDynamo) that reaches one traces it as before; only names
that moved go through :func:`importlib.import_module` (which TorchDynamo cannot trace), and never
inside a compiled step.

Checked on Keras 3.15.1 and keras-nightly 3.16.0.dev2026102704. What differs between them, per name:

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
:func:`data_adapters`,                      ``keras.src.trainers.data_adapters`` (``get_data_adapter``,
:func:`data_adapter_utils`                  ``is_tf_dataset``) and its ``data_adapter_utils``
                                            (``unpack_x_y_sample_weight``), same in both
:func:`saving_lib`                          ``keras.src.saving.saving_lib`` (``save_model``,
                                            ``save_weights_only``), same in both
:func:`rng_utils`                           ``keras.src.utils.rng_utils`` (``get_random_seed``,
                                            ``set_random_seed``), same in both
:data:`INSTALL_TRIGGERS`                    the modules above whose loading means Keras is being imported
==========================================  ==================================================================
"""

from __future__ import annotations

import importlib
from typing import Any, Tuple

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


def global_state() -> Any:
    from keras.src.backend.common import global_state as global_state_module

    return global_state_module


def base_variable_class() -> Any:
    """The backend-independent ``Variable`` every backend's ``Variable`` derives from."""
    from keras.src.backend.common.variables import Variable

    return Variable


def data_adapters() -> Any:
    from keras.src.trainers import data_adapters as data_adapters_module

    return data_adapters_module


def data_adapter_utils() -> Any:
    from keras.src.trainers.data_adapters import data_adapter_utils as data_adapter_utils_module

    return data_adapter_utils_module


def saving_lib() -> Any:
    from keras.src.saving import saving_lib as saving_lib_module

    return saving_lib_module


def rng_utils() -> Any:
    from keras.src.utils import rng_utils as rng_utils_module

    return rng_utils_module

"""Where the installed Keras keeps what the integration patches, and what it already does itself.

Keras 3.15.1 has ``keras.src.backend.torch.core`` and ``trainer.TorchTrainer`` and no torch
``distribution_lib``; Keras 3.16 moved the core to ``keras.src.backend.torch.ops.core``, names the
trainer ``Trainer`` and ships its own torch distribution (layout-aware variables, data
distribution, global ``convert_to_numpy``, and ``KerasDTensorPromotionMode``).
"""

from __future__ import annotations

import importlib
from typing import Any, Tuple

CORE_MODULES = ("keras.src.backend.torch.ops.core", "keras.src.backend.torch.core")
"""The torch backend's core module, newest location first."""


def _first_module(names: Tuple[str, ...]) -> Any:
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"keras_dtensor_mixfix: this Keras has none of {names}")


def core() -> Any:
    return _first_module(CORE_MODULES)


def trainer_module() -> Any:
    from keras.src.backend.torch import trainer

    return trainer


def trainer_class() -> Any:
    module = trainer_module()
    return getattr(module, "TorchTrainer", None) or module.Trainer


def lib() -> Any:
    """The torch ``distribution_lib`` Keras calls (``keras.src.backend.distribution_lib``)."""
    import keras.src.backend as backend_module

    return backend_module.distribution_lib


def distribution() -> Any:
    """The distribution in force in this thread, or None."""
    from keras.src.distribution import distribution_lib

    return distribution_lib.distribution()


def native_distribution_lib() -> bool:
    """Keras ships its own torch ``distribution_lib`` (3.16 and later)."""
    import keras.src.backend as backend_module

    return getattr(backend_module, "distribution_lib", None) is not None


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


def backend_numpy() -> Any:
    """The torch backend's numpy module (``ops.numpy`` from Keras 3.16)."""
    return _first_module(("keras.src.backend.torch.ops.numpy", "keras.src.backend.torch.numpy"))


def backend_nn() -> Any:
    """The torch backend's nn module (``ops.nn`` from Keras 3.16)."""
    return _first_module(("keras.src.backend.torch.ops.nn", "keras.src.backend.torch.nn"))

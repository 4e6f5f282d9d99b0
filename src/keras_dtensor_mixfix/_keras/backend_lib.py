"""The torch ``distribution_lib`` Keras calls: ours where Keras has none, else Keras' own, completed.

Where ours is installed (Keras 3.15.1), it is also importable under the name Keras 3.16 gives its
own, ``keras.src.backend.torch.distribution_lib`` (``sys.modules`` entry and package attribute), so
code written against 3.16 (``from keras.src.backend.torch import distribution_lib``) runs.
"""

from __future__ import annotations

import sys
from typing import List

from .patches import Patches

TORCH_LIB_NAME = "keras.src.backend.torch.distribution_lib"

REQUIRED_LIB_NAMES = (
    "list_devices", "get_device_count", "initialize", "num_processes", "process_id", "distribute_tensor",
    "distribute_variable", "distribute_data_input", "_to_backend_mesh", "_to_backend_layout", "_to_backend_device",
)


def install(patches: Patches, added: List[str]) -> None:
    import keras.src.backend as backend_module
    import keras.src.backend.torch as torch_backend
    import keras.src.distribution.distribution_lib as distribution_module

    from .. import _keras_distribution_lib as ours

    native = getattr(backend_module, "distribution_lib", None)
    if native is None:
        patches.set(backend_module, "distribution_lib", ours)
        patches.set(distribution_module, "distribution_lib", ours)
        if sys.modules.get(TORCH_LIB_NAME) is None:
            patches.set(sys.modules, TORCH_LIB_NAME, ours)
            patches.set(torch_backend, "distribution_lib", ours)
        added.append(f"distribution_lib: torch backend installed (also as {TORCH_LIB_NAME})")
        return
    missing = [name for name in REQUIRED_LIB_NAMES if not hasattr(native, name)]
    for name in missing:
        patches.set(native, name, getattr(ours, name))
    if getattr(distribution_module, "distribution_lib", None) is None:
        patches.set(distribution_module, "distribution_lib", native)
    added.append(f"distribution_lib: Keras' own kept, added {missing or 'nothing'}")

"""The torch ``distribution_lib`` Keras calls: ours where Keras has none, else Keras' own, completed.

Ours is :mod:`.distribution_lib`. Where it is installed (Keras 3.12 to 3.15), it is also importable under
the name Keras 3.16 gives its own, :data:`.keras_modules.TORCH_DISTRIBUTION_LIB` (``sys.modules``
entry and attribute of the torch backend package), so code written against 3.16 (importing
``distribution_lib`` from the torch backend package) runs.
"""

from __future__ import annotations

import sys
from typing import List

from . import keras_modules
from .._lifecycle.recorder import PatchRecorder

REQUIRED_LIB_NAMES = (
    "list_devices", "get_device_count", "initialize", "num_processes", "process_id", "distribute_tensor",
    "distribute_variable", "distribute_data_input", "_to_backend_mesh", "_to_backend_layout", "_to_backend_device",
)


def install(patches: PatchRecorder, added: List[str]) -> None:
    from . import distribution_lib as ours

    backend_module = keras_modules.backend_package()
    torch_backend = keras_modules.torch_backend_package()
    distribution_module = keras_modules.distribution_module()

    native = getattr(backend_module, "distribution_lib", None)
    if native is None:
        patches.set(backend_module, "distribution_lib", ours, create=True)
        patches.set(distribution_module, "distribution_lib", ours, create=True)
        if sys.modules.get(keras_modules.TORCH_DISTRIBUTION_LIB) is None:
            patches.set(sys.modules, keras_modules.TORCH_DISTRIBUTION_LIB, ours, create=True)
            patches.set(torch_backend, "distribution_lib", ours, create=True)
        added.append(f"distribution_lib: torch backend installed (also as {keras_modules.TORCH_DISTRIBUTION_LIB})")
        return
    missing = [name for name in REQUIRED_LIB_NAMES if not hasattr(native, name)]
    for name in missing:
        patches.set(native, name, getattr(ours, name), create=True)
    if getattr(distribution_module, "distribution_lib", None) is None:
        patches.set(distribution_module, "distribution_lib", native, create=True)
    added.append(f"distribution_lib: Keras' own kept, added {missing or 'nothing'}")

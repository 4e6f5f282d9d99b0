"""The torch ``distribution_lib`` Keras calls: ours where Keras has none, else Keras' own, completed.

Ours is :mod:`.distribution_lib`. Where it is installed (Keras 3.12 to 3.15), it is also importable under
the name Keras 3.16 gives its own, :data:`.keras_modules.TORCH_DISTRIBUTION_LIB` (``sys.modules``
entry and attribute of the torch backend package), so code written against 3.16 (importing
``distribution_lib`` from the torch backend package) runs.
"""

from __future__ import annotations

import sys

from ..._lifecycle.recorder import PatchRecorder
from ..boundary import keras_modules
from ..boundary.overrides import Override

REQUIRED_LIB_NAMES = (
    "list_devices", "get_device_count", "initialize", "num_processes", "process_id", "distribute_tensor",
    "distribute_variable", "distribute_data_input", "_to_backend_mesh", "_to_backend_layout", "_to_backend_device",
)


def _install_ours(patches: PatchRecorder) -> None:
    from . import distribution_lib as ours

    # Keras 3.12 to 3.15 have no torch distribution_lib: each of these is added, and deleted again on uninstall.
    patches.set(keras_modules.backend_package(), "distribution_lib", ours, create=True)
    patches.set(keras_modules.distribution_module(), "distribution_lib", ours, create=True)
    if sys.modules.get(keras_modules.TORCH_DISTRIBUTION_LIB) is None:
        patches.set(sys.modules, keras_modules.TORCH_DISTRIBUTION_LIB, ours, create=True)
        patches.set(keras_modules.torch_backend_package(), "distribution_lib", ours, create=True)


def _complete_native(patches: PatchRecorder) -> str:
    from . import distribution_lib as ours

    native = keras_modules.backend_package().distribution_lib
    distribution_module = keras_modules.distribution_module()
    missing = [name for name in REQUIRED_LIB_NAMES if not hasattr(native, name)]
    for name in missing:
        patches.set(native, name, getattr(ours, name), create=True)
    if getattr(distribution_module, "distribution_lib", None) is None:
        patches.set(distribution_module, "distribution_lib", native, create=True)
    return f"distribution_lib: Keras' own kept, added {missing or 'nothing'}"


OURS = Override(
    name="distribution_lib", attributes=("distribution_lib", keras_modules.TORCH_DISTRIBUTION_LIB),
    description=f"distribution_lib: torch backend installed (also as {keras_modules.TORCH_DISTRIBUTION_LIB})",
    apply=_install_ours, needed=lambda: not keras_modules.native_distribution_lib())
"""Ours, where Keras has no torch ``distribution_lib`` (3.12 to 3.15)."""

COMPLETED = Override(
    name="distribution_lib completed", attributes=REQUIRED_LIB_NAMES + ("distribution_lib",),
    description="distribution_lib: Keras' own kept, completed", apply=_complete_native,
    needed=keras_modules.native_distribution_lib)
"""Keras' own (3.16), with whatever of ours it lacks."""

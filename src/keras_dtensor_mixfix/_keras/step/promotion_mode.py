"""Keras 3.16's own mixed-operand promotion, replaced by ours while patched.

Keras 3.16 enters ``KerasDTensorPromotionMode`` (a ``TorchDispatchMode``) in the thread that sets a
non-``DataParallel`` distribution. While a dispatch mode is on the stack every op, plain ones
included, goes through Python, TorchDynamo skips every frame (so Keras refuses ``jit_compile=True``),
and our rules never see a mixed op. While the integration is installed and the package is patched,
Keras' ``activate_dtensor_promotion`` leaves the mode off (and takes it off this thread's stack
where it is already on): the dispatch rules promote instead. Whenever the package is not patched,
or the integration is uninstalled, Keras' own mode is back wherever Keras would have it.

Keras keeps the mode only on the (per-thread) dispatch stack, so the state is brought in line
(:func:`sync`) in the thread that patches or unpatches, at install and uninstall, and before each
train/test/predict step in the thread that runs it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

from ..._lifecycle.recorder import PatchRecorder
from ..boundary import keras_modules, keras_private
from ..boundary.overrides import Override

log = logging.getLogger("keras_dtensor_mixfix")

_core: Optional[Any] = None
_keras_activate: Optional[Callable[[], None]] = None
_warned_stuck = False


def _replace_keras_mode(patches: PatchRecorder) -> None:
    """Replace Keras' ``activate_dtensor_promotion`` (its distribution_lib calls the core's by name)."""
    global _core, _keras_activate
    from ..._lifecycle.patching import add_state_listener, is_patched

    core = keras_modules.core()
    original = core.activate_dtensor_promotion

    @functools.wraps(original)
    def activate_dtensor_promotion() -> None:
        if is_patched():
            _take_off(core)
            return
        original()

    patches.set(core, "activate_dtensor_promotion", activate_dtensor_promotion)
    _core, _keras_activate = core, original
    add_state_listener(_on_patch_state)
    sync()


def uninstall() -> None:
    """After Keras' own function is back: Keras' mode where Keras would have it, in this thread."""
    global _core, _keras_activate
    from ..._lifecycle.patching import remove_state_listener

    core = _core
    remove_state_listener(_on_patch_state)
    _core = _keras_activate = None
    if core is not None and _keras_wants_mode() and keras_private.dtensor_promotion_mode(core) is None:
        core.activate_dtensor_promotion()


OVERRIDE = Override(
    name="promotion mode", attributes=("activate_dtensor_promotion",),
    description="promotion: ours replaces Keras' KerasDTensorPromotionMode while patched",
    apply=_replace_keras_mode, needed=keras_modules.native_promotion_mode, undo=uninstall)
"""Keras 3.16. Its ``undo`` runs after ``uninstall()`` has unpatched the package (if it patched it), so that
Keras' own mode comes back where Keras would have it."""

def _on_patch_state(patched: bool) -> None:
    try:
        sync()
    except Exception:  # a listener must not break patch()/unpatch()
        log.warning("keras_dtensor_mixfix: could not bring Keras' promotion mode in line", exc_info=True)


def _keras_wants_mode() -> bool:
    distribution = keras_modules.distribution()
    return distribution is not None and not isinstance(distribution, keras_modules.data_parallel_class())


def sync() -> None:
    """In this thread: Keras' mode off while patched, on (as Keras has it) while not."""
    core, keras_activate = _core, _keras_activate
    if core is None or keras_activate is None or not _keras_wants_mode():
        return
    from ..._lifecycle.patching import is_patched

    if is_patched():
        _take_off(core)
    elif keras_private.dtensor_promotion_mode(core) is None:
        keras_activate()


def replaced() -> bool:
    """True where Keras would run its promotion mode in this thread and ours stands in for it."""
    core = _core
    if core is None or not _keras_wants_mode():
        return False
    from ..._lifecycle.patching import is_patched

    return is_patched() and keras_private.dtensor_promotion_mode(core) is None


def _take_off(core: Any) -> None:
    if keras_private.dtensor_promotion_mode(core) is None:
        return
    global _warned_stuck
    core.deactivate_dtensor_promotion()  # Keras' own: pops the mode only from the top of the stack
    if keras_private.dtensor_promotion_mode(core) is not None and not _warned_stuck:
        _warned_stuck = True
        log.warning("keras_dtensor_mixfix: Keras' DTensor promotion mode is under another dispatch mode in this "
                    "thread and stays on (Keras promotes there; jit_compile stays off)")

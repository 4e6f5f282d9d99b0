"""Auto-activation, run by ``import torch`` through the ``torch.backends`` entry point.

It runs while torch is still importing, so it stays tiny, never raises, and does not import
``torch.distributed``: it patches when ``torch.distributed.tensor`` is first imported (at once if
it already is). ``KERAS_DTENSOR_MIXFIX=0`` turns it off; it is read again at that moment, so
setting it any time before DTensor is imported is enough.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from typing import Any, Optional, Sequence

from ._keras.boundary.keras_modules import INSTALL_TRIGGERS

log = logging.getLogger("keras_dtensor_mixfix")

TARGET = "torch.distributed.tensor"

# The Keras modules keras_integration patches, each with the other names it had in other Keras
# releases; once one of each has loaded (during `import keras`, which itself imports torch and so
# runs this hook midway), the integration is installed. (Importing the Keras boundary imports no Keras.)
KERAS_MODULES = INSTALL_TRIGGERS
WATCHED = (TARGET,) + tuple(name for names in KERAS_MODULES for name in names)

keras_state = "not installed"
"""What auto-activation did for Keras: for ``doctor``."""

state = "not activated"
"""What auto-activation did: for ``doctor``."""

_lock = threading.Lock()


def activate() -> None:
    """Entry point for the ``torch.backends`` group; must never raise."""
    global state
    try:
        from ._rules.env import auto_activation_enabled

        if not auto_activation_enabled():
            state = "disabled by KERAS_DTENSOR_MIXFIX"
            return
        reason = _unsupported_torch()
        if reason is not None:
            state = f"off: {reason}"
            _log_refusal_once(reason)
            return
        with _lock:
            if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
                sys.meta_path.insert(0, _PatchOnImport())
        if TARGET in sys.modules:
            _patch_now()
        else:
            state = f"waiting for the first import of {TARGET}"
        _maybe_install_keras()
    except BaseException as exc:  # noqa: BLE001 - never break `import torch`
        state = f"failed: {type(exc).__name__}: {exc}"
        try:
            log.warning("keras_dtensor_mixfix: auto-activation failed and is off: %s", state)
        except BaseException:  # noqa: BLE001
            pass


def _unsupported_torch() -> Optional[str]:
    """Why auto-activation stays off on this torch, decided at ``import torch``; None: go on.

    A newer torch with the opt-in on goes on: its self-check needs DTensor, so it runs when DTensor
    is first imported (``_refused``), not during ``import torch``.
    """
    from ._lifecycle.torch_gate import deferred_to_self_check
    from ._torch import versions

    if deferred_to_self_check():
        return None
    return versions.unsupported_reason(versions.running_torch_version())


def _refused() -> Optional[str]:
    """Why the package must not activate on this torch (the gate, with the self-check where it decides)."""
    from ._lifecycle.torch_gate import refusal

    return refusal()


_refusal_logged = False


def _log_refusal_once(reason: str) -> None:
    """The one warning line of an auto-activation that stays off (whichever path finds out first)."""
    global _refusal_logged
    with _lock:
        if _refusal_logged:
            return
        _refusal_logged = True
    log.warning("keras_dtensor_mixfix: auto-activation is off: %s", reason)


def _patch_now() -> None:
    global state
    try:
        from ._rules.env import auto_activation_enabled

        if not auto_activation_enabled():
            state = "disabled by KERAS_DTENSOR_MIXFIX"
            return
        from ._lifecycle.patching import defer_auto_activation, is_patched, patch, patch_in_progress

        if patch_in_progress():
            # The user's own patch() imported DTensor; it patches. Auto-activation's turn comes
            # if that patch was temporary (a patched() block ends): see defer_auto_activation().
            defer_auto_activation(_patch_now)
            state = f"{TARGET} was first imported by a patch() call, which patched"
            return
        if not is_patched():
            reason = _refused()
            if reason is not None:
                state = f"off: {reason}"
                _log_refusal_once(reason)
                return
            patch()
        state = f"patched when {TARGET} was imported"
    except BaseException as exc:  # noqa: BLE001 - a failure here must not break the user's import
        state = f"failed: {type(exc).__name__}: {exc}"
        log.warning("keras_dtensor_mixfix: auto-activation could not patch: %s", state)


def _maybe_install_keras() -> None:
    global keras_state
    if keras_state != "not installed" or not all(any(name in sys.modules for name in names)
                                                  for names in KERAS_MODULES):
        return
    keras_state = "installing"
    try:
        from ._rules.env import auto_activation_enabled

        if not auto_activation_enabled():
            keras_state = "disabled by KERAS_DTENSOR_MIXFIX"
            return
        reason = _refused()  # a newer torch whose self-check fails: no Keras integration either
        if reason is not None:
            keras_state = f"off: {reason}"
            _log_refusal_once(reason)
            return
        from .keras_integration import UnsupportedKerasError, install

        try:
            keras_state = "installed" if install() else "not needed (Keras backend is not torch)"
        except UnsupportedKerasError as refused:  # Keras is left as it is: one line says why and what to do
            keras_state = f"off: {refused.reason}"
            log.warning("keras_dtensor_mixfix: %s", refused.reason)
    except BaseException as exc:  # noqa: BLE001 - never break the user's `import keras`
        keras_state = f"failed: {type(exc).__name__}: {exc}"
        log.warning("keras_dtensor_mixfix: Keras integration could not be installed: %s", keras_state)


def _after_import(fullname: str) -> None:
    if fullname == TARGET:
        _patch_now()
    _maybe_install_keras()
    if TARGET in sys.modules and keras_state != "not installed":
        _remove_finder()


def _remove_finder() -> None:
    with _lock:
        sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _PatchOnImport)]


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of ``torch.distributed.tensor`` to patch after it runs."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        if fullname not in WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchAfterExec(spec.loader, fullname)
        return spec


class _PatchAfterExec(importlib.abc.Loader):
    def __init__(self, loader: Any, fullname: str) -> None:
        self._loader = loader
        self._fullname = fullname

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _after_import(self._fullname)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

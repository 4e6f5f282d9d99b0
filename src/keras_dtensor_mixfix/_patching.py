"""Patch lifecycle: ``patch``, ``unpatch``, ``is_patched``, ``patched``.

One lock guards the state; no user code runs while it is held. State is process-wide (the
dispatch rules are global), so every thread sees the same patch, whichever thread patched.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterator, Optional

from ._options import Options
from ._registry import registry

log = logging.getLogger("keras_dtensor_mixfix")

_lock = threading.RLock()
_interceptor: Optional[Any] = None
_options: Options = Options()
_tag_before: Optional[str] = None
_tag_ours: Optional[str] = None


def current_options() -> Options:
    """The options in force while patched (defaults, with environment overrides, when not)."""
    return _options if _interceptor is not None else _base_options()


def _base_options() -> Options:
    from ._env import options_from_env

    return options_from_env()[0]


def is_patched() -> bool:
    """True while mixed operands are being promoted."""
    return _interceptor is not None


def interceptor() -> Optional[Any]:
    return _interceptor


def patch(**options: Any) -> None:
    """Start promoting plain operands that meet DTensors.

    Options: ``default`` (rule for ops without a registration: ``"replicate"``,
    ``"local"``, ``"error"`` or a callable) and ``plain_grads`` (plain ``.grad`` for plain
    tensors, default True). Calling ``patch()`` while patched logs and applies only the
    options given; it never raises for that.
    """
    global _interceptor, _options
    with _lock:
        if _interceptor is not None:
            if options:
                _set_options(_options.updated(**options))
                log.info("keras_dtensor_mixfix already patched; options updated to %s", _options.as_dict())
            else:
                log.info("keras_dtensor_mixfix already patched; nothing to do")
            return
        new_options = _base_options().updated(**options)  # validate before touching torch
        from ._packs import load_packs

        load_packs()  # rule packs load lazily, once per process
        from ._intercept import DispatchRuleInterceptor
        from ._promotion import promote_call

        installed = DispatchRuleInterceptor(promote_call)
        try:
            installed.install()
        except BaseException:
            installed.remove()
            raise
        _options = new_options
        _interceptor = installed
        from ._stats import reset_stats

        reset_stats()  # stats() counts since this patch()
        registry.clear_cache()
        _tag_compile_caches()
        log.debug("keras_dtensor_mixfix patched (%d ops hooked)", installed.hooked_ops)


def unpatch() -> None:
    """Stop promoting and restore torch exactly; calling it when not patched only logs."""
    global _interceptor, _options
    with _lock:
        if _interceptor is None:
            log.info("keras_dtensor_mixfix is not patched; nothing to undo")
            return
        installed = _interceptor
        _interceptor = None
        installed.remove()
        _options = Options()
        _clear_caches()
        _untag_compile_caches()
        log.debug("keras_dtensor_mixfix unpatched")


def _clear_caches() -> None:
    import torch

    from ._promotion import clear_caches

    clear_caches()
    registry.clear_cache()
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()


def _set_options(options: Options) -> None:
    global _options
    _options = options
    if _interceptor is not None:
        _tag_compile_caches()


def _tag_compile_caches() -> None:
    # Graphs traced under other rules must not be served from torch.compile's caches.
    global _tag_before, _tag_ours
    from . import _compile_cache

    if _tag_ours is None or _compile_cache.current_tag() != _tag_ours:
        _tag_before = _compile_cache.current_tag()
    _tag_ours = _compile_cache.set_tag(_tag_before or "", _compile_cache.fingerprint(_options, registry.entries()))


def _untag_compile_caches() -> None:
    global _tag_before, _tag_ours
    from . import _compile_cache

    _compile_cache.restore_tag(_tag_ours, _tag_before)
    _tag_before = _tag_ours = None


@contextlib.contextmanager
def patched(**options: Any) -> Iterator[None]:
    """Patch for the duration of a ``with`` block; on exit restore exactly the state before it.

    Nested blocks stack: leaving an inner block restores the outer block's patch state and
    options, even when the block raised.
    """
    with _lock:
        was_patched = is_patched()
        previous = current_options()
        if was_patched:
            _set_options(previous.updated(**options))
        else:
            patch(**options)
    try:
        yield
    finally:
        with _lock:
            if was_patched:
                if not is_patched():
                    patch()
                _set_options(previous)
            elif is_patched():
                unpatch()


def _on_rules_changed(op: object) -> None:
    installed = _interceptor
    if installed is None:
        return
    with _lock:
        if op is not None:
            # A rule registered for an op created after patch() (a custom op) must still fire.
            installed.ensure_op(op)
        _tag_compile_caches()


registry.add_listener(_on_rules_changed)

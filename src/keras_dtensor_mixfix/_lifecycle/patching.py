"""Patch lifecycle: ``patch``, ``unpatch``, ``is_patched``, ``patched``.

The patch state itself (installed or not, the options in force) has one holder,
``_engine.context``, which the engine reads on every promotion; this module is its only writer.
State is process-wide (the dispatch rules are global), so every thread sees the same patch,
whichever thread patched.

One plain lock orders the state transitions (patch, unpatch, option and rule changes) across
threads, and it is held for the transition only: code that is not ours never runs under it. A
``patch()`` first prepares with the lock released (the torch gate, rule packs and their hooks, the
imports whose import hooks run auto-activation), then takes it to install and publish the new
state; state listeners and a deferred auto-activation run after it is released again.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Set, Tuple, Union

from .._engine import context
from .._rules.decisions import Rule
from .._rules.options import Options
from .._rules.registry import registry
from .values_out import values_out

log = logging.getLogger("keras_dtensor_mixfix")

_lock = threading.Lock()
"""Held while the patch state changes, never across a call-out (see the module docstring)."""
_lock_holder: Optional[int] = None
_preparing: Set[int] = set()
"""The threads whose ``patch()`` is under way. Importing DTensor inside one fires auto-activation's
import hook, which must leave the patching to that ``patch()`` (``patch_in_progress``); a pack hook
that calls ``patch()`` in the same thread returns at once, the outer call finishes."""


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Hold the lifecycle lock for one state transition."""
    global _lock_holder
    # A plain lock taken twice by one thread hangs; that would be a call-out left under the lock.
    assert _lock_holder != threading.get_ident(), "keras_dtensor_mixfix: the lifecycle lock was re-entered"
    with _lock:
        _lock_holder = threading.get_ident()
        try:
            yield
        finally:
            _lock_holder = None


class Unchanged(enum.Enum):
    """The type of :data:`UNCHANGED`, the default of every ``patch()``/``patched()`` option."""

    UNCHANGED = "unchanged"

    def __repr__(self) -> str:
        return "UNCHANGED"


UNCHANGED = Unchanged.UNCHANGED
"""An option left at this is not given: it keeps its value (the default, an environment
variable's, or the patch in force's)."""


def _compile_cache_guard() -> Any:
    # Imported when first needed: it imports DTensor, which is_patched() and current_options() must not.
    from .compile_cache import compile_cache_guard

    return compile_cache_guard


def _given(**options: Any) -> Dict[str, Any]:
    """The options a caller actually gave, by name."""
    return {name: value for name, value in options.items() if value is not UNCHANGED}


def current_options() -> Options:
    """The options in force while patched (defaults, with environment overrides, when not)."""
    state = context.state()
    return state.options if state.active else _base_options()


def _base_options() -> Options:
    from .._rules.env import options_from_env

    return options_from_env()[0]


_deferred_auto_activation: Optional[Callable[[], None]] = None


def defer_auto_activation(activate: Callable[[], None]) -> None:
    """Auto-activation found a ``patch()`` under way (it imported DTensor) and left it the work.

    If that patch is temporary (a ``patched()`` block), ``activate`` runs when the block ends:
    auto-activation (enabled) would have patched at that import, so that is the state to return
    to. An explicit ``unpatch()`` forgets it: the user decided.
    """
    global _deferred_auto_activation
    _deferred_auto_activation = activate


def _take_deferred() -> Optional[Callable[[], None]]:
    global _deferred_auto_activation
    deferred, _deferred_auto_activation = _deferred_auto_activation, None
    return deferred


_state_listeners: List[Callable[[bool], None]] = []


def add_state_listener(listener: Callable[[bool], None]) -> None:
    """Call ``listener(is_patched())`` after each ``patch()``/``unpatch()`` that changes the state.

    It runs in the thread that changed the state, once the change is complete. For the package's
    own surfaces (the Keras integration); a listener must not raise.
    """
    if listener not in _state_listeners:
        _state_listeners.append(listener)


def remove_state_listener(listener: Callable[[bool], None]) -> None:
    if listener in _state_listeners:
        _state_listeners.remove(listener)


def _notify(was_patched: bool) -> None:
    now = is_patched()
    if now != was_patched:
        for listener in list(_state_listeners):
            listener(now)


def patch_in_progress() -> bool:
    """True while a ``patch()`` call is preparing or installing the patch (in any thread)."""
    return bool(_preparing)


def is_patched() -> bool:
    """True while mixed operands are being promoted."""
    return context.is_active()


def interceptor() -> Optional[Any]:
    """The dispatch-rule interceptor of the patch in force (None when not patched)."""
    return context.state().installed


def patch(
    *,
    default: Union[Rule, Unchanged] = UNCHANGED,
    plain_grads: Union[bool, Unchanged] = UNCHANGED,
    check: Union[str, Unchanged] = UNCHANGED,
    direct: Union[bool, Unchanged] = UNCHANGED,
    allow_newer_torch: Optional[bool] = None,
) -> None:
    """Start promoting plain operands that meet DTensors.

    Options (keyword only; each also settable by an environment variable
    ``KERAS_DTENSOR_MIXFIX_<OPTION>``, see docs/rules.md "Auto-activation and configuration"; one not given keeps
    the environment's value, or the default):

    - ``default``: rule for ops without a registration: ``"replicate"`` (default), ``"local"``,
      ``"error"`` or a callable taking a :class:`MixedCall`.
    - ``plain_grads``: give plain tensors that require grad a plain ``.grad`` (default True).
    - ``check``: ``"off"`` (default), ``"warn"`` or ``"raise"``: verify across the mesh that each
      promoted operand is what its rule says (identical on every rank for ``"replicate"``).
    - ``direct``: reuse a checked plan to run repeated mixed calls on local tensors (default True).
    - ``allow_newer_torch`` (default: ``KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH``, else off): on a
      torch newer than the newest tested release, run the self-check of every torch internal the
      package relies on and patch if it passes (one warning line says so). It changes nothing on a
      supported torch, and an older one is never allowed.

    Calling ``patch()`` while patched logs and applies only the options given; it never raises
    for that. An unknown keyword raises ``TypeError``, a bad value ``TypeError`` or ``ValueError``
    (nothing is patched then). Raises ``UnsupportedTorchError`` on a torch outside the supported
    range (on a newer one allowed by ``allow_newer_torch``: when the self-check fails, naming the
    failing check).
    """
    given = _given(default=default, plain_grads=plain_grads, check=check, direct=direct)
    outcome = _to_patched(lambda options: options.updated(**given), allow_newer_torch)
    if outcome is None:
        return  # re-entered in this thread while its patch() prepares: the outer call finishes
    before, options_now = outcome
    if before.patched:
        if given:
            log.info("keras_dtensor_mixfix already patched; options updated to %s", options_now.as_dict())
        else:
            log.info("keras_dtensor_mixfix already patched; nothing to do")
    _notify(before.patched)


class _Before(NamedTuple):
    """The patch state a transition replaced: what a ``patched()`` block restores on exit."""

    patched: bool
    options: Options
    allow_newer_torch: Optional[bool]


def _to_patched(choose: Callable[[Options], Options],
                allow_newer_torch: Optional[bool]) -> Optional[Tuple[_Before, Options]]:
    """Patch, or change the options of the patch in force, to ``choose(the options replaced)``.

    ``choose`` gets the environment's options when this patches. Returns the state before and the
    options now in force; None when this thread's ``patch()`` is already under way. Raises what
    ``patch()`` raises, with nothing changed.
    """
    me = threading.get_ident()
    with _locked():
        if me in _preparing:
            return None
        if context.is_active():
            return _change_options(choose)
        _preparing.add(me)
    try:
        _prepare(choose, allow_newer_torch)
        with _locked():
            if context.is_active():  # another thread patched while this one prepared
                return _change_options(choose)
            base = _base_options()
            return _Before(False, base, None), _install(choose(base), allow_newer_torch)
    finally:
        with _locked():
            _preparing.discard(me)


def _change_options(choose: Callable[[Options], Options]) -> Tuple[_Before, Options]:
    """While patched, under the lock: only the options change (a bad one raises, changing nothing)."""
    state = context.state()
    options = choose(state.options)
    _set_options(options)
    return _Before(True, state.options, state.allow_newer_torch), options


def _prepare(choose: Callable[[Options], Options], allow_newer_torch: Optional[bool]) -> None:
    """What a ``patch()`` does before it installs, with the lock released: it runs code not ours."""
    from .._rules.errors import UnsupportedTorchError
    from .torch_gate import refusal

    reason = refusal(allow_newer_torch)  # on a newer torch: the self-check, which imports DTensor
    if reason is not None:
        raise UnsupportedTorchError(f"keras_dtensor_mixfix.patch(): {reason}")
    choose(_base_options())  # validate before touching torch
    from .._rules.packs import load_packs

    load_packs()  # rule packs load lazily, once per process; their hooks register rules
    registry.resolve_pending()  # rules for ops whose library was imported since they were registered
    # Imported here, not under the lock: importing DTensor fires auto-activation's import hook.
    import torch.distributed.tensor  # noqa: F401

    from .intercept import DispatchRuleInterceptor  # noqa: F401
    from .._engine.entry import promote_call  # noqa: F401
    from .._engine.stats import reset_stats  # noqa: F401

    _compile_cache_guard()


def _install(options: Options, allow_newer_torch: Optional[bool]) -> Options:
    """Install the patch and publish it as the state in force; under the lock. Returns ``options``."""
    from .intercept import DispatchRuleInterceptor
    from .._engine.entry import promote_call

    installed = DispatchRuleInterceptor(promote_call)
    try:
        installed.install()
    except BaseException:
        installed.remove()
        raise
    context.set_state(True, options, installed=installed, allow_newer_torch=allow_newer_torch)
    from .._engine.stats import reset_stats

    reset_stats()  # stats() counts since this patch()
    registry.clear_cache()
    _compile_cache_guard().install()
    values_out().install()
    log.debug("keras_dtensor_mixfix patched (%d ops hooked)", installed.hooked_ops)
    return options


def unpatch() -> None:
    """Stop promoting and restore torch exactly; calling it when not patched only logs."""
    was_patched, _ = _to_unpatched()  # an explicit unpatch() wins over a deferred auto-activation
    if not was_patched:
        log.info("keras_dtensor_mixfix is not patched; nothing to undo")
        return
    _notify(True)


def _to_unpatched() -> Tuple[bool, Optional[Callable[[], None]]]:
    """Unpatch under the lock; returns whether it was patched, and the auto-activation that was
    deferred to the patch it removed (forgotten here: the caller runs it, or not, once unlocked)."""
    with _locked():
        installed = context.state().installed
        if installed is None:
            return False, None
        deferred = _take_deferred()
        context.set_state(False, Options())
        installed.remove()
        _clear_caches()
        _remove_marks()
        _compile_cache_guard().uninstall()
        _compile_cache_guard().invalidate("unpatch()")
        values_out().uninstall()
        log.debug("keras_dtensor_mixfix unpatched")
    return True, deferred


def _clear_caches() -> None:
    from .._engine.caches import CACHES
    from .._torch.api import clear_sharding_cache

    CACHES.clear()
    registry.clear_cache()
    clear_sharding_cache()


def _remove_marks() -> None:
    """Take off what the engine planted on user tensors (the plain-grad hooks and their marks)."""
    from .._engine.grad import remove_plain_grad_hooks

    removed = remove_plain_grad_hooks()
    if removed:
        log.debug("unpatch(): plain-grad hooks removed from %d tensor(s)", removed)


def _set_options(options: Options) -> None:
    previous = context.update_options(options)
    if options != previous.options and previous.active:
        _state_changed("patch options changed")


def _state_changed(why: str) -> None:
    # Graphs compiled with a promotion hold the rules they were traced with.
    _compile_cache_guard().invalidate(why)


@contextlib.contextmanager
def patched(
    *,
    default: Union[Rule, Unchanged] = UNCHANGED,
    plain_grads: Union[bool, Unchanged] = UNCHANGED,
    check: Union[str, Unchanged] = UNCHANGED,
    direct: Union[bool, Unchanged] = UNCHANGED,
    allow_newer_torch: Optional[bool] = None,
) -> Iterator[None]:
    """Patch for the duration of a ``with`` block; on exit restore exactly the state before it.

    Takes ``patch()``'s keyword-only options (``default``, ``plain_grads``, ``check``, ``direct``);
    those not given are inherited from the patch in force (or the environment and defaults).
    Nested blocks stack: leaving an inner block restores the outer block's patch state and
    options, even when the block raised. ``allow_newer_torch`` is ``patch()``'s (used when the
    block is the one that patches).
    """
    given = _given(default=default, plain_grads=plain_grads, check=check, direct=direct)
    outcome = _to_patched(lambda options: options.updated(**given), allow_newer_torch)
    # None: a pack hook of this thread's patch() under way opened the block; it restores nothing.
    before = outcome[0] if outcome is not None else _Before(False, _base_options(), None)
    _notify(before.patched)
    try:
        yield
    finally:
        if before.patched:
            # Back to the outer state: patch again as the patch in force did if the body unpatched.
            restored = _to_patched(lambda _: before.options, before.allow_newer_torch)
            if restored is not None:
                _notify(restored[0].patched)
        else:
            was_patched, resume = _to_unpatched()
            if was_patched:
                _notify(True)
                if resume is not None:
                    resume()


def _on_rules_changed(op: object) -> None:
    with _locked():  # read under the lock: a racing unpatch() must not leave a rule installed
        installed = context.state().installed
        if installed is None:
            return
        if op is not None:
            # A rule registered for an op created after patch() (a custom op) must still fire.
            installed.ensure_op(op)
        else:
            installed.hold_pending()
        from .._engine.caches import CACHES

        CACHES.clear()  # what the engine remembered was worked out under the rules before
        _state_changed("rules changed")


registry.add_listener(_on_rules_changed)

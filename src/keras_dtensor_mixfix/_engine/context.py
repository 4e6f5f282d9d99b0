"""The one holder of patch state: written by the lifecycle layer, read on every promotion.

It lives here, below the lifecycle, so the engine reads it without importing the layer above.
The state is one immutable snapshot swapped whole, so a reader never sees half of a change; a lock
orders the writers and is held only for the swap (it never calls out).

Also here: the torch.compile compilations that traced a promotion, noted by the engine while it
promotes and read by the lifecycle's compile-cache guard (``_lifecycle.compile_cache``).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Optional, Set

from .._rules.options import Options


@dataclasses.dataclass(frozen=True)
class PatchState:
    """The patch in force, as one value."""

    active: bool = False
    """True while the patch is installed (mixed operands are promoted)."""
    options: Options = Options()
    """The options in force (only meaningful while active)."""
    installed: Any = None
    """What the lifecycle installed (its dispatch-rule interceptor); opaque to the engine."""
    allow_newer_torch: Optional[bool] = None
    """The ``allow_newer_torch`` of the ``patch()`` in force: a ``patched()`` block that ends by
    patching again (its body unpatched) patches as that one did."""


_state = PatchState()
_write_lock = threading.Lock()


def state() -> PatchState:
    """The whole patch state, one consistent snapshot."""
    return _state


def options() -> Options:
    """The options in force (only meaningful while patched)."""
    return _state.options


def is_active() -> bool:
    """True while the patch is installed."""
    return _state.active


def set_state(active: bool, options_in_force: Options, *, installed: Any = None,
              allow_newer_torch: Optional[bool] = None) -> None:
    """Replace the patch state; called by the lifecycle layer whenever the patch or its options change."""
    global _state
    new_state = PatchState(active, options_in_force, installed, allow_newer_torch)
    with _write_lock:
        _state = new_state


def update_options(options_in_force: Options) -> PatchState:
    """Change only the options in force; returns the state they replaced."""
    global _state
    with _write_lock:
        previous = _state
        _state = dataclasses.replace(previous, options=options_in_force)
    return previous


class TracedPromotions:
    """The torch.compile compilations that traced a promotion, since the patch last changed.

    A graph holding a promotion is only right under the rules it was traced with; the lifecycle
    keeps those graphs out of torch.compile's caches and resets dynamo when the rules change.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._compile_ids: Set[Any] = set()
        self._traced = False
        self._listener: Optional[Callable[[], None]] = None

    def listen(self, listener: Optional[Callable[[], None]]) -> None:
        """Have ``listener()`` called after each ``note()``, in the noting thread (None: no one); one listener."""
        self._listener = listener

    def note(self) -> None:
        """Called when a promotion happens while torch.compile traces."""
        from .._torch.api import current_compile_id

        compile_id = current_compile_id()
        with self._lock:
            self._traced = True
            if compile_id is not None:
                self._compile_ids.add(compile_id)
        listener = self._listener
        if listener is not None:
            listener()

    @property
    def traced(self) -> bool:
        """Whether any compilation traced a promotion since the last ``take()``."""
        return self._traced

    def promoted_in(self, compile_id: Any) -> bool:
        """Whether the compilation ``compile_id`` traced a promotion (False for None: not compiling)."""
        return compile_id is not None and compile_id in self._compile_ids

    def take(self) -> bool:
        """Forget every noted compilation; returns whether there was any."""
        with self._lock:
            traced = self._traced
            self._traced = False
            self._compile_ids.clear()
        return traced


traced_promotions = TracedPromotions()

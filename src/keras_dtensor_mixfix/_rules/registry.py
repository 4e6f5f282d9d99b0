"""Per-op rule registry: a newest-wins stack of registrations with removable handles."""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Callable, Dict, List, Optional

import torch

from .decisions import Rule, validate_rule
from .ops import OpLike, op_key, packet_name, resolve_op

log = logging.getLogger(__name__)

_MISSING = object()


class RuleHandle:
    """Returned by :func:`register_rule`; ``remove()`` undoes exactly that registration."""

    __slots__ = ("op", "rule", "source", "_seq", "_registry")

    def __init__(self, registry: "RuleRegistry", op: str, rule: Rule, source: str, seq: int) -> None:
        self.op = op
        self.rule = rule
        self.source = source
        self._seq = seq
        self._registry = registry

    @property
    def active(self) -> bool:
        """True while the registration is in the registry (it may be shadowed by a newer one)."""
        return self._registry._contains(self)

    def remove(self) -> None:
        """Remove this registration; the previous registration for the op becomes visible again.

        Removing twice is harmless.
        """
        self._registry._remove(self)

    def __enter__(self) -> "RuleHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"<RuleHandle {self.op} -> {self.rule!r} from {self.source} ({state})>"


class RuleRegistry:
    """Holds rule registrations.

    A registration targets one overload (``aten::mm.default``) or a whole packet
    (``aten::mm``). For an overload, the newest registration that targets it or its packet
    wins. Lookups are cached per overload object; every change clears the cache.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: List[RuleHandle] = []
        self._cache: Dict[object, object] = {}
        self._counter = itertools.count()
        self._listeners: List[Callable[[object], None]] = []
        self.version = 0
        """Bumped by every change (and by clear_cache): callers that keep a looked-up rule compare it."""

    def add_listener(self, listener: Callable[[object], None]) -> None:
        """Call ``listener(resolved_op)`` after each registration, ``listener(None)`` after a removal."""
        self._listeners.append(listener)

    def register(self, op: OpLike, rule: Rule, source: str = "user") -> RuleHandle:
        resolved = resolve_op(op)
        key = op_key(resolved)
        validate_rule(rule, f"register_rule({key!r})")
        with self._lock:
            handle = RuleHandle(self, key, rule, source, next(self._counter))
            self._entries.append(handle)
            self._cache.clear()
            self.version += 1
        log.debug("registered rule %r for %s (from %s)", rule, key, source)
        for listener in list(self._listeners):
            listener(resolved)
        return handle

    def _contains(self, handle: RuleHandle) -> bool:
        with self._lock:
            return any(entry is handle for entry in self._entries)

    def _remove(self, handle: RuleHandle) -> None:
        with self._lock:
            for index, entry in enumerate(self._entries):
                if entry is handle:
                    del self._entries[index]
                    self._cache.clear()
                    self.version += 1
                    log.debug("removed rule %r for %s", handle.rule, handle.op)
                    break
            else:
                return
        for listener in list(self._listeners):
            listener(None)

    def lookup(self, func: "torch._ops.OpOverload") -> Optional[Rule]:
        """The rule registered for ``func`` (overload or its packet), newest first; None if none."""
        found = self._cache.get(func, _MISSING)
        if found is not _MISSING:
            return found  # type: ignore[return-value]
        overload_key = op_key(func)
        packet_key = packet_name(func)
        with self._lock:
            found = None
            for entry in reversed(self._entries):
                if entry.op == overload_key or entry.op == packet_key:
                    found = entry.rule
                    break
            self._cache[func] = found
        return found  # type: ignore[return-value]

    def entries(self) -> List[RuleHandle]:
        """Snapshot of the registrations, oldest first."""
        with self._lock:
            return list(self._entries)

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self.version += 1


registry = RuleRegistry()
"""The process-wide registry behind :func:`register_rule`."""


def register_rule(op: OpLike, rule: Rule, *, source: str = "user") -> RuleHandle:
    """Register ``rule`` for ``op`` and return a handle whose ``remove()`` undoes it.

    ``op`` is an ``OpOverload`` (``torch.ops.aten.mm.default``), an ``OpOverloadPacket``
    (``torch.ops.aten.mm``: every overload) or a string (``"aten::mm.default"``,
    ``"aten.mm.default"``, ``"aten::mm"``). ``rule`` is ``"replicate"``, ``"local"``,
    ``"error"``, a :class:`Decision`, or a callable that receives a :class:`MixedCall` and
    answers per plain operand. The newest registration for an op wins; removing it exposes
    the one before. Registrations outlive ``unpatch()``; they take effect while patched.
    """
    return registry.register(op, rule, source=source)

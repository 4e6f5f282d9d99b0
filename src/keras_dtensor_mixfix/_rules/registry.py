"""Per-op rule registry: a newest-wins stack of registrations with removable handles.

A rule may name an operator that does not exist yet (a custom op whose library is imported after
the rule pack loaded): it is *pending* (see :func:`~keras_dtensor_mixfix._rules.ops.pending_key`
for when that is allowed) and applies once the op is defined. Entries are matched by name, so a
pending entry needs nothing special to be found by ``lookup``; "resolving" it only records that
the op now exists and tells the listeners (which hook the op).

A second rule for the same op is not an error: the newest wins and the earlier one is kept beneath
it (see :func:`register_rule`), as with torch.library's registration handles.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Callable, Dict, List, Optional, Tuple

from .._torch.operators import OpOverload, OpOverloadPacket
from .decisions import Rule, validate_rule
from .errors import UnknownOperatorError
from .ops import OpLike, op_key, packet_name, pending_key, resolve_op

log = logging.getLogger(__name__)

_MISSING = object()


class RuleHandle:
    """Returned by :func:`register_rule`; ``remove()`` undoes exactly that registration."""

    __slots__ = ("op", "rule", "source", "pending", "_seq", "_registry")

    def __init__(self, registry: "RuleRegistry", op: str, rule: Rule, source: str, seq: int,
                 pending: bool = False) -> None:
        self.op = op
        self.rule = rule
        self.source = source
        self.pending = pending
        """True while ``op`` names an operator that has not been defined yet (the rule applies once it is)."""
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
        state = ("pending: no such op yet" if self.pending else "active") if self.active else "removed"
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
        self._pending: List[RuleHandle] = []  # the entries whose op was not defined when last checked
        self._unannounced: List[RuleHandle] = []  # resolved by a lookup; the listeners are told later
        self._cache: Dict[object, object] = {}
        self._counter = itertools.count()
        self._listeners: List[Callable[[object], None]] = []
        self.version = 0
        """Bumped by every change (and by clear_cache): callers that keep a looked-up rule compare it."""

    def add_listener(self, listener: Callable[[object], None]) -> None:
        """Call ``listener(op)`` with the ``OpOverload``/``OpOverloadPacket`` after each registration for an
        existing op and when a pending rule's op turns out to exist (see :meth:`resolve_pending`);
        ``listener(None)`` after a removal and after a registration held for an op not defined yet."""
        self._listeners.append(listener)

    def register(self, op: OpLike, rule: Rule, source: str = "user") -> RuleHandle:
        self.resolve_pending()  # ops defined since the last check get hooked before this one
        resolved: Optional[object]
        try:
            resolved = resolve_op(op)
            key = op_key(resolved)
        except UnknownOperatorError:
            held = pending_key(op)
            if held is None:
                raise  # a typo, or a name in a namespace that is loaded: say so now
            resolved, key = None, held
        validate_rule(rule, f"register_rule({key!r})")
        with self._lock:
            handle = RuleHandle(self, key, rule, source, next(self._counter), pending=resolved is None)
            shadowed = [entry for entry in reversed(self._entries) if _overlaps(entry.op, key)]
            self._entries.append(handle)
            if handle.pending:
                self._pending.append(handle)
            self._cache.clear()
            self.version += 1
        if resolved is None:
            log.info("keras_dtensor_mixfix: rule %r for %s (from %s) is pending: no such operator is defined yet; it "
                     "applies once a library defines it", rule, key, source)
        else:
            log.debug("registered rule %r for %s (from %s)", rule, key, source)
        if shadowed:
            log.debug("rule %r for %s (from %s) is newer than, and wins over, %s; removing its handle restores them",
                      rule, key, source,
                      "; ".join(f"rule {entry.rule!r} for {entry.op} (from {entry.source})" for entry in shadowed))
        self._notify(resolved)
        return handle

    def resolve_pending(self) -> List[RuleHandle]:
        """Check the pending rules: those whose op is now defined stop being pending, and the listeners
        are told about each such op (so a patch in force hooks it). Returns the handles resolved.

        Costs nothing when no rule is pending; one operator lookup per pending rule otherwise.
        """
        if not self._pending and not self._unannounced:
            return []
        resolved: List[Tuple[RuleHandle, OpOverload | OpOverloadPacket]] = []
        with self._lock:
            for handle in self._unannounced:
                resolved.append((handle, resolve_op(handle.op)))
            self._unannounced.clear()
            for handle in list(self._pending):
                try:
                    op = resolve_op(handle.op)
                except UnknownOperatorError:
                    continue  # still not defined
                handle.pending = False
                self._pending.remove(handle)
                resolved.append((handle, op))
        for handle, op in resolved:
            log.debug("pending rule %r for %s (from %s): the op is now defined", handle.rule, handle.op, handle.source)
            self._notify(op)
        return [handle for handle, _ in resolved]

    def pending_qualnames(self) -> List[str]:
        """The pending ops as torch's dispatch-rule registry names them (``ns::name`` for the default
        overload, ``ns::name.overload`` otherwise), so a patch can hold their slot before they exist.

        For a pending packet (``ns::name``) that is its default overload; its other overloads can
        only be hooked once they exist (the listeners are told when the packet resolves).
        """
        with self._lock:
            keys = [handle.op for handle in self._pending]
        names = []
        for key in keys:
            name = key[: -len(".default")] if key.endswith(".default") else key
            if name not in names:
                names.append(name)
        return names

    def _notify(self, op: Optional[object]) -> None:
        for listener in list(self._listeners):
            listener(op)

    def _contains(self, handle: RuleHandle) -> bool:
        with self._lock:
            return any(entry is handle for entry in self._entries)

    def _remove(self, handle: RuleHandle) -> None:
        with self._lock:
            for index, entry in enumerate(self._entries):
                if entry is handle:
                    del self._entries[index]
                    if handle.pending:
                        self._pending.remove(handle)
                    if handle in self._unannounced:
                        self._unannounced.remove(handle)
                    self._cache.clear()
                    self.version += 1
                    log.debug("removed rule %r for %s", handle.rule, handle.op)
                    break
            else:
                return
        self._notify(None)

    def lookup(self, func: OpOverload) -> Optional[Rule]:
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
                    if entry.pending:
                        # Its op exists: it is being called. Only recorded here, on the promotion path:
                        # the listeners are not called from inside an op (nor while torch.compile traces)
                        # but by the next resolve_pending() (any registration, patch()).
                        entry.pending = False
                        self._pending.remove(entry)
                        self._unannounced.append(entry)
                    break
            self._cache[func] = found
        return found

    def entries(self) -> List[RuleHandle]:
        """Snapshot of the registrations, oldest first."""
        with self._lock:
            return list(self._entries)

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self.version += 1


def _overlaps(earlier: str, key: str) -> bool:
    """Whether a registration for ``key`` hides one for ``earlier`` from some overload: the same key, a
    packet over one of its overloads, or an overload over its packet (keys are ``ns::name[.overload]``)."""
    return earlier == key or earlier.split(".", 1)[0] == key or earlier == key.split(".", 1)[0]


registry = RuleRegistry()
"""The process-wide registry behind :func:`register_rule`."""


def register_rule(op: OpLike, rule: Rule, *, source: str = "user") -> RuleHandle:
    """Register ``rule`` for ``op`` and return a handle whose ``remove()`` undoes it.

    ``op`` is an ``OpOverload`` (``torch.ops.aten.mm.default``), an ``OpOverloadPacket``
    (``torch.ops.aten.mm``: every overload) or a string (``"aten::mm.default"``,
    ``"aten.mm.default"``, ``"aten::mm"``). A name that does not exist raises
    :class:`UnknownOperatorError` (a ``ValueError``), except in a namespace that has no operator
    yet (a custom-op library not imported yet, e.g. ``"flash_attn::fwd"``): that rule is held
    (``handle.pending``) and applies once the op is defined. Any other object raises
    :class:`ArgumentTypeError` (a ``TypeError``). ``rule`` is ``"replicate"``, ``"local"``,
    ``"error"``, a :class:`Decision`, or a callable that receives a :class:`MixedCall` and
    answers per plain operand. Registrations outlive ``unpatch()``; they take effect while patched.

    A second rule for the same op: **the newest registration wins**, and the earlier one stays
    beneath it. Registrations for an op form a stack: removing a handle removes exactly that
    registration (as a torch.library handle does), so removing the newest makes the one before it
    active again, whichever order handles are removed in. An overload registration and a packet
    registration for the same overload compete the same way, by age. Unlike torch.library, which
    refuses a duplicate unless asked to override, this is not an error and there is no
    ``override=`` switch: layering is the intended use (a test's or an application's rule over a
    pack's, a pack's over the built-in one) and every release so far has worked so. A debug message
    on the ``keras_dtensor_mixfix._rules.registry`` logger names each earlier rule the new one hides
    and its ``source``; ``logging.getLogger("keras_dtensor_mixfix").setLevel(logging.DEBUG)`` shows
    who overrode whom.
    """
    return registry.register(op, rule, source=source)

"""Where we intercept: per-op ``torch_dispatch`` rules for the ``DTensor`` class.

Since torch 2.10 (docs/architecture.md "How the patch intercepts"), base DTensor ops do not pass
through ``DTensor.__torch_dispatch__`` (a C++ fast path raises the mixed-operand error itself), but a
rule registered for ``(op, DTensor)`` in torch's dispatch-rule registry (the registry behind
``torch.library.register_torch_dispatch``) is consulted before that fast path, in eager, in
autograd backward and while ``torch.compile`` traces. The rule returns ``NotImplemented``
when it has nothing to do, so torch then runs exactly its own path.

Rules are installed on every operator whose schema takes two or more tensors (the only
ones that can mix); ops with a single tensor input never pay anything, but for the view ops a
release's DTensor cannot run in some layouts, refused by name on that release only
(``_engine/release_refusals.py``, as the upstream-defect table says).

The principle the rules follow: act only where torch itself would raise the mixed-operand error
(or crash, as it does on a plain one-element tensor an op writes into). Everything torch handles
itself runs torch's own path: calls without a plain multi-element operand, calls inside torch's
``implicit_replication()``, ops DTensor has its own Python handler for (unless that handler
raises the mixed-operand error), DTensor subclasses (the registry is keyed by exact class, so
they never reach our rule), and ops on which another library registered its own DTensor rule
(before us: we leave the op alone; after us: we step aside for it, see ``_YieldingRegister``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, List, Optional

from .._engine import context
from .._engine.entry import Handler, make_dispatch_rule, make_write_rule, on_other_meshes, torch_first
from .._engine.release_refusals import release_rules
from .._rules.ops import has_two_tensor_inputs, op_key
from .._torch.api import dispatch_rule_for, register_dispatch_rule, registration_handle, shadow_register
from .._torch.operators import OpOverload, all_op_names, op_schema
from .recorder import PatchRecorder

log = logging.getLogger(__name__)

MECHANISM = "torch_dispatch_rules"
MECHANISM_DESCRIPTION = (
    "per-op torch_dispatch rules for DTensor (torch._library.simple_registry, the registry of "
    "torch.library.register_torch_dispatch): consulted before DTensor's C++ dispatch fast path, in eager, "
    "autograd backward and torch.compile tracing"
)

# (the dispatcher's op names, the candidates among them): keyed by the names themselves, not their
# count, which repeats when one custom op is destroyed and another defined.
_op_names_cache: List[Any] = [None, []]


def candidate_qualnames() -> List[str]:
    """Qualified names (``aten::mul.Tensor``, ``aten::mm``) of every op taking two or more tensors."""
    names = frozenset(all_op_names())
    if _op_names_cache[0] == names:
        return _op_names_cache[1]
    found = []
    for qualname in names:
        name, _, overload = qualname.partition(".")
        try:
            schema = op_schema(name, overload)
        except RuntimeError:
            continue
        arguments = schema.arguments
        if has_two_tensor_inputs(schema, arguments):
            found.append(qualname)
            first = arguments[0] if arguments else None
            if (first is not None and not first.kwarg_only and first.alias_info is not None
                    and first.alias_info.is_write):
                _writing_ops.add(qualname)
    _op_names_cache[:] = [names, found]
    return found


_writing_ops: set = set()
"""Candidate in-place ops: they write into their first argument (``self``, or a ``self`` list)."""


class _YieldingRegister:
    """Stands in for ``register`` on the rule holder of every op we hook.

    torch's registry keeps one rule per (op, class) and refuses a second, so holding the DTensor
    slot of every op would stop any library from registering its own DTensor rule afterwards
    (the normal order: it needs the DTensor class first). A registration for DTensor on an op we
    hold takes the slot from us instead: theirs wins for that op; when their handle is destroyed
    and we are still patched, ours comes back. Registrations for other classes pass straight through.
    """

    __slots__ = ("qualname", "dtensor")

    def __init__(self, qualname: str, dtensor: type) -> None:
        self.qualname = qualname
        self.dtensor = dtensor

    def __call__(self, torch_dispatch_class: type, func: Callable[..., Any]) -> Any:
        qualname = self.qualname
        if torch_dispatch_class is not self.dtensor:
            return register_dispatch_rule(qualname, torch_dispatch_class, func)
        installed = context.state().installed  # the interceptor of the patch in force, if any
        if installed is not None:
            installed._step_aside(qualname)
        handle = register_dispatch_rule(qualname, torch_dispatch_class, func)

        def destroy() -> None:
            handle.destroy()
            current = context.state().installed
            if current is not None:
                current._install_one(qualname)

        log.debug("a DTensor dispatch rule was registered for %s by another library; it takes precedence", qualname)
        return registration_handle(destroy)


class DispatchRuleInterceptor:
    """Installs and removes our rule on every candidate op; removal only touches rules still ours."""

    name = MECHANISM
    description = MECHANISM_DESCRIPTION

    def __init__(self, handle_mixed: Handler) -> None:
        from torch.distributed.tensor import DTensor

        self._dtensor = DTensor
        handle_mixed = torch_first(handle_mixed)
        self._rule = make_dispatch_rule(handle_mixed, on_other_meshes)
        self._write_rule = make_write_rule(self._rule, handle_mixed)
        # single-tensor ops torch's release cannot run, refused by name there (_engine/release_refusals.py)
        self._release_rules = release_rules()
        self._ours = (self._rule, self._write_rule, *self._release_rules.values())
        self._handles: Dict[str, Any] = {}
        self._skipped: Dict[str, str] = {}
        self._yielding: Dict[str, _YieldingRegister] = {}
        self._lock = threading.RLock()
        self._register_swaps = PatchRecorder()

    @property
    def hooked_ops(self) -> int:
        return len(self._handles)

    @property
    def skipped(self) -> Dict[str, str]:
        """Ops where another rule for DTensor was already registered (left alone), with why."""
        return dict(self._skipped)

    def install(self) -> None:
        """Hook every candidate op; the lifecycle then publishes this interceptor as the one in force."""
        for qualname in (*candidate_qualnames(), *self._release_rules):
            self._install_one(qualname)
        self.hold_pending()
        log.debug("dispatch rules installed on %d ops (%d skipped)", len(self._handles), len(self._skipped))

    def _install_one(self, qualname: str) -> None:
        with self._lock:
            if qualname in self._handles:
                return
            existing = dispatch_rule_for(qualname, self._dtensor)
            if existing is not None:
                self._skipped[qualname] = f"another torch_dispatch rule for DTensor is registered: {existing!r}"
                return
            self._skipped.pop(qualname, None)
            rule = self._release_rules.get(qualname)
            if rule is None:
                rule = self._write_rule if qualname in _writing_ops else self._rule
            self._handles[qualname] = register_dispatch_rule(qualname, self._dtensor, rule)
            if qualname not in self._yielding:
                yielding = _YieldingRegister(qualname, self._dtensor)
                # Shadows torch's register for this op only; restoring the recorder puts torch's back.
                shadow_register(self._register_swaps, qualname, yielding,
                                label=f"the register method of {qualname}'s dispatch-rule holder")
                self._yielding[qualname] = yielding

    def hold_pending(self) -> None:
        """Hook the ops that rules are waiting for (their library is not imported yet).

        torch's rule registry is keyed by name, so the slot can be held before the op exists; the
        rule then fires from the op's first call.
        """
        from .._rules.registry import registry

        for qualname in registry.pending_qualnames():
            self._install_one(qualname)

    def _step_aside(self, qualname: str) -> None:
        """Give up ``qualname``'s DTensor slot (another library is registering its own rule)."""
        with self._lock:
            handle = self._handles.pop(qualname, None)
            if handle is None:
                return
            if dispatch_rule_for(qualname, self._dtensor) in self._ours:
                handle.destroy()
            self._skipped[qualname] = "another library registered its own DTensor dispatch rule after patch()"

    def ensure_op(self, op: Any) -> None:
        """Hook an op defined after install() (called when a rule is registered for it)."""
        overloads = [op] if isinstance(op, OpOverload) else [getattr(op, n) for n in op.overloads()]
        for overload in overloads:
            key = op_key(overload)
            qualname = key[: -len(".default")] if key.endswith(".default") else key
            self._install_one(qualname)

    def remove(self) -> List[str]:
        """Deregister our rules; returns the ops where someone replaced ours (left as they are)."""
        foreign: List[str] = []
        with self._lock:
            for qualname, handle in self._handles.items():
                current = dispatch_rule_for(qualname, self._dtensor)
                if any(current is rule for rule in self._ours):
                    handle.destroy()
                elif current is not None:
                    foreign.append(qualname)
            self._register_swaps.restore()  # the class's own method is visible again
            self._handles.clear()
            self._skipped.clear()
            self._yielding.clear()
        if foreign:
            log.warning(
                "unpatch(): %d op(s) now carry a DTensor dispatch rule that is not ours (e.g. %s); left in place",
                len(foreign), foreign[0],
            )
        return foreign

    def owns(self, qualname: str) -> Optional[bool]:
        """True if our rule is the live one for ``qualname``; None if we never hooked it."""
        if qualname not in self._handles:
            return None
        return dispatch_rule_for(qualname, self._dtensor) in self._ours

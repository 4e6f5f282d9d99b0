"""Where we intercept: per-op ``torch_dispatch`` rules for the ``DTensor`` class.

Measured on torch 2.13 (see README "How it works"): base DTensor ops no longer pass through
``DTensor.__torch_dispatch__`` (a C++ fast path raises the mixed-operand error itself), but a
rule registered for ``(op, DTensor)`` in torch's dispatch-rule registry (the registry behind
``torch.library.register_torch_dispatch``) is consulted before that fast path, in eager, in
autograd backward and while ``torch.compile`` traces. The rule returns ``NotImplemented``
when it has nothing to do, so torch then runs exactly its own path.

Rules are installed on every operator whose schema takes two or more tensors (the only
ones that can mix); ops with a single tensor input never pay anything.

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
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .._engine import context
from .._rules.ops import has_two_tensor_inputs, op_key
from .._torch.api import (all_op_qualnames, custom_op_handler, op_schema, dispatch_rule_holder, implicit_replication_enabled, is_mixed_operand_error,
                         registration_handle)
from .recorder import PatchRecorder

log = logging.getLogger(__name__)

MECHANISM = "torch_dispatch_rules"
MECHANISM_DESCRIPTION = (
    "per-op torch_dispatch rules for DTensor (torch._library.simple_registry, the registry of "
    "torch.library.register_torch_dispatch): consulted before DTensor's C++ dispatch fast path, in eager, "
    "autograd backward and torch.compile tracing"
)

Handler = Callable[[Any, Tuple[Any, ...], Dict[str, Any]], Any]

# (the dispatcher's op names, the candidates among them): keyed by the names themselves, not their
# count, which repeats when one custom op is destroyed and another defined.
_op_names_cache: List[Any] = [None, []]


def candidate_qualnames() -> List[str]:
    """Qualified names (``aten::mul.Tensor``, ``aten::mm``) of every op taking two or more tensors."""
    names = frozenset(all_op_qualnames())
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
            if first is not None and not first.kwarg_only and first.alias_info is not None and first.alias_info.is_write:
                _writing_ops.add(qualname)
    _op_names_cache[:] = [names, found]
    return found


_writing_ops: set = set()
"""Candidate in-place ops: they write into their first argument (``self``, or a ``self`` list)."""


def make_write_rule(base_rule: Callable[..., Any], handle_mixed: Handler) -> Callable[..., Any]:
    """The rule for in-place ops: also acts on a plain ONE-element ``self`` next to a DTensor.

    Torch promotes one-element plain operands it reads, but an in-place op whose ``self`` is plain
    crashes in DTensor's dispatch (a bare AssertionError, after writing a local result): that is
    the one write it cannot handle. Other written arguments (``out=``, a norm's running
    statistics) go down torch's own path, whatever it does with them.
    """
    from torch.distributed.tensor import DTensor

    Tensor = torch.Tensor

    def dtensor_dispatch_rule_writes(cls: Any, func: Any, types: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if len(args) == 2 and not kwargs:
            # The commonest pure call (dt.copy_(other), dt.add_(other)), unrolled: ~30 ns less.
            first, second = args
            if type(first) is DTensor and type(second) is DTensor:
                return NotImplemented
        result = base_rule(cls, func, types, args, kwargs)
        if result is not NotImplemented or not args:
            return result
        target = args[0]
        if type(target) is DTensor:
            return NotImplemented
        if isinstance(target, Tensor):
            if not isinstance(target, DTensor):
                return handle_mixed(func, args, kwargs)
        elif type(target) is list or type(target) is tuple:
            for item in target:
                # ``type(item) is DTensor`` first: foreach lists of parameters are long.
                if type(item) is not DTensor and isinstance(item, Tensor) and not isinstance(item, DTensor):
                    return handle_mixed(func, args, kwargs)
        return NotImplemented

    return dtensor_dispatch_rule_writes


def make_dispatch_rule(handle_mixed: Handler) -> Callable[..., Any]:
    """The function torch calls for every dispatch of a hooked op on a DTensor.

    It must be cheap: it runs on every pure-DTensor call of the op too. It only looks for a
    plain tensor with more than one element (what torch would reject) and otherwise returns
    ``NotImplemented`` so torch continues down its own path.
    """
    from torch.distributed.tensor import DTensor

    Tensor = torch.Tensor

    def _is_mixed_value(value: Any) -> bool:
        if isinstance(value, Tensor):
            return not isinstance(value, DTensor) and value.numel() != 1
        if type(value) is list or type(value) is tuple:
            for item in value:
                if isinstance(item, Tensor) and not isinstance(item, DTensor) and item.numel() != 1:
                    return True
        return False

    def dtensor_dispatch_rule(cls: Any, func: Any, types: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if len(args) == 2 and not kwargs:
            # The commonest pure call (a * b), unrolled: ~30 ns less than the loop below.
            first, second = args
            if type(first) is DTensor and type(second) is DTensor:
                return NotImplemented
        # _is_mixed_value inlined for positional arguments: no function call per argument.
        for value in args:
            kind = type(value)
            if kind is DTensor:
                continue
            if kind is list or kind is tuple:
                for item in value:
                    # ``type(item) is DTensor`` first: foreach lists of parameters are long.
                    if type(item) is not DTensor and isinstance(item, Tensor) and not isinstance(item, DTensor) \
                            and item.numel() != 1:
                        return handle_mixed(func, args, kwargs)
            elif isinstance(value, Tensor) and not isinstance(value, DTensor) and value.numel() != 1:
                return handle_mixed(func, args, kwargs)
        if kwargs:
            for value in kwargs.values():
                if type(value) is not DTensor and _is_mixed_value(value):
                    return handle_mixed(func, args, kwargs)
        return NotImplemented

    return dtensor_dispatch_rule


def torch_first(promote: Handler) -> Handler:
    """Wrap ``promote`` so that it runs only where torch's own path would raise.

    Called by the rules once they have seen a plain operand torch may reject; costs one flag
    read and one dict lookup on that path only.
    """

    def on_mixed(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if implicit_replication_enabled():
            return NotImplemented  # the user asked for torch's implicit replication: theirs
        handler = custom_op_handler(func)
        if handler is not None:
            # What torch would do next: DTensor's own handler. Only its mixed-operand refusal
            # (raised while unwrapping, before any work) is ours to act on.
            try:
                return handler(func, args, kwargs)
            except RuntimeError as exc:
                if not is_mixed_operand_error(exc):
                    raise
        return promote(func, args, kwargs)

    on_mixed.__wrapped__ = promote  # type: ignore[attr-defined]
    return on_mixed


class _YieldingRegister:
    """Stands in for ``register`` on the rule holder of every op we hook.

    torch's registry keeps one rule per (op, class) and refuses a second, so holding the DTensor
    slot of every op would stop any library from registering its own DTensor rule afterwards
    (the normal order: it needs the DTensor class first). A registration for DTensor on an op we
    hold takes the slot from us instead: theirs wins for that op; when their handle is destroyed
    and we are still patched, ours comes back. Registrations for other classes pass straight through.
    """

    __slots__ = ("holder", "qualname", "dtensor")

    def __init__(self, holder: Any, qualname: str, dtensor: type) -> None:
        self.holder = holder
        self.qualname = qualname
        self.dtensor = dtensor

    def __call__(self, torch_dispatch_class: type, func: Callable[..., Any]) -> Any:
        original = type(self.holder).register
        if torch_dispatch_class is not self.dtensor:
            return original(self.holder, torch_dispatch_class, func)
        installed = context.state().installed  # the interceptor of the patch in force, if any
        if installed is not None:
            installed._step_aside(self.qualname)
        handle = original(self.holder, torch_dispatch_class, func)
        qualname = self.qualname

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
        self._rule = make_dispatch_rule(handle_mixed)
        self._write_rule = make_write_rule(self._rule, handle_mixed)
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
        for qualname in candidate_qualnames():
            self._install_one(qualname)
        self.hold_pending()
        log.debug("dispatch rules installed on %d ops (%d skipped)", len(self._handles), len(self._skipped))

    def _install_one(self, qualname: str) -> None:
        with self._lock:
            if qualname in self._handles:
                return
            holder = dispatch_rule_holder(qualname)
            existing = holder.find(self._dtensor)
            if existing is not None:
                self._skipped[qualname] = f"another torch_dispatch rule for DTensor is registered: {existing!r}"
                return
            self._skipped.pop(qualname, None)
            rule = self._write_rule if qualname in _writing_ops else self._rule
            self._handles[qualname] = type(holder).register(holder, self._dtensor, rule)
            if qualname not in self._yielding:
                yielding = _YieldingRegister(holder, qualname, self._dtensor)
                # An instance attribute: shadows the method for this holder only; restoring deletes it.
                self._register_swaps.set(holder, "register", yielding,
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
            if dispatch_rule_holder(qualname).find(self._dtensor) in (self._rule, self._write_rule):
                handle.destroy()
            self._skipped[qualname] = "another library registered its own DTensor dispatch rule after patch()"

    def ensure_op(self, op: Any) -> None:
        """Hook an op defined after install() (called when a rule is registered for it)."""
        overloads = [op] if isinstance(op, torch._ops.OpOverload) else [getattr(op, n) for n in op.overloads()]
        for overload in overloads:
            key = op_key(overload)
            qualname = key[: -len(".default")] if key.endswith(".default") else key
            self._install_one(qualname)

    def remove(self) -> List[str]:
        """Deregister our rules; returns the ops where someone replaced ours (left as they are)."""
        foreign: List[str] = []
        with self._lock:
            for qualname, handle in self._handles.items():
                holder = dispatch_rule_holder(qualname)
                current = holder.find(self._dtensor)
                if current is self._rule or current is self._write_rule:
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
        return dispatch_rule_holder(qualname).find(self._dtensor) in (self._rule, self._write_rule)

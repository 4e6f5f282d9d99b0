"""The self-check's checks of torch's operator catalogue and per-op dispatch rules: op names, schemas,
overload objects, the dispatch-rule registry and its holders, and a rule running before DTensor's fast path.

Each check gets a ``Probe`` (see ``probe``) and returns what it saw, or raises when torch does not
behave as the package relies on; ``checks.CHECKS`` lists them in the order they run.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from .probe import PROBE_QUALNAME, Probe, api_module, require


def check_op_names(probe: Probe) -> str:
    from . import operators

    probe.probe_op()
    names = set(operators.all_op_names())
    require("aten::mul.Tensor" in names and "aten::mm" in names and PROBE_QUALNAME in names,
             "torch._C._dispatch_get_all_op_names misses aten::mul.Tensor, aten::mm or an op defined at run time")
    return f"torch._C._dispatch_get_all_op_names: {len(names)} overloads"


def check_op_schema(probe: Probe) -> str:
    import torch

    from . import operators
    from .operators import ListType, OptionalType, TensorType

    schema = operators.op_schema("aten::add_", "Tensor")
    first = schema.arguments[0]
    require(isinstance(first.type, torch._C.TensorType) and first.alias_info is not None and first.alias_info.is_write
             and not first.kwarg_only, "aten::add_.Tensor's self is not a written, positional Tensor")
    lists = operators.op_schema("aten::_foreach_add", "List").arguments[0]
    require(isinstance(lists.type, torch._C.ListType), "aten::_foreach_add.List's self is not a ListType")
    optional = operators.op_schema("aten::linear", "").arguments[2]
    require(isinstance(optional.type, torch._C.OptionalType), "aten::linear's bias is not an OptionalType")
    require(isinstance(first.type, TensorType) and isinstance(lists.type, ListType)
            and isinstance(lists.type.getElementType(), TensorType) and isinstance(optional.type, OptionalType)
            and isinstance(optional.type.getElementType(), TensorType),
            "operators.TensorType / ListType / OptionalType (getElementType) do not match torch's schema types")
    try:
        operators.op_schema("aten::no_such_op_for_mixfix", "")
    except RuntimeError:
        pass
    else:
        raise AssertionError("torch._C._get_schema did not raise RuntimeError for an unknown op")
    return "torch._C._get_schema: arguments' type, alias_info.is_write, kwarg_only; RuntimeError when unknown"


def check_op_overload(probe: Probe) -> str:
    import torch

    from . import operators

    mul = torch.ops.aten.mul.Tensor
    require(type(mul) is torch._ops.OpOverload and isinstance(torch.ops.aten.mul, torch._ops.OpOverloadPacket),
             "torch._ops.OpOverload / OpOverloadPacket")
    require(operators.OpOverload is torch._ops.OpOverload and operators.OpOverloadPacket is torch._ops.OpOverloadPacket,
            "operators.OpOverload / OpOverloadPacket")
    require(mul._schema.name == "aten::mul" and mul._overloadname == "Tensor", "OpOverload._schema / _overloadname")
    require(operators.schema_of(mul) is mul._schema and operators.overload_name(mul) == "Tensor"
            and operators.packet_qualname(torch.ops.aten.mul) == "aten::mul",
            "operators.schema_of / overload_name / packet_qualname (OpOverloadPacket._qualified_op_name)")
    a, b = torch.full((2,), 3.0), torch.full((2,), 2.0)
    require(torch.equal(mul._op(a, b), a * b), "OpOverload._op is not the op")
    require(torch.equal(operators.op_callable(mul)(a, b), a * b), "operators.op_callable is not the op")
    require(torch.ops.aten.view.default._schema._is_view_op() and not mul._schema._is_view_op(),
             "FunctionSchema._is_view_op")
    require(operators.is_view_schema(operators.schema_of(torch.ops.aten.view.default))
            and not operators.is_view_schema(operators.schema_of(mul)), "operators.is_view_schema")
    return ("OpOverload._op, ._schema, ._overloadname; OpOverloadPacket._qualified_op_name; "
            "FunctionSchema._is_view_op")


def check_dispatch_rule_registry(probe: Probe) -> str:
    from torch.distributed.tensor import DTensor

    api = api_module()
    probe.probe_op()
    require(api.dispatch_rule_for(PROBE_QUALNAME, DTensor) is None,
            "a DTensor rule is already registered on the probe op")
    require(api._rule_holder(PROBE_QUALNAME) is api._rule_holder(PROBE_QUALNAME),
            "simple_registry.singleton.find(op) returns a new holder each time")

    def rule(cls: Any, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        return NotImplemented

    handle = api.register_dispatch_rule(PROBE_QUALNAME, DTensor, rule)
    try:
        require(api.dispatch_rule_for(PROBE_QUALNAME, DTensor) is rule,
                "holder.find does not return the registered rule")
        try:
            api.register_dispatch_rule(PROBE_QUALNAME, DTensor, rule)
        except RuntimeError:
            pass
        else:
            raise AssertionError("a second rule for (op, DTensor) was accepted: the registry no longer keeps one")
    finally:
        handle.destroy()
    require(api.dispatch_rule_for(PROBE_QUALNAME, DTensor) is None, "handle.destroy() left the rule registered")
    return "simple_registry.singleton.find(op).torch_dispatch_rules: register (one per class), find, destroy"


def check_rule_runs_before_fast_path(probe: Probe) -> str:
    import torch
    from torch.distributed.tensor import DTensor

    api = api_module()
    op = probe.probe_op()
    calls: List[Tuple[Any, Any]] = []

    def rule(cls: Any, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        calls.append((cls, func))
        if not answer:
            return NotImplemented
        first, second = args
        local = func(first._local_tensor, second)  # plain tensors: torch's own kernel
        return DTensor.from_local(local, first.device_mesh, first.placements, run_check=False)

    handle = api.register_dispatch_rule(PROBE_QUALNAME, DTensor, rule)
    try:
        answer = False
        try:
            op(probe.dtensor, probe.plain)
        except RuntimeError as exc:
            require(api.is_mixed_operand_error(exc), f"after NotImplemented torch raised {exc}")
        else:
            raise AssertionError("the mixed call succeeded although the rule returned NotImplemented")
        require(calls == [(DTensor, op)], f"the rule was not consulted for a mixed eager call ({calls})")
        answer = True
        weight = probe.dtensor.detach().clone().requires_grad_()
        out = op(weight, probe.plain)
        require(type(out) is DTensor and torch.equal(out.full_tensor(), probe.dtensor.full_tensor() + probe.plain),
                 "the rule's answer is not the call's result")
        out.sum().backward()  # the probe's backward calls it again with a DTensor gradient and a plain tensor
        require(len(calls) == 3, f"the rule was not consulted for the mixed call inside backward ({len(calls) - 2})")
        require(type(weight.grad) is DTensor and torch.equal(weight.grad.full_tensor(), torch.ones(4, 4)),
                 "backward's result through the rule is wrong")
    finally:
        handle.destroy()
    return "a (op, DTensor) rule sees mixed calls before DTensor's C++ fast path, in eager and in backward"


class _Swaps:
    """The part of the package's patch recorder ``shadow_register`` uses (``_torch`` cannot import it)."""

    def __init__(self) -> None:
        self.set_on: List[Tuple[Any, str]] = []

    def set(self, owner: Any, name: str, value: Any, *, label: Optional[str] = None) -> None:
        require(name not in vars(owner), f"the holder holds its own {name!r} already")
        setattr(owner, name, value)
        self.set_on.append((owner, name))

    def restore(self) -> None:
        for owner, name in reversed(self.set_on):
            delattr(owner, name)
        self.set_on.clear()


def check_register_goes_through_holder(probe: Probe) -> str:
    import torch

    api = api_module()
    probe.probe_op()
    seen: List[type] = []

    class Marker(torch.Tensor):
        pass

    class Bypassing(torch.Tensor):
        pass

    def stand_in(cls: type, func: Callable[..., Any]) -> Any:
        seen.append(cls)
        return api.register_dispatch_rule(PROBE_QUALNAME, cls, func)

    swaps = _Swaps()
    api.shadow_register(swaps, PROBE_QUALNAME, stand_in, label="the probe op's register")  # as the interceptor does
    handle = None
    try:
        torch.library.register_torch_dispatch(PROBE_QUALNAME, Marker, lambda *a: NotImplemented, lib=probe.library)
        handle = api.register_dispatch_rule(PROBE_QUALNAME, Bypassing, lambda *a: NotImplemented)
        require(api.dispatch_rule_for(PROBE_QUALNAME, Bypassing) is not None, "register_dispatch_rule did not register")
    finally:
        swaps.restore()
        if handle is not None:
            handle.destroy()
    require(seen == [Marker], f"torch.library.register_torch_dispatch did not call the holder's own `register` "
            f"once, or register_dispatch_rule went through the stand-in ({seen})")
    require(api.dispatch_rule_for(PROBE_QUALNAME, Marker) is not None, "the registration did not reach the holder")
    return ("torch.library.register_torch_dispatch calls holder.register (an instance attribute can stand in); "
            "the class's own register goes past it")


def check_registration_handle(probe: Probe) -> str:
    api = api_module()
    destroyed = []
    api.registration_handle(lambda: destroyed.append(True)).destroy()
    require(destroyed == [True], "RegistrationHandle.destroy() did not call on_destroy")
    return "torch._library.utils.RegistrationHandle(on_destroy).destroy()"

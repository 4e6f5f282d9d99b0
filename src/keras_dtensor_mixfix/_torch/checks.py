"""The self-check's checks: one per torch internal (private name or behaviour) that ``api`` relies on
(and ``operators`` and ``dtensor_attributes``, which read some of the same internals).

Each check gets a ``Probe`` (see ``probe``) and returns what it saw, or raises when torch does not
behave as ``api`` relies on. ``CHECKS`` lists them in ``api``'s order; ``selfcheck`` runs them.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

from .probe import PROBE_QUALNAME, Check, Probe, require


# --------------------------------------------------------------------------- the checks, in api's order


def _api() -> Any:
    from . import api

    return api


def check_api_imports(probe: Probe) -> str:
    api = _api()
    return f"{len(api.__all__)} names importable"


def check_dtensor_spec(probe: Probe) -> str:
    import torch
    from torch.distributed.tensor import Shard

    api = _api()
    spec = api.DTensorSpec(probe.mesh, (Shard(0),), tensor_meta=api.TensorMeta(torch.Size((4, 4)), (4, 1), torch.float32))
    theirs = probe.dtensor._spec
    require(spec == theirs and hash(spec) == hash(theirs),
             f"a DTensorSpec built like promotion builds one ({spec!r}) differs from DTensor's own ({theirs!r})")
    require(tuple(spec.shape) == (4, 4) and spec.tensor_meta.dtype is torch.float32, "spec.shape/tensor_meta")
    return "DTensorSpec(mesh, placements, tensor_meta=TensorMeta(shape, stride, dtype)) equals DTensor's own spec"


def check_dtensor_attributes(probe: Probe) -> str:
    import torch

    from . import dtensor_attributes

    api = _api()
    dtensor = probe.dtensor
    local, spec = dtensor._local_tensor, dtensor._spec
    require(dtensor_attributes.local_tensor(dtensor) is local and dtensor_attributes.dtensor_spec(dtensor) is spec,
             "dtensor_attributes.local_tensor / dtensor_spec do not read DTensor._local_tensor / _spec")
    require(type(local) is torch.Tensor, f"DTensor._local_tensor is a {type(local).__name__}, not a plain tensor")
    require(isinstance(spec, api.DTensorSpec), f"DTensor._spec is a {type(spec).__name__}, not a DTensorSpec")
    require(spec.mesh is dtensor.device_mesh and tuple(spec.placements) == tuple(dtensor.placements),
             "DTensor._spec does not hold the DTensor's mesh and placements")
    require(torch.equal(local, dtensor.to_local()), "DTensor._local_tensor differs from to_local()")
    return "DTensor._local_tensor (plain) and DTensor._spec (mesh, placements) as read by promotion"


def check_fast_constructor(probe: Probe) -> str:
    from torch.distributed.tensor import DTensor

    api = _api()
    local, spec = probe.dtensor._local_tensor.clone(), probe.dtensor._spec
    constructor = api.dtensor_fast_constructor()
    if constructor is None:
        built = DTensor(local, spec, requires_grad=False)  # what construct.py does without it
        how = "absent: DTensor(local, spec, requires_grad=False) is used"
    else:
        built = constructor(DTensor, local, spec, requires_grad=False)
        how = "torch.Tensor._dtensor__new__ is DTensor.__new__"
    require(type(built) is DTensor and built._local_tensor is local and built._spec is spec,
             "the constructor did not wrap the given local tensor and spec as they are")
    require(tuple(built.shape) == tuple(spec.shape) and not built.requires_grad, "shape or requires_grad")
    return how


def check_local_shape_and_offset(probe: Probe) -> str:
    from torch.distributed.tensor import Replicate, Shard

    api = _api()
    for placements in ((Shard(0),), (Shard(1),), (Replicate(),)):
        shape, offset = api.compute_local_shape_and_global_offset((4, 6), probe.mesh, placements)
        require(tuple(shape) == (4, 6) and tuple(offset) == (0, 0),
                 f"{placements}: local shape {tuple(shape)}, offset {tuple(offset)} on a world of one")
    return "compute_local_shape_and_global_offset(shape, mesh, placements) -> (local shape, global offset)"


def check_redistribute_local_tensor(probe: Probe) -> str:
    import torch
    from torch.distributed.tensor import Replicate, Shard

    api = _api()
    whole = torch.arange(12.0).reshape(4, 3)
    meta = api.TensorMeta(whole.shape, whole.stride(), whole.dtype)
    replicated = api.DTensorSpec(probe.mesh, (Replicate(),), tensor_meta=meta)
    sharded = api.DTensorSpec(probe.mesh, (Shard(0),), tensor_meta=meta)
    local = api.redistribute_local_tensor(whole, replicated, sharded)
    require(isinstance(local, torch.Tensor) and torch.equal(local, whole), f"Replicate -> Shard(0) gave {local!r}")
    return "redistribute_local_tensor(local, current spec, target spec): Replicate -> Shard locally"


def check_masked_partial(probe: Probe) -> str:
    from torch.distributed.tensor.placement_types import Partial, _MaskPartial

    require(issubclass(_MaskPartial, Partial), "_MaskPartial is no Partial")
    require(_api().is_masked_partial(_MaskPartial()), "is_masked_partial(_MaskPartial()) is False")
    return "placement_types._MaskPartial, a Partial"


def check_special_ops(probe: Probe) -> str:
    import torch
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    random_ops, handlers = dispatcher._random_ops, dispatcher._custom_op_handlers
    require(torch.ops.aten.normal_.default in random_ops, "aten.normal_ is not among OpDispatcher._random_ops")
    require(isinstance(handlers, dict) and handlers, "OpDispatcher._custom_op_handlers is not a non-empty dict")
    require(all(isinstance(op, torch._ops.OpOverload) and callable(handler) for op, handler in handlers.items()),
             "OpDispatcher._custom_op_handlers does not map op overloads to callables")
    api = _api()
    some_op, handler = next(iter(handlers.items()))
    require(api.custom_op_handler(some_op) is handler and api.dtensor_handles_specially(some_op),
             "custom_op_handler / dtensor_handles_specially do not find a registered handler")
    require(api.dtensor_handles_specially(torch.ops.aten.normal_.default)
             and not api.dtensor_handles_specially(torch.ops.aten.mul.Tensor), "dtensor_handles_specially")
    return f"OpDispatcher._random_ops ({len(random_ops)}) and ._custom_op_handlers ({len(handlers)})"


def check_sharding_propagation(probe: Probe) -> str:
    import torch
    from torch.distributed.tensor import Shard

    api = _api()
    dtensor = probe.dtensor
    sharding = api.propagate_sharding(torch.ops.aten.mul.Tensor, (dtensor, dtensor), {})
    require(sharding is not None, "propagate_sharding says this rank is not part of the mesh")
    spec = sharding.output_spec
    require(isinstance(spec, api.DTensorSpec) and tuple(spec.placements) == (Shard(0),)
             and spec.tensor_meta is not None, f"output_spec {spec!r}")
    require(sharding.needs_redistribute is False, f"needs_redistribute {sharding.needs_redistribute!r}")
    return ("OpDispatcher.unwrap_to_op_info, DeviceMesh._is_current_rank_part_of_mesh, "
            "sharding_propagator.propagate -> output_sharding (output_spec, needs_redistribute)")


def check_op_names(probe: Probe) -> str:
    from . import operators

    api = _api()
    probe.probe_op()
    names = set(api.all_op_qualnames())
    require("aten::mul.Tensor" in names and "aten::mm" in names and PROBE_QUALNAME in names,
             "torch._C._dispatch_get_all_op_names misses aten::mul.Tensor, aten::mm or an op defined at run time")
    require(set(operators.all_op_names()) == names, "operators.all_op_names() differs from api.all_op_qualnames()")
    return f"torch._C._dispatch_get_all_op_names: {len(names)} overloads"


def check_op_schema(probe: Probe) -> str:
    import torch

    from .operators import ListType, OptionalType, TensorType

    api = _api()
    schema = api.op_schema("aten::add_", "Tensor")
    first = schema.arguments[0]
    require(isinstance(first.type, torch._C.TensorType) and first.alias_info is not None and first.alias_info.is_write
             and not first.kwarg_only, "aten::add_.Tensor's self is not a written, positional Tensor")
    lists = api.op_schema("aten::_foreach_add", "List").arguments[0]
    require(isinstance(lists.type, torch._C.ListType), "aten::_foreach_add.List's self is not a ListType")
    optional = api.op_schema("aten::linear", "").arguments[2]
    require(isinstance(optional.type, torch._C.OptionalType), "aten::linear's bias is not an OptionalType")
    require(isinstance(first.type, TensorType) and isinstance(lists.type, ListType)
            and isinstance(lists.type.getElementType(), TensorType) and isinstance(optional.type, OptionalType)
            and isinstance(optional.type.getElementType(), TensorType),
            "operators.TensorType / ListType / OptionalType (getElementType) do not match torch's schema types")
    try:
        api.op_schema("aten::no_such_op_for_mixfix", "")
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


def check_implicit_replication(probe: Probe) -> str:
    from torch.distributed.tensor.experimental import implicit_replication

    api = _api()
    require(api._implicit_replication is not None, "torch._C._get_dtensor_allow_implicit_replication is missing")
    outside = api.implicit_replication_enabled()
    with implicit_replication():
        inside = api.implicit_replication_enabled()
    require(not outside and inside, f"the flag reads {outside} outside and {inside} inside implicit_replication()")
    return "torch._C._get_dtensor_allow_implicit_replication: False, True inside implicit_replication()"


def check_mixed_operand_error(probe: Probe) -> str:
    import torch
    from torch.distributed.tensor import DTensor

    api = _api()
    op = probe.probe_op()
    seen = []
    for where, call in (("DTensor's C++ dispatch", lambda: op(probe.dtensor, probe.plain)),
                        ("OpDispatcher.unwrap_to_op_info", lambda: DTensor._op_dispatcher.unwrap_to_op_info(
                            torch.ops.aten.mul.Tensor, (probe.dtensor, probe.plain), {}))):
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - which exception it is, is the result
            require(api.is_mixed_operand_error(exc), f"{where} raised {type(exc).__name__}: {exc}")
            seen.append(where)
        else:
            raise AssertionError(f"{where} accepted a mixed call")
    return f"RuntimeError containing {api.MIXED_OPERAND_MESSAGE!r} from {' and '.join(seen)}"


def check_sharding_cache_clear(probe: Probe) -> str:
    import torch

    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    require(callable(clear), "torch._C._clear_DTensor_sharding_propagator_cache is missing")
    _api().clear_sharding_cache()
    return "torch._C._clear_DTensor_sharding_propagator_cache"


def check_dispatch_rule_registry(probe: Probe) -> str:
    from torch.distributed.tensor import DTensor

    api = _api()
    probe.probe_op()
    holder = api.dispatch_rule_holder(PROBE_QUALNAME)
    require(holder.find(DTensor) is None, "a DTensor rule is already registered on the probe op")

    def rule(cls: Any, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        return NotImplemented

    handle = type(holder).register(holder, DTensor, rule)
    try:
        require(holder.find(DTensor) is rule, "holder.find does not return the registered rule")
        try:
            type(holder).register(holder, DTensor, rule)
        except RuntimeError:
            pass
        else:
            raise AssertionError("a second rule for (op, DTensor) was accepted: the registry no longer keeps one")
    finally:
        handle.destroy()
    require(holder.find(DTensor) is None, "handle.destroy() left the rule registered")
    return "simple_registry.singleton.find(op).torch_dispatch_rules: register (one per class), find, destroy"


def check_rule_runs_before_fast_path(probe: Probe) -> str:
    import torch
    from torch.distributed.tensor import DTensor

    api = _api()
    op = probe.probe_op()
    holder = api.dispatch_rule_holder(PROBE_QUALNAME)
    calls: List[Tuple[Any, Any]] = []

    def rule(cls: Any, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        calls.append((cls, func))
        if not answer:
            return NotImplemented
        first, second = args
        local = func(first._local_tensor, second)  # plain tensors: torch's own kernel
        return DTensor.from_local(local, first.device_mesh, first.placements, run_check=False)

    handle = type(holder).register(holder, DTensor, rule)
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


def check_register_goes_through_holder(probe: Probe) -> str:
    import torch

    api = _api()
    probe.probe_op()
    holder = api.dispatch_rule_holder(PROBE_QUALNAME)
    seen: List[type] = []

    class Marker(torch.Tensor):
        pass

    def stand_in(cls: type, func: Callable[..., Any]) -> Any:
        seen.append(cls)
        return type(holder).register(holder, cls, func)

    holder.register = stand_in  # what the interceptor does on every op it hooks
    try:
        torch.library.register_torch_dispatch(PROBE_QUALNAME, Marker, lambda *a: NotImplemented, lib=probe.library)
    finally:
        del holder.register
    require(seen == [Marker], "torch.library.register_torch_dispatch did not call the holder's own `register`")
    require(holder.find(Marker) is not None, "the registration did not reach the holder")
    return "torch.library.register_torch_dispatch calls holder.register (an instance attribute can stand in)"


def check_registration_handle(probe: Probe) -> str:
    api = _api()
    destroyed = []
    api.registration_handle(lambda: destroyed.append(True)).destroy()
    require(destroyed == [True], "RegistrationHandle.destroy() did not call on_destroy")
    return "torch._library.utils.RegistrationHandle(on_destroy).destroy()"


def check_traced_tensors(probe: Probe) -> str:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensor

    api = _api()
    with FakeTensorMode():
        fake = torch.empty(2)
    require(api.is_traced(fake) and not api.is_traced(torch.empty(2)), "is_fake does not tell fake tensors")
    require(issubclass(FunctionalTensor, torch.Tensor), "FunctionalTensor")
    return "torch._subclasses.fake_tensor.is_fake, functional_tensor.FunctionalTensor"


def check_compile_id(probe: Probe) -> str:
    from torch._guards import CompileContext

    require(callable(CompileContext.current_compile_id), "torch._guards.CompileContext.current_compile_id is missing")
    require(CompileContext.current_compile_id() is None and _api().current_compile_id() is None,
             "CompileContext.current_compile_id() is not None outside torch.compile")
    return "torch._guards.CompileContext.current_compile_id(): None outside torch.compile"


def check_aot_autograd_cache(probe: Probe) -> str:
    import inspect

    api = _api()
    cache = api.aot_autograd_cache()
    require(cache is not None, "torch._functorch._aot_autograd.autograd_cache.AOTAutogradCache.save is missing or "
                                "no staticmethod")
    original = cache.__dict__["save"]
    parameters = list(inspect.signature(original.__func__).parameters)
    require(parameters == ["key", "entry", "remote"], f"AOTAutogradCache.save takes {parameters}")
    # What the lifecycle's compile-cache guard does with it (the package's own wrapper may be installed
    # already: a second one wraps it and gives it back).
    saved = []
    recording = staticmethod(lambda key, entry, remote: saved.append(key))
    api.skipping_save(recording, lambda: True).__func__("skipped", None, False)
    trial = api.skipping_save(recording, lambda: False)
    require(isinstance(trial, staticmethod), "skipping_save does not give a staticmethod")
    trial.__func__("key", None, False)
    require(saved == ["key"], "skipping_save does not skip, or does not call the original save as (key, entry, remote)")
    cache.save = trial
    wrapped = cache.__dict__["save"]
    cache.save = original
    require(wrapped is trial and cache.__dict__["save"] is original,
            "AOTAutogradCache.save could not be replaced by skipping_save's wrapper and restored")
    return "AOTAutogradCache.save, a staticmethod (key, entry, remote), wrapped by skipping_save and restored"


def check_dynamo_reset(probe: Probe) -> str:
    import torch

    require(callable(getattr(torch._dynamo, "reset", None)), "torch._dynamo.reset is missing")
    require(callable(_api().reset_compiled_code), "reset_compiled_code")
    return "torch._dynamo.reset, as reset_compiled_code (not called here: it would drop this process's compiled code)"


CHECKS: Dict[str, Check] = {check.name: check for check in (
    Check("api_imports", "keras_dtensor_mixfix._torch.api imports (its private torch imports exist)", check_api_imports),
    Check("dtensor_spec", "torch.distributed.tensor._dtensor_spec.DTensorSpec, TensorMeta", check_dtensor_spec),
    Check("dtensor_attributes", "DTensor._local_tensor, DTensor._spec", check_dtensor_attributes),
    Check("fast_constructor", "torch.Tensor._dtensor__new__ (DTensor's C++ constructor)", check_fast_constructor),
    Check("local_shape_and_offset", "torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
          check_local_shape_and_offset),
    Check("redistribute_local_tensor", "torch.distributed.tensor._redistribute.redistribute_local_tensor",
          check_redistribute_local_tensor),
    Check("masked_partial", "torch.distributed.tensor.placement_types._MaskPartial", check_masked_partial),
    Check("special_ops", "DTensor._op_dispatcher._random_ops, _custom_op_handlers", check_special_ops),
    Check("sharding_propagation", "DTensor._op_dispatcher.unwrap_to_op_info, sharding_propagator.propagate",
          check_sharding_propagation),
    Check("op_names", "torch._C._dispatch_get_all_op_names", check_op_names),
    Check("op_schema", "torch._C._get_schema, torch._C.TensorType/ListType/OptionalType", check_op_schema),
    Check("op_overload", "torch._ops.OpOverload._op, _schema, _overloadname; OpOverloadPacket._qualified_op_name",
          check_op_overload),
    Check("implicit_replication", "torch._C._get_dtensor_allow_implicit_replication", check_implicit_replication),
    Check("mixed_operand_error", "torch's mixed-operand error text", check_mixed_operand_error),
    Check("sharding_cache_clear", "torch._C._clear_DTensor_sharding_propagator_cache", check_sharding_cache_clear),
    Check("dispatch_rule_registry", "torch._library.simple_registry torch_dispatch_rules", check_dispatch_rule_registry),
    Check("rule_before_fast_path", "a (op, DTensor) dispatch rule runs before DTensor's fast path, eager and backward",
          check_rule_runs_before_fast_path),
    Check("register_through_holder", "torch.library.register_torch_dispatch -> holder.register",
          check_register_goes_through_holder),
    Check("registration_handle", "torch._library.utils.RegistrationHandle", check_registration_handle),
    Check("traced_tensors", "torch._subclasses fake_tensor.is_fake, FunctionalTensor", check_traced_tensors),
    Check("compile_id", "torch._guards.CompileContext.current_compile_id", check_compile_id),
    Check("aot_autograd_cache", "AOTAutogradCache.save (staticmethod)", check_aot_autograd_cache),
    Check("dynamo_reset", "torch._dynamo.reset", check_dynamo_reset),
)}
"""Every check by name, in the order they run (tests replace one to simulate a torch where it fails)."""

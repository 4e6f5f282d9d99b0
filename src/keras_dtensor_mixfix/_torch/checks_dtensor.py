"""The self-check's checks of DTensor's internals: its spec, attributes, constructor, local shapes,
redistribution, placements, op dispatcher, implicit replication, mixed-operand error and sharding cache.

Each check gets a ``Probe`` (see ``probe``) and returns what it saw, or raises when torch does not
behave as the package relies on; ``checks.CHECKS`` lists them in the order they run.
"""

from __future__ import annotations

import sys

from .probe import Probe, api_module, require


def check_api_imports(probe: Probe) -> str:
    api = api_module()
    return f"{len(api.__all__)} names importable"


def check_dtensor_spec(probe: Probe) -> str:
    import torch
    from torch.distributed.tensor import Shard

    api = api_module()
    spec = api.DTensorSpec(probe.mesh, (Shard(0),),
                           tensor_meta=api.TensorMeta(torch.Size((4, 4)), (4, 1), torch.float32))
    theirs = probe.dtensor._spec
    require(spec == theirs and hash(spec) == hash(theirs),
             f"a DTensorSpec built like promotion builds one ({spec!r}) differs from DTensor's own ({theirs!r})")
    require(tuple(spec.shape) == (4, 4) and spec.tensor_meta.dtype is torch.float32, "spec.shape/tensor_meta")
    return "DTensorSpec(mesh, placements, tensor_meta=TensorMeta(shape, stride, dtype)) equals DTensor's own spec"


def check_dtensor_attributes(probe: Probe) -> str:
    import torch

    from . import dtensor_attributes

    api = api_module()
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

    api = api_module()
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

    api = api_module()
    for placements in ((Shard(0),), (Shard(1),), (Replicate(),)):
        shape, offset = api.compute_local_shape_and_global_offset((4, 6), probe.mesh, placements)
        require(tuple(shape) == (4, 6) and tuple(offset) == (0, 0),
                 f"{placements}: local shape {tuple(shape)}, offset {tuple(offset)} on a world of one")
    return "compute_local_shape_and_global_offset(shape, mesh, placements) -> (local shape, global offset)"


def check_per_simulated_rank(probe: Probe) -> str:
    import importlib

    from . import processes

    try:
        importlib.import_module("torch.distributed._local_tensor")
    except ImportError:
        return "no rank simulator in this torch: per_simulated_rank is the function itself"
    runner = getattr(sys.modules["torch.distributed._local_tensor"], "maybe_run_for_local_tensor", None)
    require(callable(runner), "torch.distributed._local_tensor has no maybe_run_for_local_tensor")
    # outside the simulator the wrapped function runs once, as itself
    require(processes.per_simulated_rank(lambda x: (x, 1))(3) == (3, 1),
            "per_simulated_rank changed a call outside the mode")
    return "torch.distributed._local_tensor.maybe_run_for_local_tensor(function): one call per simulated rank"


def check_redistribute_local_tensor(probe: Probe) -> str:
    import torch
    from torch.distributed.tensor import Replicate, Shard

    api = api_module()
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
    require(api_module().is_masked_partial(_MaskPartial()), "is_masked_partial(_MaskPartial()) is False")
    return "placement_types._MaskPartial, a Partial"


def check_exact_placement_classes(probe: Probe) -> str:
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _MaskPartial, _StridedShard

    is_exactly = api_module().is_exactly
    require(is_exactly(Shard(0), Shard) and is_exactly(Replicate(), Shard, Replicate), "a plain placement is not")
    require(not is_exactly(_StridedShard(0, split_factor=2), Shard), "a _StridedShard counts as a plain Shard")
    require(not is_exactly(_MaskPartial(), Partial), "a _MaskPartial counts as a plain Partial")
    return "placement classes: _StridedShard and _MaskPartial told apart from Shard and Partial"


def check_special_ops(probe: Probe) -> str:
    import torch
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    random_ops, handlers = dispatcher._random_ops, dispatcher._custom_op_handlers
    require(torch.ops.aten.normal_.default in random_ops, "aten.normal_ is not among OpDispatcher._random_ops")
    require(isinstance(handlers, dict) and handlers, "OpDispatcher._custom_op_handlers is not a non-empty dict")
    require(all(isinstance(op, torch._ops.OpOverload) and callable(handler) for op, handler in handlers.items()),
             "OpDispatcher._custom_op_handlers does not map op overloads to callables")
    api = api_module()
    some_op, handler = next(iter(handlers.items()))
    require(api.custom_op_handler(some_op) is handler and api.dtensor_handles_specially(some_op),
             "custom_op_handler / dtensor_handles_specially do not find a registered handler")
    require(api.dtensor_handles_specially(torch.ops.aten.normal_.default)
             and not api.dtensor_handles_specially(torch.ops.aten.mul.Tensor), "dtensor_handles_specially")
    return f"OpDispatcher._random_ops ({len(random_ops)}) and ._custom_op_handlers ({len(handlers)})"


def check_sharding_propagation(probe: Probe) -> str:
    import torch
    from torch.distributed.tensor import Replicate, Shard

    api = api_module()
    dtensor = probe.dtensor
    local = api.local_output_spec(torch.ops.aten.mul.Tensor, (dtensor, dtensor), {})
    require(local is not None, "local_output_spec says this rank is not part of the mesh")
    require(isinstance(local, api.LocalOutput), f"local_output_spec returned {local!r}")
    spec = local.output_spec
    require(isinstance(spec, api.DTensorSpec) and tuple(spec.placements) == (Shard(0),)
            and spec.tensor_meta is not None and local.meta_known,
            f"output_spec {spec!r}, meta_known {local.meta_known}")
    require(local.runs_locally is True,
            f"runs_locally {local.runs_locally!r} (needs_redistribute) on a matching Shard(0)")
    # an mm of Shard(0) by Shard(1): DTensor redistributes an operand first (even on the probe's mesh of one)
    other = dtensor.redistribute(dtensor.device_mesh, (Replicate(),)).redistribute(dtensor.device_mesh, (Shard(1),))
    moved = api.local_output_spec(torch.ops.aten.mm.default, (dtensor, other), {})
    require(moved is not None and moved.runs_locally is False,
            f"runs_locally {getattr(moved, 'runs_locally', None)!r} for an mm of Shard(0) by Shard(1)")
    listed = api.local_output_spec(torch.ops.aten._foreach_mul.List, ([dtensor, dtensor], [dtensor, dtensor]), {})
    require(listed is not None and type(listed.output_spec) in (list, tuple) and len(listed.output_spec) == 2
            and all(isinstance(s, api.DTensorSpec) for s in listed.output_spec) and listed.meta_known,
            f"a _foreach_mul.List's output_spec {getattr(listed, 'output_spec', None)!r}")
    in_place = api.local_output_spec(torch.ops.aten._foreach_mul_.List, ([dtensor], [dtensor]), {})
    require(in_place is not None and in_place.output_spec is None, "an in-place _foreach op's output_spec is not None")
    return ("OpDispatcher.unwrap_to_op_info, DeviceMesh._is_current_rank_part_of_mesh, "
            "sharding_propagator.propagate -> output_sharding (output_spec, needs_redistribute, tensor_meta)")


def check_implicit_replication(probe: Probe) -> str:
    from torch.distributed.tensor.experimental import implicit_replication

    api = api_module()
    require(api._implicit_replication is not None, "torch._C._get_dtensor_allow_implicit_replication is missing")
    outside = api.implicit_replication_enabled()
    with implicit_replication():
        inside = api.implicit_replication_enabled()
    require(not outside and inside, f"the flag reads {outside} outside and {inside} inside implicit_replication()")
    return "torch._C._get_dtensor_allow_implicit_replication: False, True inside implicit_replication()"


def check_mixed_operand_error(probe: Probe) -> str:
    import torch
    from torch.distributed.tensor import DTensor

    api = api_module()
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
    api_module().clear_sharding_cache()
    return "torch._C._clear_DTensor_sharding_propagator_cache"

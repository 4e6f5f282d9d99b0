"""The self-check's checks: one per torch internal (private name or behaviour) that ``api`` relies on
(and ``operators`` and ``dtensor_attributes``, which read some of the same internals).

The checks live in three modules by what they check: ``checks_dtensor`` (DTensor's internals),
``checks_dispatch`` (the operator catalogue and per-op dispatch rules) and ``checks_compile``
(torch.compile's). ``CHECKS`` lists them in ``api``'s order; ``selfcheck`` runs them.
"""

from __future__ import annotations

from typing import Dict

from .checks_compile import (check_aot_autograd_cache, check_aot_inductor, check_cache_key_tag, check_compile_id,
                             check_device_mesh_cache_key, check_dynamo_reset, check_traced_tensors)
from .checks_dispatch import (check_dispatch_rule_registry, check_op_names, check_op_overload, check_op_schema,
                              check_register_goes_through_holder, check_registration_handle,
                              check_rule_runs_before_fast_path)
from .checks_dtensor import (check_api_imports, check_dtensor_attributes, check_dtensor_spec,
                             check_exact_placement_classes, check_fast_constructor, check_implicit_replication,
                             check_local_shape_and_offset, check_masked_partial,
                             check_mixed_operand_error, check_per_simulated_rank, check_redistribute_local_tensor,
                             check_sharding_cache_clear,
                             check_sharding_propagation, check_special_ops)
from .checks_launch import check_elastic_agent_store
from .probe import Check

CHECKS: Dict[str, Check] = {check.name: check for check in (
    Check("api_imports", "keras_dtensor_mixfix._torch.api imports (its private torch imports exist)",
          check_api_imports),
    Check("dtensor_spec", "torch.distributed.tensor._dtensor_spec.DTensorSpec, TensorMeta", check_dtensor_spec),
    Check("dtensor_attributes", "DTensor._local_tensor, DTensor._spec", check_dtensor_attributes),
    Check("fast_constructor", "torch.Tensor._dtensor__new__ (DTensor's C++ constructor)", check_fast_constructor),
    Check("local_shape_and_offset", "torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
          check_local_shape_and_offset),
    Check("redistribute_local_tensor", "torch.distributed.tensor._redistribute.redistribute_local_tensor",
          check_redistribute_local_tensor),
    Check("masked_partial", "torch.distributed.tensor.placement_types._MaskPartial", check_masked_partial),
    Check("exact_placement_classes", "placement_types._StridedShard, _MaskPartial: not counted as Shard, Partial",
          check_exact_placement_classes),
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
    Check("dispatch_rule_registry", "torch._library.simple_registry torch_dispatch_rules",
          check_dispatch_rule_registry),
    Check("rule_before_fast_path", "a (op, DTensor) dispatch rule runs before DTensor's fast path, eager and backward",
          check_rule_runs_before_fast_path),
    Check("register_through_holder", "torch.library.register_torch_dispatch -> holder.register",
          check_register_goes_through_holder),
    Check("registration_handle", "torch._library.utils.RegistrationHandle", check_registration_handle),
    Check("traced_tensors", "torch._subclasses fake_tensor.is_fake, FunctionalTensor", check_traced_tensors),
    Check("compile_id", "torch._guards.CompileContext.current_compile_id", check_compile_id),
    Check("aot_autograd_cache", "AOTAutogradCache.save (staticmethod)", check_aot_autograd_cache),
    Check("cache_key_tag", "torch.compiler.config.cache_key_tag", check_cache_key_tag),
    Check("device_mesh_cache_key", "torch._inductor.codecache.FxGraphCachePickler.__init__, dispatch_table",
          check_device_mesh_cache_key),
    Check("dynamo_reset", "torch._dynamo.reset", check_dynamo_reset),
    Check("aot_inductor", "functorch.compile.aot_function; torch._inductor.compile_fx.compile_fx_inner, partition_fn",
          check_aot_inductor),
    Check("elastic_agent_store", "torch.distributed.rendezvous._torchelastic_use_agent_store",
          check_elastic_agent_store),
    Check("per_simulated_rank", "torch.distributed._local_tensor.maybe_run_for_local_tensor",
          check_per_simulated_rank),
)}
"""Every check by name, in the order they run (tests replace one to simulate a torch where it fails)."""

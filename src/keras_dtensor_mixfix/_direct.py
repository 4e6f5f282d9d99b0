"""Run a promoted call the way DTensor would, without dispatching it a second time.

After promotion a mixed call is an ordinary DTensor call, and when DTensor's sharding
propagation says it needs no redistribution, DTensor itself does only three things: it runs the
op on the local tensors, and wraps the local result with the propagated output spec (or, for an
in-place op, returns ``self``). Re-dispatching the promoted call to get there costs more than
the promotion itself (a second trip through the dispatcher, DTensor's cache key, a DTensor
built only to be unwrapped again).

So, for one shape of call, the decision is taken once and then reused: ``plan`` asks DTensor's
own sharding propagator about a promoted call and answers with what DTensor would do, or with
``None`` when the call is anything but the plain case above (a redistribution, a random op, an
op DTensor handles by hand, a view, several outputs, a rank outside the mesh, or a torch whose
internals look different). The caller keys the answer by everything the propagation reads (the
op, the argument position, the plain operand's shape, stride and dtype, the DTensor's spec), so
the answer cannot go stale within a patch; ``unpatch()`` forgets it.

Only eager calls come here: while ``torch.compile`` traces, promotion always re-dispatches.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Tuple, Union

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

log = logging.getLogger("keras_dtensor_mixfix")


class _InPlace:
    """The plan of an in-place op on the DTensor operand: run it on the local tensor, return ``self``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "IN_PLACE"


IN_PLACE = _InPlace()
Plan = Union[DTensorSpec, _InPlace, None]


def plan(func: Any, promoted_args: Tuple[Any, ...]) -> Plan:
    """What DTensor would do with ``func(*promoted_args)`` (no kwargs), if it is the plain case.

    Returns the output spec for a functional op, ``IN_PLACE`` for an op that writes into
    ``promoted_args[0]`` (a DTensor) and keeps its placements, or ``None``: re-dispatch.
    Never raises: any surprise means ``None``.
    """
    try:
        return _plan(func, promoted_args)
    except Exception as exc:  # a torch whose internals differ: the re-dispatch stays correct
        log.debug("no direct plan for %s: %s: %s", func, type(exc).__name__, exc)
        return None


def _plan(func: Any, args: Tuple[Any, ...]) -> Plan:
    if type(func) is not torch._ops.OpOverload:
        return None
    dispatcher = DTensor._op_dispatcher
    if func in dispatcher._random_ops or torch.Tag.nondeterministic_seeded in func.tags:
        return None  # DTensor runs these under its RNG tracker
    if func in dispatcher._custom_op_handlers:
        return None
    schema = func._schema
    if schema._is_view_op() or len(schema.returns) != 1 or str(schema.returns[0].type) != "Tensor":
        return None
    written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    in_place = written == [0]
    if written and not in_place:
        return None
    if in_place and type(args[0]) is not DTensor:
        return None
    op_info = dispatcher.unwrap_to_op_info(func, args, {})
    if not op_info.compute_mesh._is_current_rank_part_of_mesh():
        return None
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    if sharding is None or sharding.needs_redistribute or type(sharding.output_spec) is not DTensorSpec:
        return None
    spec = sharding.output_spec
    if in_place:
        # DTensor returns ``self`` untouched only when the placements stay; otherwise it edits
        # self's spec, which is left to DTensor.
        return IN_PLACE if spec.placements == args[0]._spec.placements else None
    if spec.tensor_meta is None:
        return None
    return spec


def confirmed(planned: Plan, promoted_args: Tuple[Any, ...], result: Any) -> Plan:
    """``planned``, if DTensor's real answer to the same call (``result``) agrees with it, else ``None``.

    The first call of each shape is re-dispatched as usual; this cross-check keeps a plan that
    does not describe what DTensor actually did from ever being used.
    """
    if planned is None:
        return None
    if planned is IN_PLACE:
        return planned if result is promoted_args[0] else None
    if type(result) is DTensor and result._spec == planned:
        return planned
    log.debug("direct plan %s disagrees with DTensor's result %r; re-dispatching this call shape", planned,
              getattr(result, "_spec", result))
    return None


def direct_local_result(local: torch.Tensor, spec: DTensorSpec, new: Optional[Any]) -> DTensor:
    """Wrap a local result as DTensor's dispatch does (``requires_grad`` taken from the result)."""
    if new is not None:
        return new(DTensor, local, spec, requires_grad=local.requires_grad)
    return DTensor(local, spec, requires_grad=local.requires_grad)  # type: ignore[call-arg]

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
from typing import Any, Dict, Optional, Tuple, Union

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._rules.ops import op_traits
from .._torch.api import DTensorSpec, dtensor_handles_specially, local_output_spec
from .._torch.operators import OpOverload, is_view_schema, schema_of
from .operands import dtensors_in

log = logging.getLogger("keras_dtensor_mixfix")


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


IN_PLACE = _Marker("IN_PLACE")
"""The plan of an in-place op on the DTensor ``self``: run it on the local tensor, return ``self``."""
NO_RESULT = _Marker("NO_RESULT")
"""The plan of an in-place ``_foreach_*`` op (it returns nothing): run it on the local lists."""
Plan = Union[DTensorSpec, Tuple[DTensorSpec, ...], _Marker, None]

# Placements whose pointwise sharding never depends on a scalar argument's value: a foreach plan
# is keyed by its tensors only (optimizers change their scalars every step), so it is refused
# when any DTensor is Partial or of another kind.
_PLAIN_PLACEMENTS = (Shard, Replicate)


def plan(func: Any, promoted_args: Tuple[Any, ...], kwargs: Optional[Dict[str, Any]] = None) -> Plan:
    """What DTensor would do with ``func(*promoted_args, **kwargs)``, if it is the plain case.

    Returns the output spec for a functional op, ``IN_PLACE`` for an op that writes into
    ``promoted_args[0]`` (a DTensor) and keeps its placements, for a ``_foreach_*`` op the tuple
    of output specs or ``NO_RESULT`` (in-place), or ``None``: re-dispatch. Never raises: any
    surprise means ``None``.
    """
    try:
        return _plan(func, promoted_args, kwargs or {})
    except Exception as exc:  # noqa: BLE001 - a torch whose internals differ: the re-dispatch stays correct
        log.debug("no direct plan for %s: %s: %s", func, type(exc).__name__, exc)
        return None


def _plan(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Plan:
    if type(func) is not OpOverload:
        return None
    if dtensor_handles_specially(func) or torch.Tag.nondeterministic_seeded in func.tags:
        return None  # random ops run under DTensor's RNG tracker; custom handlers their own way
    schema = schema_of(func)
    if is_view_schema(schema):
        return None
    returns = [str(r.type) for r in schema.returns]
    written = op_traits(func).written
    if written and written != {0}:
        return None
    in_place = written == {0}
    foreach = schema.name.startswith("aten::_foreach_")
    if foreach:
        if returns not in ([], ["List[Tensor]"], ["Tensor[]"]) or (in_place != (returns == [])):
            return None
        if any(type(p) not in _PLAIN_PLACEMENTS for t in dtensors_in(args, kwargs) for p in t._spec.placements):
            return None
    elif returns != ["Tensor"] or kwargs:
        return None
    elif in_place and type(args[0]) is not DTensor:
        return None
    local = local_output_spec(func, args, kwargs)
    if local is None or not local.runs_locally:
        return None
    spec: Any = local.output_spec
    if foreach:
        if in_place:
            return NO_RESULT if spec is None else None
        if type(spec) not in (list, tuple) or not all(type(s) is DTensorSpec for s in spec) or not local.meta_known:
            return None
        return tuple(spec)
    if type(spec) is not DTensorSpec:
        return None
    if in_place:
        # DTensor returns ``self`` untouched only when the placements stay; otherwise it edits
        # self's spec, which is left to DTensor.
        return IN_PLACE if spec.placements == args[0]._spec.placements else None
    if not local.meta_known:
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
        agrees = result is promoted_args[0]
    elif planned is NO_RESULT:
        agrees = result is None
    elif type(planned) is tuple:
        agrees = type(result) in (list, tuple) and len(result) == len(planned) and all(
            type(r) is DTensor and r._spec == s for r, s in zip(result, planned))
    else:
        agrees = type(result) is DTensor and result._spec == planned
    if not agrees:
        log.debug("direct plan %s disagrees with DTensor's result %r; re-dispatching this call shape", planned,
                  getattr(result, "_spec", result))
        return None
    return planned

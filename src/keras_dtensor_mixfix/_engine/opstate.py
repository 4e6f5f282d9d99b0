"""Per-op state of the promotion path, looked up once per call: traits, the rule in force, fast-path entries."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from .._rules.decisions import REPLICATE
from .._rules.ops import op_traits
from .._rules.registry import registry
from .._torch.operators import OpOverload, op_callable
from .caches import CACHES, FastOptions, remember
from .corrections import corrected
from .context import options as _current_options

_OP_STATES = CACHES.op_states

UNDECIDED = object()
"""A fast-path entry's direct plan before the first two-argument call of its shape was re-dispatched."""


class OpState:
    """What promotion needs per op overload, looked up once per call (keyed by ``id(op)``: the
    entry holds the op, so the id cannot be reused while the entry exists)."""

    __slots__ = ("op", "traits", "call", "may_fast", "rule", "version", "stats_key", "fast")

    def __init__(self, op: Any) -> None:
        self.op = op
        self.traits = op_traits(op)
        # OpOverload.__call__ only forwards to ``_op``; calling that directly saves a Python frame.
        call = op_callable(op) if type(op) is OpOverload else op
        # An op DTensor computes wrongly after a promotion runs its exact reformulation instead, always on the
        # general path: the fast path's direct plans would run the op itself on local pieces.
        correction = corrected(self.traits.name, call)
        self.call = correction or call
        self.may_fast = not self.traits.foreach and correction is None
        self.rule: Any = None
        self.version = -1  # the registry's version ``rule`` was looked up at
        self.stats_key = (self.traits.name, REPLICATE)
        # The fast path's entries for this op (fast.FastEntry, keyed by the plain operand's position,
        # shape, stride, dtype and the DTensor's spec), or for a foreach op its plans (foreach.ForeachPlan, or
        # None where the direct path is refused), keyed by the lists' layout.
        self.fast: Dict[Tuple[Any, ...], Any] = {}


def op_state(func: Any) -> OpState:
    info = _OP_STATES.get(id(func))
    if info is None or info.op is not func:
        info = OpState(func)
        remember(_OP_STATES, id(func), info)
    return info


def fast_flags(info: OpState, func: Any) -> Optional[FastOptions]:
    """The fast-path flags of the options in force if they let ``func`` take a fast path, else None:
    its rule is ``"replicate"`` by name (registered for it, or the default) and no option adds
    per-operand work. ``.direct`` of the answer then says whether direct plans may be used.

    fast.promote_fast has this inlined (keep the two alike)."""
    version = registry.version
    if info.version != version:
        info.rule = registry.lookup(func)
        info.version = version
    rule = info.rule
    options = _current_options()
    flags = CACHES.fast_options
    if options is not flags.options:
        flags = CACHES.fast_options = FastOptions(options)
    if flags.allowed and (flags.replicate_default if rule is None else type(rule) is str and rule == REPLICATE):
        return flags
    return None

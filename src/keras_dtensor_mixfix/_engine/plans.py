"""Per-op state of the promotion path: traits, the rule in force, the fast path's cached decisions."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from .._rules.decisions import REPLICATE
from .._rules.ops import op_traits
from .._rules.registry import registry
from .construct import remember
from .context import options as _current_options

class OpState:
    """What promotion needs per op overload, looked up once per call (keyed by ``id(op)``: the
    entry holds the op, so the id cannot be reused while the entry exists)."""

    __slots__ = ("op", "traits", "call", "may_fast", "rule", "version", "stats_key", "fast")

    def __init__(self, op: Any) -> None:
        self.op = op
        self.traits = op_traits(op)
        # OpOverload.__call__ only forwards to ``_op``; calling that directly saves a Python frame.
        self.call = op._op if type(op) is torch._ops.OpOverload else op
        self.may_fast = not self.traits.foreach
        self.rule: Any = None
        self.version = -1  # the registry's version ``rule`` was looked up at
        self.stats_key = (self.traits.name, REPLICATE)
        # The fast path's decisions for this op: (plain's position, shape, stride, dtype, the
        # DTensor's spec) -> [placements, local index, promoted spec, direct plan, the operand as
        # described in errors]; the plan is UNDECIDED until the first 2-argument call of that
        # shape has been re-dispatched.
        self.fast: Dict[Tuple[Any, ...], List[Any]] = {}


OP_STATES: Dict[int, OpState] = {}


def op_state(func: Any) -> OpState:
    info = OP_STATES.get(id(func))
    if info is None or info.op is not func:
        info = OpState(func)
        remember(OP_STATES, id(func), info)
    return info


# [options, default rule is "replicate" by name, fast path allowed by the options, direct plans
# allowed]. Options objects are immutable (``Options.updated`` makes a new one), so identity says
# when to recompute.
FAST_OPTIONS: List[Any] = [None, False, False, False]
UNDECIDED = object()


def fast_path_options(info: OpState, func: Any) -> Any:
    """The options in force if they let ``func`` take a fast path, else None: its rule is
    ``"replicate"`` by name (registered for it, or the default) and no option adds per-operand
    work. ``direct_allowed()`` then says whether direct plans may be used."""
    version = registry.version
    if info.version != version:
        info.rule = registry.lookup(func)
        info.version = version
    rule = info.rule
    options = _current_options()
    if options is not FAST_OPTIONS[0]:
        FAST_OPTIONS[:] = [options, *_fast_option_flags(options)]
    if FAST_OPTIONS[2] and (FAST_OPTIONS[1] if rule is None else type(rule) is str and rule == REPLICATE):
        return options
    return None


def direct_allowed() -> bool:
    """Whether the options last seen by ``fast_path_options`` allow direct plans."""
    return FAST_OPTIONS[3]


def _fast_option_flags(options: Any) -> Tuple[bool, bool, bool]:
    default = options.default
    # Any option that adds per-operand work (e.g. a check mode) sends every call down the general path.
    allowed = getattr(options, "check", "off") == "off"
    return type(default) is str and default == REPLICATE, allowed, bool(getattr(options, "direct", True))

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


class Admission:
    """Whether the calls of one op may take a cached path, as worked out under one options object and
    one version of the rule registry (immutable: swapped whole, so a reader never sees half of one).

    ``flags`` is the ``FastOptions`` of those options where the op is admitted, else None.
    """

    __slots__ = ("options", "version", "flags")

    def __init__(self, options: Any, version: int, flags: Optional[FastOptions]) -> None:
        self.options = options
        self.version = version
        self.flags = flags


NOT_WORKED_OUT = Admission(object(), -1, None)
"""A new ``OpState``'s admission: matches no options object, so the first call works it out."""


class OpState:
    """What promotion needs per op overload, looked up once per call (keyed by ``id(op)``: the
    entry holds the op, so the id cannot be reused while the entry exists)."""

    __slots__ = ("op", "traits", "call", "may_fast", "admission", "stats_key", "fast")

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
        # Whether its calls may take a cached path under the options and rules in force (``admit``).
        self.admission: Admission = NOT_WORKED_OUT
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


def admit(info: OpState, func: Any) -> Optional[FastOptions]:
    """Work out, remember in ``info.admission`` and return whether calls of ``func`` may take a cached path.

    The one definition of the admission of the cached paths (fast.py, foreach.py's direct path): the
    rule in force for ``func`` is ``"replicate"`` given as a name (registered for it, or the default: a
    callable rule may answer anything) and no option adds per-operand work (a check mode).

    Args:
        info: ``func``'s ``OpState``.
        func: the op.

    Returns:
        The ``FastOptions`` of the options in force if admitted (its ``.direct`` says whether direct
        plans may be used), else None.
    """
    version = registry.version  # read before the lookup: a change racing with it leaves a stale version
    rule = registry.lookup(func)
    options = _current_options()
    flags = CACHES.fast_options
    if options is not flags.options:
        flags = CACHES.fast_options = FastOptions(options)
    admitted = flags.allowed and (flags.replicate_default if rule is None else type(rule) is str and rule == REPLICATE)
    info.admission = Admission(options, version, flags if admitted else None)
    return info.admission.flags


def admission(info: OpState, func: Any) -> Optional[FastOptions]:
    """``admit``'s answer, worked out again only when the options or the rules have changed since.

    The fast path (fast.py) reads ``info.admission`` with this same test inline, to save a call per op.
    """
    known = info.admission
    if known.options is not _current_options() or known.version != registry.version:
        return admit(info, func)
    return known.flags


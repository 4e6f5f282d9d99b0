"""Turn a rule's answer into one Decision per plain operand.

One resolution for every rule, the default rule included: whatever answer the registry
accepts (a name, a Decision, a mapping from position, a sequence aligned with ``call.plain``,
or ``None`` for "what the default rule says") means the same wherever it comes from.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from .._rules.decisions import REPLICATE, Decision, MixedCall, Position, as_decision
from .._rules.errors import MixedOperandError, promotion_error
from .._rules.ops import OpTraits
from .context import options as _current_options

Decisions = Dict[Position, Decision]


def decide(call: MixedCall, rule: Any, traits: OpTraits) -> Decisions:
    """Decisions for every operand in ``call.plain`` under ``rule`` (registered, or the default)."""
    default: Optional[Decisions] = None

    def from_default(position: Position) -> Decision:
        nonlocal default
        if default is None:
            # The default rule answers like any rule; where it says None, "replicate".
            default = _resolve(_ask(_current_options().default, call), call, traits, "default rule",
                               lambda _: Decision(REPLICATE))
        return default[position]

    return _resolve(_ask(rule, call), call, traits, f"rule for {traits.name}", from_default)


def _ask(rule: Any, call: MixedCall) -> Any:
    if callable(rule) and not isinstance(rule, (str, Decision)):
        return rule(call)
    return rule


def _resolve(answer: Any, call: MixedCall, traits: OpTraits, where: str,
             fallback: Callable[[Position], Decision]) -> Decisions:
    """``answer`` for each plain operand; ``None`` (whole or per operand) asks ``fallback``."""
    if answer is None:
        return {operand.position: fallback(operand.position) for operand in call.plain}
    if isinstance(answer, (str, Decision)):
        decision = as_decision(answer, where)
        return {operand.position: decision for operand in call.plain}
    if isinstance(answer, dict) or hasattr(answer, "keys"):
        decisions = {}
        for operand in call.plain:
            if operand.position not in answer:
                raise promotion_error(traits.name, f"the {where}'s answer has no entry for {operand.label} "
                                      f"(position {operand.position})", operand_label=operand.label,
                                      operand=operand.tensor)
            value = answer[operand.position]
            decisions[operand.position] = fallback(operand.position) if value is None else as_decision(value, where)
        return decisions
    if isinstance(answer, (list, tuple)):
        if len(answer) != len(call.plain):
            raise MixedOperandError(f"{where}: the callable rule answered {len(answer)} decisions for "
                                    f"{len(call.plain)} plain operands ({[o.label for o in call.plain]})")
        return {operand.position: fallback(operand.position) if value is None else as_decision(value, where)
                for operand, value in zip(call.plain, answer)}
    as_decision(answer, where)  # raises a TypeError naming the bad answer
    raise AssertionError("unreachable")

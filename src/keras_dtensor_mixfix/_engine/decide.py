"""Stage 3, decide: one checked Decision, mesh and DTensor peer per plain operand.

The rule registered for the op (or the default rule) is asked once per call. One resolution for
every rule, the default rule included: whatever answer the registry accepts (a name, a Decision,
a mapping from position, a sequence aligned with ``call.plain``, or ``None`` for "what the default
rule says") means the same wherever it comes from.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from .._rules.decisions import (ERROR, REPLICATE, Decision, MixedCall, Operand, PeerIndex, Position, as_decision,
                                check_decision)
from .._rules.errors import MixedOperandError, describe_mesh, promotion_error
from .._rules.ops import OpTraits
from .._rules.registry import registry
from .meshes import same_ranks
from .context import options as _current_options

Decisions = Dict[Position, Decision]

Decided = List[Tuple[Operand, Decision, Any, Any]]
"""Each plain operand to promote with its checked decision, the mesh to promote it to and its DTensor peer."""


def decide_operands(call: MixedCall, traits: OpTraits) -> Decided:
    """Ask the rule for ``call.op`` (registered, or the default) and check each plain operand's answer."""
    try:
        # No registration: None, which decide() resolves as the default rule.
        decisions = decide(call, registry.lookup(call.op), traits)
    except (TypeError, ValueError) as exc:
        # Raised inside an operator: Python would turn a TypeError from Tensor.__mul__ into
        # "unsupported operand type(s)" and lose this message.
        raise MixedOperandError(f"keras_dtensor_mixfix: {exc}") from exc
    decided: Decided = []
    peers = PeerIndex(call.operands)
    for operand in call.plain:
        decision = decisions[operand.position]
        mesh = decision.mesh if decision.mesh is not None else call.mesh
        peer = peers.choose(operand)
        if decision.kind == ERROR:
            raise promotion_error(traits.name, f"the rule for this op is 'error' (operand {operand.label})",
                                  operand_label=operand.label, operand=operand.tensor, peers=call.peers)
        if mesh is None:
            raise promotion_error(
                traits.name,
                "its DTensor operands sit on different meshes ("
                + "; ".join(describe_mesh(m) for m in call.meshes) + "), so there is no single mesh to promote to",
                operand_label=operand.label, operand=operand.tensor, peers=call.peers,
                advice=_meshes_advice(call.meshes),
                rule_advice=False,
            )
        decided.append((operand, check_decision(decision, traits.name, operand, mesh, call.peers), mesh, peer))
    return decided


def _meshes_advice(meshes: Any) -> str:
    if all(same_ranks(meshes[0], other) for other in meshes[1:]):
        return ("These meshes span the same ranks: a DTensor on another mesh is taken as a plain tensor when each "
                "rank holds its whole value, so redistribute the DTensors off the op's mesh to Replicate "
                "(x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)), or put the DTensors on one "
                "mesh.")
    return ("These meshes span different ranks, so no rank holds every operand: put the DTensors on one mesh "
            "(DTensor.from_local(x.to_local(), mesh, placements) where each rank's piece is what it should hold).")


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
                                      operand=operand.tensor, rule_advice=False,
                                      advice="Answer for every operand in call.plain (None: the default rule).")
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

"""Stage 6, run: run the op on the promoted operands, then what follows every promotion.

Before the op, check mode's collectives (check.py); the op itself, whose failure names what was
promoted and how; after it, the plain ``.grad`` hook (grad.py), the stats (stats.py), and for an
in-place op on a plain tensor that tensor as the result. A direct plan (direct.py) runs the op on
local tensors instead and wraps the local result as DTensor would (``wrap_result``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from . import grad as _grad
from . import stats as _stats
from .._rules.decisions import REPLICATE, Decision, Operand
from .._rules.errors import MixedOperandError, promotion_error
from .._rules.ops import OpTraits
from .._torch.api import DTensorSpec, is_traced
from .construct import dtensor_new
from .context import options as _current_options
from .operands import dtensors_in

Promoted = List[Tuple[Operand, DTensor, Decision, Tuple[Placement, ...]]]
"""Each promoted operand: (the operand, its DTensor, its decision, its placements)."""

Described = List[Tuple[str, str, Tuple[Placement, ...]]]
"""Each promoted operand as (label, rule kind, placements), for error messages."""


def run_promoted(call: Any, traits: OpTraits, args: Tuple[Any, ...], kwargs: Dict[str, Any], promoted: Promoted) -> Any:
    """Run ``call`` (the op) on the promoted ``args``/``kwargs``, with everything that goes with a promotion."""
    options = _current_options()
    if options.check != "off":
        # Before the op: a rank whose operand breaks the assumption may fail inside the op, and
        # every rank must reach the check's collective.
        _check_promoted(options.check, traits, promoted)
    result = call_op(call, args, kwargs, traits, [(o.label, d.kind, p) for o, _, d, p in promoted])
    if options.plain_grads:
        for operand, _, decision, placements in promoted:
            if operand.tensor.requires_grad:
                _grad.ensure_plain_grad(operand.tensor, decision.kind, placements, traits.name)
    _stats.record(traits.name, [d.kind for _, _, d, _ in promoted])
    for operand, dtensor, _, _ in promoted:
        if operand.written and result is dtensor:
            return operand.tensor  # an in-place op on a plain tensor returns that tensor, as in torch
    return result


def _check_promoted(mode: str, traits: OpTraits, promoted: Promoted) -> None:
    from . import check as _check
    for operand, dtensor, decision, placements in promoted:
        if is_traced(operand.tensor):
            continue  # no collectives while torch.compile traces
        if decision.kind == REPLICATE:
            _check.check_replicated(mode, traits.name, operand.label, operand.tensor, dtensor.device_mesh,
                                    dtensor.device)
        else:
            _check.check_local(mode, traits.name, operand.label, operand.tensor, dtensor.device_mesh, placements,
                               tuple(dtensor.shape), dtensor.device)


def call_op(call: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], traits: OpTraits, described: Described) -> Any:
    """Run the op on promoted (or local) operands; its failure names what was promoted and how."""
    try:
        return call(*args, **kwargs)
    except MixedOperandError:
        raise
    except Exception as exc:
        raise op_failed(traits, described, args, kwargs, exc) from exc


def op_failed(traits: OpTraits, described: Described, args: Tuple[Any, ...],
              kwargs: Dict[str, Any], exc: Exception) -> MixedOperandError:
    text = "; ".join(f"{label} as {kind} {tuple(placements)}" for label, kind, placements in described)
    if isinstance(exc, NotImplementedError):
        # DTensor has no sharding strategy for the op at all: no placement of the operands helps.
        advice = ("DTensor cannot run this op on any layout: run it on plain tensors (pass x.full_tensor() for "
                  "each DTensor operand, and distribute the result again if you need a DTensor), or register a "
                  "sharding strategy with torch (torch.distributed.tensor.experimental.register_sharding).")
    else:
        advice = ("DTensor has no strategy for these placements: redistribute the DTensor operands to Replicate "
                  "first (x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)), or run the op on "
                  "plain tensors (x.full_tensor()).")
    return promotion_error(
        traits.name,
        f"after promoting the plain operand(s) ({text}) the op itself failed: {type(exc).__name__}: {exc}",
        peers=[a for a in dtensors_in(args, kwargs)][:4], advice=advice, rule_advice=False,
    )


def wrap_result(out: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """A local result wrapped the way DTensor wraps one (``requires_grad`` from the result)."""
    if dtensor_new is not None:
        return dtensor_new(DTensor, out, spec, requires_grad=out.requires_grad)
    return DTensor(out, spec, requires_grad=out.requires_grad)

"""The built-in rule pack, registered through the same hook as third-party packs.

Parameter-like operands (a norm's weight and bias, running statistics, a loss's class
weights) are whole tensors on every rank whatever the default rule says: under
``default="local"`` the batch operand of ``layer_norm`` is this rank's piece, its weight is not.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional

from ._decisions import REPLICATE, MixedCall, Position
from .hookspecs import hookimpl

log = logging.getLogger(__name__)

PARAMETER_ARGUMENTS = frozenset({"weight", "bias", "running_mean", "running_var", "pos_weight"})

PARAMETER_OPS = (
    "aten::native_layer_norm",
    "aten::native_layer_norm_backward",
    "aten::native_batch_norm",
    "aten::_native_batch_norm_legit",
    "aten::_native_batch_norm_legit_no_training",
    "aten::native_batch_norm_backward",
    "aten::native_group_norm",
    "aten::native_group_norm_backward",
    "aten::_fused_rms_norm",
    "aten::nll_loss_forward",
    "aten::nll_loss_backward",
    "aten::nll_loss2d_forward",
    "aten::nll_loss2d_backward",
    "aten::binary_cross_entropy",
    "aten::binary_cross_entropy_backward",
    "aten::binary_cross_entropy_with_logits",
)


def parameters_are_whole(call: MixedCall) -> Dict[Position, Optional[str]]:
    """Parameter-like operands replicate; every other operand follows the default rule (None)."""
    names = [argument.name for argument in call.op._schema.arguments]
    answer: Dict[Position, Optional[str]] = {}
    for operand in call.plain:
        head = operand.position[0]
        name = names[head] if isinstance(head, int) and head < len(names) else head
        answer[operand.position] = REPLICATE if name in PARAMETER_ARGUMENTS else None
    return answer


@hookimpl
def register_rules(register: Callable[[Any, Any], Any]) -> None:
    for op in PARAMETER_OPS:
        try:
            register(op, parameters_are_whole)
        except ValueError:  # an op this torch build does not have
            log.debug("built-in pack: %s does not exist in this torch; skipped", op)

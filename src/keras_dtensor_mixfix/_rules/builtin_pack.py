"""The built-in rule pack, registered through the same hook as third-party packs.

Parameter-like operands (a norm's weight and bias, running statistics, a loss's class
weights) are whole tensors on every rank whatever the default rule says: under
``default="local"`` the batch operand of ``layer_norm`` is this rank's piece, its weight is not.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional

from .._torch.operators import schema_of
from .decisions import REPLICATE, MixedCall, Position
from ..hookspecs import hookimpl
from .errors import UnknownOperatorError
from .ops import op_key, packet_name

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
    names = [argument.name for argument in schema_of(call.op).arguments]
    answer: Dict[Position, Optional[str]] = {}
    for operand in call.plain:
        head = operand.position[0]
        name = names[head] if isinstance(head, int) and head < len(names) else head
        answer[operand.position] = REPLICATE if name in PARAMETER_ARGUMENTS else None
    return answer


def _sharded_beyond_batch(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(tensor, DTensor) and any(
        isinstance(p, Shard) and (p.dim % tensor.ndim) != 0 for p in tensor.placements)


def _is_sharded(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(tensor, DTensor) and any(isinstance(p, Shard) for p in tensor.placements)


def _scatter_dims(call: MixedCall) -> Any:
    """(self, the scatter dim normalized, index, src) of a ``scatter_add(self, dim, index, src)`` call."""
    self, dim, index, src = call.args[:4]
    return self, dim % max(self.ndim, 1), index, src


def _split_dims(tensor: Any) -> set:
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return set()
    return {p.dim % max(tensor.ndim, 1) for p in tensor.placements if isinstance(p, Shard)}


def _scatter_along_split_dim(call: MixedCall) -> bool:
    """The written tensor is split along the scatter dim (DTensor cannot scatter into it in place)."""
    self, dim, _, _ = _scatter_dims(call)
    return dim in _split_dims(self)


def _scatter_src_misaligned(call: MixedCall) -> bool:
    """DTensor's scatter_add strategy keeps a split of ``self`` along a non-scatter dim ``d`` where the index
    has ``self``'s size on ``d``, and splits ``src`` along ``d`` too without checking its size: a larger
    ``src`` is then split at other rows than the index (pytorch's scatter strategy checks it, scatter_add's
    does not)."""
    self, dim, index, src = _scatter_dims(call)
    if self.ndim != index.ndim or src.ndim != index.ndim:
        return False
    return any(d != dim and index.shape[d] == self.shape[d] and src.shape[d] != index.shape[d]
               for d in _split_dims(self))


_REPLICATE_ADVICE = ("Redistribute the DTensor operands to Replicate first (x.redistribute(x.device_mesh, "
                     "[Replicate()] * x.device_mesh.ndim)), or run this op on plain tensors.")

# Mixed calls on which torch 2.13's DTensor itself returns wrong numbers or fails obscurely (measured with
# every operand a DTensor: tools/op_sweep.py): refused with a clear error rather than promoted into a
# silently wrong result. Each entry: op -> (condition on the call, what goes wrong, what to do instead).
# The conditions are as narrow as the measured fault: calls outside them are promoted.
KNOWN_WRONG_IN_DTENSOR = {
    "aten::convolution": (lambda call: _sharded_beyond_batch(call.args[0]) or (
        _is_sharded(call.args[0]) and call.args[0].ndim < call.args[1].ndim),
        "DTensor's convolution of an input sharded on a channel or spatial dim returns a wrong shape and values",
        _REPLICATE_ADVICE),
    "aten::addmv_": (lambda call: True, "DTensor's in-place addmv_ loses or garbles the write", _REPLICATE_ADVICE),
    "aten::_batch_norm_with_update": (
        lambda call: 1 in _split_dims(call.args[0]),
        "DTensor's _batch_norm_with_update of an input split along its channel dim updates the running "
        "statistics wrongly",
        "Redistribute the input so that its channel dim (dim 1) is not split (Replicate or Shard(0)) first."),
    "aten::scatter_add_": (
        lambda call: _scatter_along_split_dim(call) or _scatter_src_misaligned(call),
        "DTensor's scatter_add_ into a tensor split along the scatter dim fails with a shape error, and one "
        "whose src is larger than the index along a split dim scatters the wrong src rows",
        "Call the out-of-place scatter_add (x = x.scatter_add(dim, index, src)), which DTensor computes right "
        "here, or redistribute x to Replicate first; a src larger than the index can be narrowed to the "
        "index's shape (scatter_add reads no more of it)."),
    "aten::scatter_add": (
        lambda call: _scatter_src_misaligned(call),
        "DTensor's scatter_add whose src is larger than the index along a dim the tensor is split on "
        "scatters the wrong src rows",
        "Narrow src to the index's shape first (scatter_add reads no more of it: "
        "src[tuple(slice(0, n) for n in index.shape)]), or redistribute the DTensor operands to Replicate."),
}


def refuse_known_wrong(call: MixedCall) -> Optional[str]:
    """Raise for calls DTensor computes wrongly; otherwise leave the decision to the default (None)."""
    from .errors import promotion_error

    condition, what, advice = KNOWN_WRONG_IN_DTENSOR[packet_name(call.op)]
    if condition(call):
        operand = call.plain[0] if call.plain else None
        raise promotion_error(
            op_key(call.op),
            f"{what} (torch 2.13, measured by the op sweep); promoting the plain operand would hide that",
            operand_label=operand.label if operand else None, operand=operand.tensor if operand else None,
            peers=call.peers, advice=advice, rule_advice=False,
        )
    return None


@hookimpl
def register_rules(register: Callable[[Any, Any], Any]) -> None:
    for op in PARAMETER_OPS:
        try:
            register(op, parameters_are_whole)
        except UnknownOperatorError:  # an op this torch build does not have
            log.debug("built-in pack: %s does not exist in this torch; skipped", op)
    for op in KNOWN_WRONG_IN_DTENSOR:
        try:
            register(op, refuse_known_wrong)
        except UnknownOperatorError:
            log.debug("built-in pack: %s does not exist in this torch; skipped", op)

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


def _split_dims(tensor: Any) -> set:
    """The dims a DTensor operand is split along (``Shard``), normalized; empty for a plain or unsplit one."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return set()
    return {p.dim % max(tensor.ndim, 1) for p in tensor.placements if isinstance(p, Shard)}


def _convolution_split_wrongly(call: MixedCall) -> bool:
    """An input split along a channel or spatial dim (or at all, when it has no batch dim), or a weight split
    along a kernel dim."""
    input, weight = call.args[:2]
    split = _split_dims(input)
    return (any(d != 0 for d in split) or (bool(split) and input.ndim < weight.ndim)
            or any(d >= 2 for d in _split_dims(weight)))


def _convolution_weight_grad_overcounted(call: MixedCall) -> bool:
    """torch 2.11: a weight or bias gradient will be asked for, and the input is not split along its batch on the
    first mesh dim alone, where 2.11's DTensor labels the weight and bias gradients ``Partial`` whatever the
    layout (repros/torch_conv_weight_grad_partial.py)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    input, weight = call.args[:2]
    bias = call.args[2] if len(call.args) > 2 else None
    if not torch.is_grad_enabled() or not any(getattr(t, "requires_grad", False) for t in (weight, bias)):
        return False
    if not isinstance(input, DTensor) or input.ndim != weight.ndim:
        return True
    first, *rest = input.placements
    return not (isinstance(first, Shard) and first.dim % input.ndim == 0
                and all(isinstance(p, Replicate) for p in rest))


def _scatter_dims(call: MixedCall) -> Any:
    """(self, the scatter dim normalized, index, src) of a ``scatter_add(self, dim, index, src)`` call."""
    self, dim, index, src = call.args[:4]
    return self, dim % max(self.ndim, 1), index, src


def _scatter_in_place_not_local(call: MixedCall) -> bool:
    """``scatter_add_`` into a split tensor runs right only where DTensor's local strategy applies: every split
    dim ``d`` is not the scatter dim and ``self``, the index and ``src`` have one size on it. Otherwise it
    fails with a shape error or writes a local-shaped result."""
    self, dim, index, src = _scatter_dims(call)
    split = _split_dims(self)
    if not split:
        return False
    if self.ndim != index.ndim or src.ndim != index.ndim:
        return True
    return any(d == dim or not (self.shape[d] == index.shape[d] == src.shape[d]) for d in split)


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


def _writes_a_plain_tensor(call: MixedCall) -> bool:
    """The op writes into a plain operand: the engine then runs it on whole values (every DTensor Replicate),
    which is right whatever DTensor's in-place strategy would do."""
    return any(operand.written for operand in call.plain)


def _batch_norm_split(call: MixedCall, training: bool = True) -> bool:
    """A training batch norm whose input is split along its channel dim, or whose weight, bias or running
    statistics (one value per channel) are split, unless it writes only plain running statistics (it then runs
    on whole values)."""
    if not training:
        return False
    input, *parameters = call.args[:5]
    if not (1 in _split_dims(input) or any(_split_dims(p) for p in parameters)):
        return False
    writes_split_dtensor = any(operand.written and not operand.is_plain and _split_dims(operand.tensor)
                               for operand in call.operands)
    return writes_split_dtensor or not _writes_a_plain_tensor(call)


def _index_along_split_dim(call: MixedCall) -> bool:
    """``index_add_`` / ``index_copy_`` (self, dim, index, source) into a tensor split along ``dim``."""
    self, dim = call.args[:2]
    return not _writes_a_plain_tensor(call) and dim % max(self.ndim, 1) in _split_dims(self)


_REDISTRIBUTE = ("redistribute the DTensor operands to Replicate first (x.redistribute(x.device_mesh, "
                 "[Replicate()] * x.device_mesh.ndim)), or run this op on plain tensors.")
_BATCH_NORM = ("DTensor's batch norm with its input split along the channel dim, or its weight, bias or running "
               "statistics split, updates the running statistics wrongly",
               "Split the batch (dim 0) rather than the channels, and keep the weight, bias and running statistics "
               "Replicate (or plain).")

# Mixed calls on which torch 2.13's DTensor itself returns wrong numbers or fails obscurely (measured with
# every operand a DTensor: tools/op_sweep.py): refused with a clear error rather than promoted into a
# silently wrong result. Each entry: op -> (condition on the call, what goes wrong, what to do instead).
# The conditions are as narrow as the measured fault: calls outside them are promoted. (Writes into a plain
# tensor run on whole values, and ops DTensor gets wrong that can be computed right another way run that
# way: the engine's corrections.)
KNOWN_WRONG_IN_DTENSOR = {
    "aten::convolution": (
        _convolution_split_wrongly,
        "DTensor's convolution of an input split on a channel or spatial dim, or of a weight split on a kernel "
        "dim, returns a wrong shape and values",
        "Split the input along the batch (dim 0) and the weight along its output channels (dim 0) at most, or "
        + _REDISTRIBUTE),
    "aten::addmv_": (
        lambda call: not _writes_a_plain_tensor(call),
        "DTensor's in-place addmv_ into a DTensor fails with a shape error or garbles the write (a row-split "
        "matrix or a split vector on a 1-D mesh; a column-split one on a 2-D mesh)",
        "Call the out-of-place addmv (x = torch.addmv(x, matrix, vector)), or " + _REDISTRIBUTE),
    "aten::_batch_norm_with_update": (_batch_norm_split, *_BATCH_NORM),
    "aten::native_batch_norm": (lambda call: _batch_norm_split(call, bool(call.args[5])), *_BATCH_NORM),
    "aten::_native_batch_norm_legit": (
        lambda call: len(call.args) > 5 and _batch_norm_split(call, bool(call.args[5])), *_BATCH_NORM),
    "aten::scatter_add_": (
        lambda call: not _writes_a_plain_tensor(call) and (
            _scatter_in_place_not_local(call) or _scatter_src_misaligned(call)),
        "DTensor's scatter_add_ into a split tensor is right only where each rank can scatter its own piece "
        "(split along a dim other than the scatter dim, with the index and src of the tensor's size on it); "
        "otherwise it fails with a shape error or writes a wrong result",
        "Call the out-of-place scatter_add (x = x.scatter_add(dim, index, src)), which DTensor computes right "
        "here, or redistribute x to Replicate first."),
    "aten::index_add_": (
        _index_along_split_dim,
        "DTensor's index_add_ into a tensor split along the indexed dim writes a local-shaped or wrong result",
        "Call the out-of-place index_add (x = x.index_add(dim, index, source)), or redistribute x to Replicate "
        "first."),
    "aten::index_copy_": (
        _index_along_split_dim,
        "DTensor's index_copy_ into a tensor split along the indexed dim writes a local-shaped or wrong result",
        "Call the out-of-place index_copy (x = x.index_copy(dim, index, source)), or redistribute x to Replicate "
        "first."),
}


KNOWN_WRONG_ON_RELEASES_WITH = {
    # op: (the upstream defect (_upstream.DEFECTS), condition, what is wrong, what to do)
    "aten::convolution": (
        "conv_weight_grad_partial",
        _convolution_weight_grad_overcounted,
        "torch 2.11's DTensor labels a convolution's weight and bias gradients Partial (summed over the ranks of "
        "the first mesh dim) whatever the input's layout, so with an input that is not split along its batch on "
        "that mesh dim alone they come out multiplied by the ranks that computed the same values",
        "Upgrade to torch 2.12 or later; or split the input along its batch (dim 0) on the first mesh dim and "
        "replicate it on the others (x.redistribute(mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))); or run "
        "the convolution on plain tensors (x.full_tensor(), weight.full_tensor())."),
    "aten::scatter_add": (
        "scatter_add_src_misaligned",
        _scatter_src_misaligned,
        "DTensor's scatter_add whose src is larger than the index along a dim the tensor is split on "
        "scatters the wrong src rows",
        "Narrow src to the index's shape first (scatter_add reads no more of it: "
        "src[tuple(slice(0, n) for n in index.shape)]), or " + _REDISTRIBUTE),
}
"""Calls DTensor computes wrongly, each shown by a repro of the upstream-defect table: refused on the releases that
have the defect (``refuse_known_wrong``)."""


def refuse_known_wrong(call: MixedCall) -> Optional[str]:
    """Raise for calls DTensor computes wrongly; otherwise leave the decision to the default (None)."""
    from .._torch.versions import has_defect, running_torch_version
    from .errors import promotion_error

    name = packet_name(call.op)
    refusals = []
    if name in KNOWN_WRONG_IN_DTENSOR:
        condition, what, advice = KNOWN_WRONG_IN_DTENSOR[name]
        refusals.append((condition, f"{what} (torch 2.13, measured by the op sweep)", advice))
    if name in KNOWN_WRONG_ON_RELEASES_WITH:
        defect, condition, what, advice = KNOWN_WRONG_ON_RELEASES_WITH[name]
        if has_defect(defect, running_torch_version()):
            refusals.append((condition, what, advice))
    for condition, what, advice in refusals:
        if condition(call):
            operand = call.plain[0] if call.plain else None
            raise promotion_error(
                op_key(call.op), f"{what}; promoting the plain operand would hide that",
                operand_label=operand.label if operand else None, operand=operand.tensor if operand else None,
                peers=call.peers, advice=advice, rule_advice=False,
            )
    return None


def refuse_known_wrong_else_parameters_whole(call: MixedCall) -> Any:
    """For an op in both tables: refuse where DTensor is wrong, else parameter-like operands replicate."""
    refuse_known_wrong(call)
    return parameters_are_whole(call)


@hookimpl
def register_rules(register: Callable[[Any, Any], Any]) -> None:
    refused = set(KNOWN_WRONG_IN_DTENSOR) | set(KNOWN_WRONG_ON_RELEASES_WITH)
    for op in sorted(set(PARAMETER_OPS) | refused):
        if op in refused:
            rule = refuse_known_wrong_else_parameters_whole if op in PARAMETER_OPS else refuse_known_wrong
        else:
            rule = parameters_are_whole
        try:
            register(op, rule)
        except UnknownOperatorError:  # an op this torch build does not have
            log.debug("built-in pack: %s does not exist in this torch; skipped", op)

"""Ops DTensor computes wrongly, or cannot compute, after a promotion: run by an exact formulation instead.

A promotion hands the op to DTensor's own sharding strategy. For a few ops that strategy gives a
wrong number with every operand a DTensor too, and promoting the plain operand would turn torch's
mixed-operand error into that wrong number; for others it has no strategy at all for the promoted
layout. Where an exact formulation exists (on DTensor's correct ops, or on this rank's local pieces
where the layout makes the op local), the promoted call runs it instead; ops without one are
refused (the built-in rule pack's ``KNOWN_WRONG_IN_DTENSOR``). Calls torch accepts unpatched never
come here.

- ``nll_loss_forward`` / ``nll_loss2d_forward`` with ``reduction="mean"`` over an input split along a
  non-class dim: DTensor averages each rank's own mean (``Partial("avg")``), which is the global mean
  only when every rank's denominator is the same. With class weights or an ``ignore_index`` that some
  targets hit, the denominators differ (pytorch/pytorch#185167; torch 2.11 to 2.13, fixed in 2.14:
  ``repros/torch_nll_loss_weighted_mean.py``).
  Computed here as the summed loss over the summed weight, as one process does; ``total_weight`` is
  returned as DTensor's mean strategy returns it (summed over the ranks), so the backward, which DTensor
  computes right from it, is unchanged.
- The elementwise losses' mean (``mse_loss``, ``huber_loss``, ``smooth_l1_loss``, ``soft_margin_loss``,
  ``binary_cross_entropy``, ``binary_cross_entropy_with_logits``) over an input split across ranks: DTensor's
  forward averages each rank's own mean (wrong for uneven shards), and its backward divides by each rank's own
  element count (a gradient n times too large on n even shards; ``repros/torch_mse_loss_mean_backward.py``).
  Computed as the sum over the global element count, forward and backward, as one process does.
- In-place ``_foreach_*`` ops into ``Partial`` DTensors on torch 2.11, which drops those writes:
  ``foreach_partial.py``.
- ``stack`` with a negative ``dim`` on torch 2.11, whose DTensor normalizes it against the inputs' rank and
  labels an input split at or after it split one dim further (a wrong global shape;
  ``repros/torch_stack_negative_dim.py``): run with the dim made non-negative, the same op.
- ``index_put_`` on torch 2.11, whose DTensor has no strategy for it (``index_put`` has one;
  ``repros/torch_index_put_inplace.py``): ``index_put``, its value then written into ``self`` in place.
- ``index_put`` into a ``self`` split along a dim the indices index on torch 2.11, whose DTensor keeps the split
  and writes global indices into each rank's piece (``repros/torch_index_put_split_self.py``): ``self`` replicated
  along those mesh dims for the call, the result split back as ``self`` was.
- ``binary_cross_entropy_with_logits``, ``index_add`` and ``index_copy`` (each in place too) on torch 2.11, whose
  DTensor has no strategy for them (``repros/torch_no_decomposition_strategy.py``): the loss by its elementwise
  formula (the one torch's decomposition uses, with ``-logsigmoid(x)`` as ``relu(-x) + log1p(exp(-|x|))``), every op
  of it one DTensor has; the index ops on each rank's whole local values (operands replicated first where they are
  not; 2.11 runs the out-of-place ones on split pieces).
- CPU ``scaled_dot_product_attention`` with a mask that needs no gradient
  (``_scaled_dot_product_flash_attention_for_cpu`` and its backward) on torch 2.11, whose DTensor has no strategy
  for it (``repros/torch_sdpa_cpu_no_strategy.py``): where queries, keys and values are split alike along batch or
  head dims, each rank attends over its own heads with its piece of the mask, as one process does per head.
- ``index.Tensor`` / ``index_put`` with a boolean mask (``x[mask]``, ``x[:, mask]``, and the ``index_put``
  its backward makes): DTensor has no strategy for a mask (the result's size depends on the data).
  The promoted mask is the same whole tensor on every rank, so where ``x`` is not split along a dim
  the mask indexes, each rank indexes its own piece and the pieces form the result, split as ``x``
  is along the dims the mask leaves. Other layouts go to DTensor, which refuses them.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from .._torch.versions import has_defect, running_torch_version
from . import foreach_partial
from .construct import wrap
from .attention_corrections import cpu_attention_backward_on_local_heads, cpu_attention_on_local_heads
from .specs import contiguous_stride
from .write_back import write_into

_MEAN = 1  # torch's Reduction enum: 0 none, 1 mean, 2 sum
_SUM = 2

Call = Callable[..., Any]


def _split_along_non_class_dim(input: Any) -> bool:
    """Whether a loss input is split over the ranks along a dim other than its class dim (dim 1, or 0 for 1-D)."""
    if not isinstance(input, DTensor):
        return False
    class_dim = 1 if input.ndim >= 2 else 0
    return any(isinstance(p, Shard) and p.dim % max(input.ndim, 1) != class_dim for p in input.placements)


def _nll_loss_mean_over_shards(op: Call) -> Call:
    def nll_loss_forward(*args: Any, **kwargs: Any) -> Any:
        # The dispatcher passes the schema's five arguments by position: (input, target, weight, reduction,
        # ignore_index).
        if kwargs or len(args) != 5 or args[3] != _MEAN or not _split_along_non_class_dim(args[0]):
            return op(*args, **kwargs)
        input, target, weight, _, ignore_index = args
        total, total_weight = op(input, target, weight, _SUM, ignore_index)
        # Both are summed over the ranks (Partial("sum")); DTensor's div reduces them before dividing.
        return torch.ops.aten.div.Tensor(total, total_weight), total_weight

    return nll_loss_forward


def _split(tensor: Any) -> bool:
    return isinstance(tensor, DTensor) and any(isinstance(p, Shard) for p in tensor.placements)


def _elementwise_mean_as_sum(reduction_at: int, operands: Tuple[int, ...]) -> Callable[[Call], Call]:
    """For an elementwise loss (or its backward) whose ``reduction`` is positional argument ``reduction_at`` and
    whose elementwise operands are ``operands``: mean = sum / the global element count when one is split."""

    def make(op: Call) -> Call:
        def loss(*args: Any, **kwargs: Any) -> Any:
            # torch leaves out trailing arguments equal to their defaults: reduction="mean" is the default
            reduction = args[reduction_at] if len(args) > reduction_at else _MEAN
            if kwargs or reduction != _MEAN or not any(_split(args[i]) for i in operands):
                return op(*args, **kwargs)
            if len(args) <= reduction_at:
                args = args + (None,) * (reduction_at - len(args)) + (_MEAN,)  # the defaults before it are None
            count = math.prod(torch.broadcast_shapes(*(args[i].shape for i in operands)))
            summed = list(args)
            summed[reduction_at] = _SUM
            return torch.ops.aten.div.Scalar(op(*summed), count)

        return loss

    return make


def _mask_layout(tensor: Any, indices: Any) -> Optional[Tuple[int, int, Any]]:
    """(first dim the mask indexes, how many, the mask DTensor) when ``indices`` is Nones and one Replicate
    boolean DTensor mask that indexes no dim ``tensor`` is split along; else None."""
    if not isinstance(tensor, DTensor) or not isinstance(indices, (list, tuple)):
        return None
    masks = [(position, index) for position, index in enumerate(indices) if index is not None]
    if len(masks) != 1:
        return None
    start, mask = masks[0]
    if not isinstance(mask, DTensor) or mask.dtype is not torch.bool or mask.device_mesh != tensor.device_mesh:
        return None
    if not all(isinstance(p, Replicate) for p in mask.placements):
        return None
    width = mask.ndim
    for placement in tensor.placements:
        if isinstance(placement, Shard):
            if start <= placement.dim % tensor.ndim < start + width:
                return None
        elif not isinstance(placement, Replicate):
            return None  # Partial: leave it to DTensor
    return start, width, mask


def _after_mask(placements: Any, ndim: int, start: int, width: int) -> Tuple[Any, ...]:
    """The placements of ``x[mask]`` for ``x``'s: a split dim after the mask's dims moves left by width - 1."""
    result = []
    for placement in placements:
        if isinstance(placement, Shard):
            dim = placement.dim % ndim
            result.append(Shard(dim - width + 1) if dim >= start + width else placement)
        else:
            result.append(placement)
    return tuple(result)


def _index_by_mask(op: Call) -> Call:
    def index(*args: Any, **kwargs: Any) -> Any:
        layout = None if kwargs or len(args) != 2 else _mask_layout(args[0], args[1])
        if layout is None:
            return op(*args, **kwargs)
        tensor, indices = args
        start, width, mask = layout
        local_indices = [None] * start + [mask._local_tensor]
        local = op(tensor._local_tensor, local_indices)
        placements = _after_mask(tensor.placements, tensor.ndim, start, width)
        shape = tuple(tensor.shape[:start]) + (local.shape[start],) + tuple(tensor.shape[start + width:])
        return wrap(local, tensor.device_mesh, placements, shape, contiguous_stride(shape), local.dtype)

    return index


def _put_by_mask(op: Call) -> Call:
    def index_put(*args: Any, **kwargs: Any) -> Any:
        # index_put(self, indices, values, accumulate=False) and _index_put_impl_(..., unsafe)
        layout = None if kwargs or len(args) < 3 else _mask_layout(args[0], args[1])
        if layout is None:
            return op(*args, **kwargs)
        tensor, indices, values, *rest = args
        start, width, mask = layout
        expected = _after_mask(tensor.placements, tensor.ndim, start, width)
        if values.ndim == 0 or (values.ndim == 1 and values.shape[0] == 1):  # one value, broadcast
            local_values = values._local_tensor if isinstance(values, DTensor) else values
            if isinstance(values, DTensor) and not all(isinstance(p, Replicate) for p in values.placements):
                return op(*args, **kwargs)
        elif (not isinstance(values, DTensor) or values.device_mesh != tensor.device_mesh
              or tuple(values.placements) != expected or values.ndim != tensor.ndim - width + 1):
            return op(*args, **kwargs)
        else:
            local_values = values._local_tensor
        local_indices = [None] * start + [mask._local_tensor]
        local = op(tensor._local_tensor, local_indices, local_values, *rest)
        if local is tensor._local_tensor:
            return tensor  # in place
        return wrap(local, tensor.device_mesh, tensor.placements, tuple(tensor.shape), tuple(tensor.stride()),
                    local.dtype)

    return index_put


def _stack_with_a_non_negative_dim(op: Call) -> Call:
    def stack(*args: Any, **kwargs: Any) -> Any:
        # stack(tensors, dim=0): a negative dim counts from the end of the output, one dim longer than the inputs
        if kwargs or len(args) != 2 or not isinstance(args[1], int) or args[1] >= 0 or not args[0]:
            return op(*args, **kwargs)
        tensors, dim = args
        return op(tensors, dim + tensors[0].dim() + 1)

    return stack


def _not_equal_as_not_eq(op: Call) -> Call:
    """``ne.Tensor`` as ``logical_not(eq.Tensor)``: the same values; torch 2.11's DTensor has no strategy for
    ``ne.Tensor`` (its ``eq.Tensor`` has one)."""

    def not_equal(*args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) != 2:
            return op(*args, **kwargs)
        return torch.ops.aten.logical_not.default(torch.ops.aten.eq.Tensor(*args))

    return not_equal


def _index_put_on_a_replicated_self(op: Call) -> Call:
    """``index_put`` with ``self`` replicated along the mesh dims that split a dim the indices index, and split
    ``values`` replicated, then the result split back as ``self`` was: torch 2.11's DTensor keeps such a split of
    ``self`` (or splits ``self`` to follow split values) and indexes each piece with the global indices."""

    def index_put(*args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) < 3 or not isinstance(args[0], DTensor) or not isinstance(args[1], (list, tuple)):
            return op(*args, **kwargs)
        tensor, indices, values, *rest = args
        indexed = len(indices)
        placements = tuple(tensor.placements)
        whole = tuple(Replicate() if isinstance(p, Shard) and p.dim % tensor.ndim < indexed else p
                      for p in placements)
        split_values = isinstance(values, DTensor) and any(isinstance(p, Shard) for p in values.placements)
        if whole == placements and not split_values:
            return op(*args, **kwargs)
        mesh = tensor.device_mesh
        if split_values:  # 2.11 would split self to follow them, along the indexed dims too
            values = values.redistribute(mesh, [Replicate()] * mesh.ndim)
        result = op(tensor.redistribute(mesh, whole), indices, values, *rest)
        return result.redistribute(mesh, placements)

    return index_put


def _index_put_correcting_a_split_self(op: Call) -> Call:
    """``index_put`` on torch 2.11: a boolean mask's local form first (as on every release), then a split self
    replicated for the call."""
    return _put_by_mask(_index_put_on_a_replicated_self(op))


def _index_put_in_place_on_2_11(op: Call) -> Call:
    """``index_put_`` / ``_index_put_impl_`` on torch 2.11: a boolean mask's local form first, then ``index_put``
    (itself corrected for a split self) written back into ``self``."""
    out_of_place = _index_put_on_a_replicated_self(torch.ops.aten.index_put.default)

    def index_put_(*args: Any, **kwargs: Any) -> Any:
        # index_put_(self, indices, values, accumulate=False) and _index_put_impl_(..., accumulate, unsafe)
        if kwargs or not 3 <= len(args) <= 5 or not isinstance(args[0], DTensor):
            return op(*args, **kwargs)
        write_into(args[0], out_of_place(*args[:4]))
        return args[0]

    return _put_by_mask(index_put_)


def _softplus_of_negative(x: Any) -> Any:
    """``-logsigmoid(x)`` = ``relu(-x) + log1p(exp(-|x|))``, from ops DTensor has a strategy for on every release."""
    aten = torch.ops.aten
    negative = aten.neg.default(x)
    return aten.add.Tensor(aten.clamp_min.default(negative, 0),
                           aten.log1p.default(aten.exp.default(aten.neg.default(aten.abs.default(x)))))


def _binary_cross_entropy_with_logits_by_formula(op: Call) -> Call:
    """``binary_cross_entropy_with_logits`` of DTensors by its elementwise formula, for a torch whose DTensor has no
    strategy for it (2.11); the mean over split operands then as everywhere (``_elementwise_mean_as_sum``)."""
    aten = torch.ops.aten

    def loss(*args: Any, **kwargs: Any) -> Any:
        # (self, target, weight=None, pos_weight=None, reduction=mean)
        if kwargs or not 2 <= len(args) <= 5 or not any(isinstance(a, DTensor) for a in args[:4]):
            return op(*args, **kwargs)
        # torch leaves out trailing arguments equal to their defaults
        input, target, weight, pos_weight, reduction = tuple(args) + (None, None, _MEAN)[len(args) - 2:]
        negative_log_sigmoid = _softplus_of_negative(input)
        if pos_weight is not None:
            # log_weight = (pos_weight - 1) * target + 1
            log_weight = aten.add.Tensor(aten.mul.Tensor(aten.sub.Tensor(pos_weight, 1), target), 1)
            negative_log_sigmoid = aten.mul.Tensor(log_weight, negative_log_sigmoid)
        elementwise = aten.add.Tensor(aten.mul.Tensor(aten.rsub.Scalar(target, 1), input), negative_log_sigmoid)
        if weight is not None:
            elementwise = aten.mul.Tensor(elementwise, weight)
        if reduction == _SUM:
            return aten.sum.default(elementwise)
        if reduction == _MEAN:
            return aten.mean.default(elementwise)
        return elementwise

    return _elementwise_mean_as_sum(4, (0, 1))(loss)


def _index_op_on_whole_operands(op: Call) -> Call:
    """``index_add`` / ``index_copy`` (out of place or in place) of DTensors on one mesh as each rank's whole local
    values: the operands replicated first where they are not, the result laid out as ``self`` was (torch 2.11's
    DTensor has no strategy for the in-place ops and runs the out-of-place ones on split pieces)."""

    def index_op(*args: Any, **kwargs: Any) -> Any:
        # index_add(self, dim, index, source, *, alpha=1), index_copy(self, dim, index, source): every tensor
        # operand a DTensor after the promotion
        if len(args) != 4 or set(kwargs) - {"alpha"}:
            return op(*args, **kwargs)
        tensor, dim, index, source = args
        if not all(isinstance(t, DTensor) and t.device_mesh == tensor.device_mesh for t in (tensor, index, source)):
            return op(*args, **kwargs)
        mesh = tensor.device_mesh
        whole = (Replicate(),) * mesh.ndim

        def replicated(t: Any) -> Any:
            return t if all(isinstance(p, Replicate) for p in t.placements) else t.redistribute(mesh, whole)

        own, index, source = replicated(tensor), replicated(index), replicated(source)
        local = op(own._local_tensor, dim, index._local_tensor, source._local_tensor, **kwargs)
        if local is own._local_tensor:  # in place
            if own is not tensor:
                write_into(tensor, own)
            return tensor
        result = wrap(local, mesh, whole, tuple(tensor.shape), tuple(local.stride()), local.dtype)
        return result if own is tensor else result.redistribute(mesh, tensor.placements)

    return index_op


_ELEMENTWISE_MEAN = "mse_loss_mean_backward"
"""The defect behind every elementwise loss's mean correction (its repro shows it with ``mse_loss``)."""

_CORRECTIONS: Dict[str, Tuple[str, Callable[[Call], Call]]] = {
    # op: (the upstream defect (_upstream.DEFECTS) it works around, the correction)
    # (self, target, reduction, ...) and their backward (grad_output, self, target, reduction, ...)
    "aten::mse_loss.default": (_ELEMENTWISE_MEAN, _elementwise_mean_as_sum(2, (0, 1))),
    "aten::mse_loss_backward.default": (_ELEMENTWISE_MEAN, _elementwise_mean_as_sum(3, (1, 2))),
    "aten::huber_loss.default": (_ELEMENTWISE_MEAN, _elementwise_mean_as_sum(2, (0, 1))),
    "aten::huber_loss_backward.default": (_ELEMENTWISE_MEAN, _elementwise_mean_as_sum(3, (1, 2))),
    "aten::smooth_l1_loss.default": (_ELEMENTWISE_MEAN, _elementwise_mean_as_sum(2, (0, 1))),
    "aten::smooth_l1_loss_backward.default": (_ELEMENTWISE_MEAN, _elementwise_mean_as_sum(3, (1, 2))),
    "aten::soft_margin_loss.default": (_ELEMENTWISE_MEAN, _elementwise_mean_as_sum(2, (0, 1))),
    "aten::soft_margin_loss_backward.default": (_ELEMENTWISE_MEAN, _elementwise_mean_as_sum(3, (1, 2))),
    # (self, target, weight, reduction) and (grad_output, self, target, weight, reduction)
    "aten::binary_cross_entropy.default": (_ELEMENTWISE_MEAN, _elementwise_mean_as_sum(3, (0, 1))),
    "aten::binary_cross_entropy_backward.default": (_ELEMENTWISE_MEAN, _elementwise_mean_as_sum(4, (1, 2))),
    # (self, target, weight, pos_weight, reduction)
    "aten::binary_cross_entropy_with_logits.default": (_ELEMENTWISE_MEAN, _elementwise_mean_as_sum(4, (0, 1))),
    "aten::index.Tensor": ("boolean_mask_index", _index_by_mask),
    "aten::index_put.default": ("boolean_mask_index", _put_by_mask),
    "aten::index_put_.default": ("boolean_mask_index", _put_by_mask),
    "aten::_index_put_impl_.default": ("boolean_mask_index", _put_by_mask),
    "aten::nll_loss_forward.default": ("nll_loss_weighted_mean", _nll_loss_mean_over_shards),
    "aten::nll_loss2d_forward.default": ("nll_loss_weighted_mean", _nll_loss_mean_over_shards),
}
"""Corrections installed on the torch releases that have the defect they work around (``_upstream.DEFECTS`` says
which)."""


_ON_RELEASES_WITH: Dict[str, Tuple[str, Callable[[Call], Call]]] = {
    # op: (the upstream defect (_upstream.DEFECTS) that calls for it, the correction)
    "aten::stack.default": ("stack_negative_dim_misplaced", _stack_with_a_non_negative_dim),
    # a boolean mask's local form first, as on every release
    "aten::index_put_.default": ("index_put_inplace_without_strategy", _index_put_in_place_on_2_11),
    "aten::index_put.default": ("index_put_split_self_misplaced", _index_put_correcting_a_split_self),
    "aten::_index_put_impl_.default": ("index_put_split_self_misplaced", _index_put_in_place_on_2_11),
    "aten::binary_cross_entropy_with_logits.default": ("no_strategy_from_decomposition",
                                                       _binary_cross_entropy_with_logits_by_formula),
    "aten::index_add.default": ("no_strategy_from_decomposition", _index_op_on_whole_operands),
    "aten::index_add_.default": ("no_strategy_from_decomposition", _index_op_on_whole_operands),
    "aten::index_copy.default": ("no_strategy_from_decomposition", _index_op_on_whole_operands),
    "aten::index_copy_.default": ("no_strategy_from_decomposition", _index_op_on_whole_operands),
    "aten::ne.Tensor": ("ne_tensor_without_strategy", _not_equal_as_not_eq),
    "aten::_scaled_dot_product_flash_attention_for_cpu.default": ("sdpa_cpu_without_strategy",
                                                                  cpu_attention_on_local_heads),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward.default": ("sdpa_cpu_without_strategy",
                                                                           cpu_attention_backward_on_local_heads),
}
"""Corrections of torch 2.11's defects, tried before the general ones (:data:`_CORRECTIONS`) for the same op."""


def corrected(name: str, call: Call) -> Optional[Call]:
    """The correcting replacement of ``call`` (the op ``name``, e.g. ``aten::nll_loss_forward.default``), or None:
    installed only where the running torch has the defect it works around (the upstream-defect table decides)."""
    version = running_torch_version()
    for table in (_ON_RELEASES_WITH, _CORRECTIONS):
        entry = table.get(name)
        if entry is not None and has_defect(entry[0], version):
            return entry[1](call)
    return foreach_partial.corrected(name, call)  # only on the releases that need it

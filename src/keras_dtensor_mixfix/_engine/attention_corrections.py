"""CPU attention on each rank's own heads: the correction of torch 2.11's missing strategy for
``_scaled_dot_product_flash_attention_for_cpu`` and its backward (``repros/torch_sdpa_cpu_no_strategy.py``), which
CPU ``scaled_dot_product_attention`` runs for a mask that needs no gradient. Installed by ``corrections.py`` from the
upstream-defect table (``sdpa_cpu_without_strategy``) on the releases that have the defect."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from .construct import wrap
from .specs import local_slice, stride_in_order_of

Call = Callable[..., Any]

__all__ = ["cpu_attention_backward_on_local_heads", "cpu_attention_on_local_heads"]


def _heads_layout(operands: Any) -> Optional[Tuple[Any, ...]]:
    """The placements shared by the attention operands (DTensors of one mesh, one shape but the last two dims)
    when every split is along a batch or head dim (before the last two): each rank's attention is then its own
    pieces'; else None."""
    first = operands[0]
    if not all(isinstance(t, DTensor) and t.device_mesh == first.device_mesh and t.ndim == first.ndim
               and tuple(t.placements) == tuple(first.placements) and t.shape[:-2] == first.shape[:-2]
               for t in operands):
        return None
    for placement in first.placements:
        if isinstance(placement, Shard):
            if placement.dim % first.ndim >= first.ndim - 2:
                return None  # rows or features split: not local
        elif not isinstance(placement, Replicate):
            return None  # Partial: leave it to DTensor
    return tuple(first.placements)


def _local_mask(mask: Any, query: Any, placements: Tuple[Any, ...]) -> Any:
    """This rank's piece of an attention mask that broadcasts against ``query`` (split with ``placements``): None
    stays None; a mask with the wanted layout (split as ``query`` along its non-broadcast batch and head dims) gives
    its local tensor, a replicated one its slice; any other layout: ``NotImplemented``."""
    if mask is None:
        return None
    if not isinstance(mask, DTensor) or mask.device_mesh != query.device_mesh or mask.ndim > query.ndim:
        return NotImplemented
    offset = query.ndim - mask.ndim  # the mask's dims line up with the query's last ones
    wanted = []
    for placement in placements:
        dim = placement.dim % query.ndim - offset if isinstance(placement, Shard) else -1
        wanted.append(Shard(dim) if dim >= 0 and mask.shape[dim] != 1 else Replicate())
    if tuple(mask.placements) == tuple(wanted):
        return mask._local_tensor
    if not all(isinstance(p, Replicate) for p in mask.placements):
        return NotImplemented
    index = local_slice(tuple(mask.shape), mask.device_mesh, tuple(wanted))
    return NotImplemented if index is None else mask._local_tensor[index]


def _as_split(local: torch.Tensor, like: Any, placements: Tuple[Any, ...], shape: Sequence[int]) -> Any:
    """``local`` as this rank's piece of a DTensor of ``shape`` on ``like``'s mesh, split with ``placements``."""
    return wrap(local, like.device_mesh, placements, tuple(shape), stride_in_order_of(local, shape), local.dtype)


def cpu_attention_on_local_heads(op: Call) -> Call:
    """``_scaled_dot_product_flash_attention_for_cpu`` (CPU ``scaled_dot_product_attention`` with a mask that needs
    no gradient) of queries, keys and values split alike along batch or head dims: each rank attends over its own
    heads, its piece of the mask with them; the output and logsumexp split as the queries are. Other calls (dropout,
    a split along rows or features, layouts that differ) go to DTensor, which has no strategy for the op on torch
    2.11 (``repros/torch_sdpa_cpu_no_strategy.py``)."""

    def attention(*args: Any, **kwargs: Any) -> Any:
        # (query, key, value, dropout_p=0., is_causal=False, *, attn_mask=None, scale=None)
        if not 3 <= len(args) <= 5 or set(kwargs) - {"attn_mask", "scale"} or (len(args) > 3 and args[3] != 0):
            return op(*args, **kwargs)
        query, key, value = args[:3]
        placements = _heads_layout((query, key, value))
        mask = None if placements is None else _local_mask(kwargs.get("attn_mask"), query, placements)
        if placements is None or mask is NotImplemented:
            return op(*args, **kwargs)
        local_kwargs = dict(kwargs, attn_mask=mask) if "attn_mask" in kwargs else kwargs
        output, logsumexp = op(query._local_tensor, key._local_tensor, value._local_tensor, *args[3:], **local_kwargs)
        shape = tuple(query.shape[:-1]) + (value.shape[-1],)
        return (_as_split(output, query, placements, shape),
                _as_split(logsumexp, query, placements, tuple(query.shape[:-1])))

    return attention


def cpu_attention_backward_on_local_heads(op: Call) -> Call:
    """``_scaled_dot_product_flash_attention_for_cpu_backward`` on each rank's own heads, as the forward
    (:func:`cpu_attention_on_local_heads`) ran: the output gradient laid out as the queries first; the gradients
    split as the queries, keys and values are."""

    def attention_backward(*args: Any, **kwargs: Any) -> Any:
        # (grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None)
        if len(args) != 8 or set(kwargs) - {"attn_mask", "scale"} or args[6] != 0:
            return op(*args, **kwargs)
        grad_out, query, key, value, out, logsumexp = args[:6]
        placements = _heads_layout((query, key, value, out))
        if (placements is None or not isinstance(grad_out, DTensor) or not isinstance(logsumexp, DTensor)
                or tuple(logsumexp.placements) != placements or grad_out.shape != out.shape):
            return op(*args, **kwargs)
        mask = _local_mask(kwargs.get("attn_mask"), query, placements)
        if mask is NotImplemented:
            return op(*args, **kwargs)
        if tuple(grad_out.placements) != placements:
            grad_out = grad_out.redistribute(grad_out.device_mesh, placements)
        local_kwargs = dict(kwargs, attn_mask=mask) if "attn_mask" in kwargs else kwargs
        grads = op(grad_out._local_tensor, query._local_tensor, key._local_tensor, value._local_tensor,
                   out._local_tensor, logsumexp._local_tensor, *args[6:], **local_kwargs)
        return tuple(_as_split(grad, like, placements, tuple(like.shape))
                     for grad, like in zip(grads, (query, key, value)))

    return attention_backward

"""Give plain tensors that were promoted below autograd a plain ``.grad``.

Promotion happens below autograd, so autograd recorded the plain tensor as the input and
the backward formula hands it a DTensor gradient. A tensor hook converts that gradient
back to what single-process code would see: the whole gradient for a ``"replicate"``
operand, this rank's piece for a ``"local"`` one.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from .._rules.decisions import LOCAL, REPLICATE
from .._rules.errors import promotion_error
from .context import is_active as _is_active
from .._torch.api import is_traced

_ATTR = "_keras_dtensor_mixfix_grad_hook"

class PlainGradHook:
    """Tensor hook: DTensor gradient in, plain gradient out (only while patched)."""

    __slots__ = ("kind", "placements", "op")

    def __init__(self, kind: str, placements: Tuple[Placement, ...], op: str) -> None:
        self.kind = kind
        self.placements = placements
        self.op = op

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if not isinstance(grad, DTensor) or not _is_active():
            return grad
        if self.kind == REPLICATE:
            return grad.full_tensor()
        return grad.redistribute(grad.device_mesh, self.placements).to_local()


def ensure_plain_grad(tensor: torch.Tensor, kind: str, placements: Tuple[Placement, ...], op: str) -> None:
    """Attach (once per tensor) the hook that makes ``tensor.grad`` plain."""
    if not tensor.requires_grad or is_traced(tensor):
        return
    existing = getattr(tensor, _ATTR, None)
    if existing is None:
        hook = PlainGradHook(kind, placements if kind == LOCAL else (), op)
        tensor.register_hook(hook)
        setattr(tensor, _ATTR, hook)
        return
    if existing.kind != kind or (kind == LOCAL and existing.placements != placements):
        raise promotion_error(
            op,
            f"this plain tensor (requires_grad) was already promoted as {existing.kind!r} "
            f"{existing.placements or ''} by {existing.op}; promoting it as {kind!r} {placements} too would make its "
            "gradient ambiguous",
            operand_label="(tensor requiring grad)",
            operand=tensor,
            advice="Use one rule for every op this tensor meets.",
        )

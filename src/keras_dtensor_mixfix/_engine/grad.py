"""Give plain tensors that were promoted below autograd a plain ``.grad``.

Promotion happens below autograd, so autograd recorded the plain tensor as the input and
the backward formula hands it a DTensor gradient. A tensor hook converts that gradient
back to what single-process code would see: the whole gradient for a ``"replicate"``
operand, this rank's piece for a ``"local"`` one.

The hook and its mark (an attribute naming the hook, read per call to attach it once) are ours on a
user's tensor: :func:`remove_plain_grad_hooks` takes both off every tensor still alive, and
``unpatch()`` calls it. A tensor promoted again under a later ``patch()`` gets a new hook.
"""

from __future__ import annotations

import threading
from typing import Tuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement
from torch.utils.weak import WeakIdKeyDictionary

from .._rules.decisions import LOCAL, REPLICATE
from .._rules.errors import promotion_error
from .context import is_active as _is_active
from .._torch.api import is_traced

_ATTR = "_keras_dtensor_mixfix_grad_hook"

# tensor -> the handle of the hook we registered on it; weak, by identity (a tensor's == is elementwise), so that
# unpatch() can reach every hooked tensor still alive without keeping one alive. Written once per tensor.
_hooked: WeakIdKeyDictionary = WeakIdKeyDictionary()
_hooked_lock = threading.Lock()


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
        handle = tensor.register_hook(hook)
        setattr(tensor, _ATTR, hook)
        with _hooked_lock:
            _hooked[tensor] = handle
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


def remove_plain_grad_hooks() -> int:
    """Take our hook and its mark off every tensor still alive that has them; returns how many.

    Called by ``unpatch()`` (while patched the hooks must stay: a rule change keeps them). A backward over a graph
    recorded while patched but run after ``unpatch()`` hands such a tensor the DTensor gradient, as the hook itself
    would have done (it converts only while patched). A promotion racing ``unpatch()`` on another thread may leave a
    hook behind, inert for the same reason.
    """
    with _hooked_lock:
        hooked = list(_hooked.items())
        _hooked.clear()
    for tensor, handle in hooked:
        handle.remove()  # the handle removes the hook from the tensor's own hook dict, which autograd reads per call
        if isinstance(getattr(tensor, _ATTR, None), PlainGradHook):
            delattr(tensor, _ATTR)
    return len(hooked)

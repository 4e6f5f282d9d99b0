"""Activations whose gradient DTensor lays out unlike torch's kernel: their incoming gradient is made contiguous.

For ``softplus`` and ``elu`` (so Keras' ``selu`` and ``celu``), torch's meta functions give the backward's output
the layout of the forward input (contiguous) while the CPU kernel gives it the layout of the incoming gradient.
DTensor declares the meta function's strides over a piece laid out as the kernel wrote it, so when the gradient
arrives transposed (the activation's output is permuted later, as in Qwen3.5's gated delta net), a later
``reshape`` of that gradient takes the view path and raises "view size is not compatible" -- with no mixed operand,
under DataParallel too (torch 2.12-2.15: ``repros/torch_activation_backward_strides.py``).

So the gradient arriving at such an activation of a DTensor is made contiguous first (a copy only where it is
not): the kernel then writes the layout DTensor declares. Values are unchanged; plain tensors are not touched.
(``hardtanh``, ``hardsigmoid`` and ``hardswish`` -- Keras' ``relu6``, ``hard_tanh``, ``hard_sigmoid``, ``hard_silu``
-- share the layout disagreement, but DTensor has no strategy for their backward at all, so they are left alone.)
"""

from __future__ import annotations

import functools
from typing import Any, Tuple

from ..._lifecycle.recorder import PatchRecorder
from ..boundary import keras_modules
from ..boundary.defects import running_release_has
from ..boundary.overrides import Override
from ..boundary.patches import rebind_everywhere

#: Keras' torch-backend activations whose backward is one of the aten ops with the layout disagreement.
AFFECTED = ("softplus", "elu", "selu", "celu")


def _contiguous_gradients(patches: PatchRecorder) -> None:
    nn = keras_modules.backend_nn()
    for name in AFFECTED:
        original = getattr(nn, name)
        rebind_everywhere(patches, original, _with_contiguous_gradient(original))


OVERRIDE = Override(
    name="activations", attributes=AFFECTED,
    description="ops: softplus, elu, selu and celu of a DTensor take their gradient contiguous (the layout DTensor "
                "declares for theirs)",
    apply=_contiguous_gradients,
    needed=lambda: running_release_has("activation_backward_strides"),
    kept="ops: softplus, elu, selu and celu as Keras has them (this torch declares their gradient's layout right)")


def _with_contiguous_gradient(original: Any) -> Any:
    @functools.wraps(original)
    def activation(x: Any, *args: Any, **kwargs: Any) -> Any:
        import torch
        from torch.distributed.tensor import DTensor

        result = original(x, *args, **kwargs)
        # the activation's backward node is hooked, not the tensor: a model may change the result in place, which a
        # wrapping autograd function would forbid
        if not torch.compiler.is_compiling() and isinstance(result, DTensor) and result.grad_fn is not None:
            result.grad_fn.register_prehook(_contiguous)
        return result

    return activation


def _contiguous(gradients: Tuple[Any, ...]) -> Any:
    """The incoming gradient laid out contiguously (None where it already is)."""
    if gradients[0] is None or gradients[0].is_contiguous():
        return None
    return (gradients[0].contiguous(),) + tuple(gradients[1:])

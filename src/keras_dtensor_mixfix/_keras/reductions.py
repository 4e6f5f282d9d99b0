"""Where a model-sharded Keras step reduces partial sums: at layer outputs, and once per gradient.

DTensor chooses each op's sharding by itself, op by op, by the cheapest communication for that op
alone. A row-sharded kernel's matmul leaves a ``Partial`` result; the next op then finds it
cheaper to all-gather its (small) kernel than to reduce the activation, so partial sums travel on
through the model, every later kernel is gathered in every step, and the gradients come out
``Partial`` too, to be reduced again by each optimizer kernel that reads them (Adam: three times).
That is what made a 2-rank Gemma step send ~110 collectives where the single-process math needs a
handful (measured: ``benchmarks/keras_model_step.py``).

Under a Keras distribution whose variables this package makes (Keras 3.15.1), two rules bring it
to what tensor-parallel training does by design (and what XLA's partitioner finds for JAX):

- a layer's output is never left ``Partial``: it is reduced to ``Replicate`` on those mesh dims,
  and the gradient arriving at a layer's output is reduced the same way in backward (the gradient
  of a value read by column-sharded kernels is a partial sum over their shards);
- a parameter's gradient is laid out like the parameter as soon as it is accumulated, so the
  optimizer meets matching placements and reduces nothing (a hook that
  ``_keras_distribution_lib.distribute_variable`` registers on each parameter it makes).

Both keep every value (a redistribution never changes the global tensor), and act only on
DTensors under a distribution: a program without one runs exactly as before.
"""

from __future__ import annotations

import functools
from typing import Any

from . import keras_modules
from .patches import Patches


_boundary: Any = None  # the autograd Function, made at install (torch is imported lazily here)


def install(patches: Patches) -> None:
    global _boundary
    from keras.src.layers.layer import Layer

    _boundary = _boundary_function()

    original_call = Layer.__call__

    @functools.wraps(original_call)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        outputs = original_call(self, *args, **kwargs)
        if keras_modules.distribution() is None:
            return outputs
        from keras.src import tree

        return tree.map_structure(settle_partial_sums, outputs)

    patches.set(Layer, "__call__", __call__)


def settle_partial_sums(value: Any) -> Any:
    """``value`` with no ``Partial`` placement in forward, nor in the gradient it receives."""
    from torch.distributed.tensor import DTensor

    import torch

    if not isinstance(value, DTensor):
        return value
    if value.requires_grad and torch.is_grad_enabled():
        # a nested layer's output is settled already (grad_fn cannot be read while compiling;
        # a second boundary there only costs a node)
        if not torch.compiler.is_compiling() and type(value.grad_fn).__name__ == _boundary.backward_node_name:
            return value
        return _boundary.apply(value)
    return _reduced(value)


def _reduced(value: Any) -> Any:
    """``value`` with its ``Partial`` mesh dims made ``Replicate`` (one all-reduce), else itself."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.placement_types import Partial

    placements = value.placements
    if not any(isinstance(p, Partial) for p in placements):
        return value
    wanted = [Replicate() if isinstance(p, Partial) else p for p in placements]
    return value.redistribute(value.device_mesh, wanted)


def _boundary_function() -> Any:
    import torch

    class LayerOutputBoundary(torch.autograd.Function):
        """Identity on values; ``Partial`` reduced in forward (the output) and backward (its gradient)."""

        backward_node_name = "LayerOutputBoundaryBackward"

        @staticmethod
        def forward(ctx: Any, value: Any) -> Any:
            reduced = _reduced(value)
            return reduced.view_as(reduced) if reduced is value else reduced

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            from torch.distributed.tensor import DTensor

            return _reduced(grad) if isinstance(grad, DTensor) else grad

    return LayerOutputBoundary

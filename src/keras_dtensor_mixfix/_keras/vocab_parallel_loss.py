"""Sparse categorical cross-entropy over logits split along the class axis, without gathering them.

A causal LM whose output embedding is split over the vocabulary (keras_hub's Gemma layout map puts
``token_embedding/embeddings`` on the "model" axis, and Gemma ties the output projection to it)
produces logits that are DTensors split on the class axis. Keras' torch
``sparse_categorical_crossentropy`` calls ``F.cross_entropy``, whose DTensor strategy gathers the
whole class axis first: at batch 8, 128 tokens and 8,000 classes that is a 16 MB all-gather per step
on each rank, and every rank then runs the softmax over every class (issue 21).

Here each rank works on its own classes (what Megatron's vocabulary-parallel cross-entropy does, and
GSPMD derives on JAX): the largest logit of each row (an all-reduce of one number per row), the sum
of ``exp(logit - max)`` and the target's logit where this rank holds the target class (one all-reduce
of two numbers per row); the loss is ``log(sum) + max - target logit``. The backward needs no
communication: the gradient on this rank's classes is ``softmax - one_hot(target)``, computed from
this rank's logits and the global ``log(sum) + max`` saved in the forward.

Only what this handles goes here: logits from ``from_logits=True``, a DTensor whose class axis is
split over exactly one mesh dim, every other mesh dim replicated or splitting another axis, in eager
mode. Everything else (plain tensors: bit for bit; ``from_logits=False``; partial sums; a class axis
split over two mesh dims; torch.compile tracing) goes to Keras' own function. ``ignore_class`` is
handled by ``keras.losses`` before the backend function is called, so it comes through here.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Tuple

from . import keras_modules
from .patches import Patches, rebind_everywhere


def install(patches: Patches) -> None:
    nn = keras_modules.backend_nn()
    original = nn.sparse_categorical_crossentropy
    rebind_everywhere(patches, original, _vocab_parallel(original))


def _vocab_parallel(original: Any) -> Any:
    @functools.wraps(original)
    def sparse_categorical_crossentropy(target: Any, output: Any, from_logits: bool = False, axis: int = -1) -> Any:
        plan = _plan(target, output, from_logits, axis) if from_logits else None
        if plan is None:
            return original(target, output, from_logits=from_logits, axis=axis)
        return vocab_parallel_cross_entropy(target, output, *plan)

    return sparse_categorical_crossentropy


def _plan(target: Any, output: Any, from_logits: bool, axis: int) -> Optional[Tuple[int, int]]:
    """``(class dim, mesh dim splitting it)`` when this module handles the call, else None."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(output, DTensor) or output.ndim < 2 or not hasattr(target, "shape"):
        return None
    import torch

    if torch.compiler.is_compiling() or not output.dtype.is_floating_point:
        return None
    class_dim = axis % output.ndim
    split = [mesh_dim for mesh_dim, p in enumerate(output.placements) if isinstance(p, Shard) and p.dim == class_dim]
    if len(split) != 1:
        return None
    if not all(isinstance(p, (Shard, Replicate)) for p in output.placements):
        return None  # a partial sum: Keras' path reduces it first
    rows = list(output.shape)
    del rows[class_dim]
    target_shape = list(target.shape)
    if len(target_shape) == output.ndim and target_shape[class_dim] == 1:
        del target_shape[class_dim]
    if target_shape != rows:
        return None  # Keras' own function raises its shape error
    return class_dim, split[0]


def vocab_parallel_cross_entropy(target: Any, logits: Any, class_dim: int, vocab_mesh_dim: int) -> Any:
    """Per-row ``logsumexp(logits) - logits[target]`` for class-split DTensor ``logits``; a DTensor
    replicated on ``vocab_mesh_dim`` and split like ``logits``' rows on the other mesh dims."""
    import torch
    from torch.distributed.tensor import Replicate, Shard

    from .._keras_distribution_lib import TorchLayout, _relayout

    mesh = logits.device_mesh
    row_placements = tuple(
        Replicate() if mesh_dim == vocab_mesh_dim
        else Shard(p.dim - (p.dim > class_dim)) if isinstance(p, Shard) else p
        for mesh_dim, p in enumerate(logits.placements))
    target = keras_modules.core().convert_to_tensor(target, dtype="int64")
    if target.ndim == logits.ndim:
        target = target.squeeze(class_dim)
    target = _relayout(target, TorchLayout(mesh, row_placements))  # this rank's rows, no gradient
    local_target = target.to_local() if hasattr(target, "to_local") else target
    return _function().apply(logits, local_target.to(torch.int64), class_dim, vocab_mesh_dim, row_placements)


@functools.lru_cache(maxsize=None)  # one class, made on first use: torch is imported lazily here
def _function() -> Any:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from .._keras_distribution_lib import TorchLayout, _relayout
    from .._torch.api import compute_local_shape_and_global_offset

    class VocabParallelCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, logits: Any, target: Any, class_dim: int, vocab_mesh_dim: int,
                    row_placements: tuple) -> Any:
            mesh = logits.device_mesh
            group = mesh.get_group(vocab_mesh_dim)
            _, offsets = compute_local_shape_and_global_offset(logits.shape, mesh, logits.placements)
            local = logits.to_local()
            # half precisions: the exponentials and their sum in float32, as F.cross_entropy accumulates
            work = local.float() if local.dtype in (torch.float16, torch.bfloat16) else local
            work = work.movedim(class_dim, -1)
            classes = work.shape[-1]
            if classes:
                row_max = work.detach().amax(dim=-1)
            else:  # an empty trailing shard (uneven split): contributes nothing
                row_max = work.new_full(work.shape[:-1], float("-inf"))
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            shifted = work - row_max.unsqueeze(-1)
            own = target - offsets[class_dim]
            held = (own >= 0) & (own < classes)
            index = own.clamp(0, max(classes - 1, 0)).unsqueeze(-1)
            picked = shifted.gather(-1, index).squeeze(-1) if classes else shifted.new_zeros(row_max.shape)
            sums = torch.stack([shifted.exp().sum(dim=-1), torch.where(held, picked, picked.new_zeros(()))])
            dist.all_reduce(sums, group=group)  # one collective for the denominator and the target's logit
            log_sum = sums[0].log()
            ctx.save_for_backward(shifted, log_sum, own, held)
            ctx.meta = (class_dim, local.dtype, mesh, logits.placements, logits.shape, logits.stride(),
                        row_placements)
            loss = (log_sum - sums[1]).to(local.dtype)
            shape = tuple(logits.shape[:class_dim]) + tuple(logits.shape[class_dim + 1:])
            stride = torch.empty(shape, device="meta").stride()
            return DTensor.from_local(loss, mesh, row_placements, run_check=False, shape=torch.Size(shape),
                                      stride=stride)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            shifted, log_sum, own, held = ctx.saved_tensors
            class_dim, dtype, mesh, placements, shape, stride, row_placements = ctx.meta
            # the loss's gradient on this rank's rows (a plain one is the same whole value on every rank)
            grad = _relayout(grad, TorchLayout(mesh, row_placements))
            grad = grad.to_local() if isinstance(grad, DTensor) else grad
            # d loss / d logit_c = softmax_c - [c == target]: this rank's classes only, no collective
            local_grad = (shifted - log_sum.unsqueeze(-1)).exp()
            if local_grad.shape[-1]:
                index = own.clamp(0, local_grad.shape[-1] - 1).unsqueeze(-1)
                local_grad.scatter_add_(-1, index, -held.to(local_grad.dtype).unsqueeze(-1))
            local_grad = (local_grad * grad.to(local_grad.dtype).unsqueeze(-1)).movedim(-1, class_dim).to(dtype)
            return (DTensor.from_local(local_grad, mesh, placements, run_check=False, shape=shape, stride=stride),
                    None, None, None, None)

    return VocabParallelCrossEntropy

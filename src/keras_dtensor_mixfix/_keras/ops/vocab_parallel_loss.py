"""Sparse categorical cross-entropy over logits split along the class axis, without gathering them.

A causal LM whose output embedding is split over the vocabulary (keras_hub's Gemma layout map puts
``token_embedding/embeddings`` on the "model" axis, and Gemma ties the output projection to it)
produces logits that are DTensors split on the class axis. Keras' torch
``sparse_categorical_crossentropy`` calls ``F.cross_entropy``, whose DTensor strategy gathers the
whole class axis first: at batch 8, 128 tokens and 8,000 classes that is a 16 MB all-gather per step
on each rank, and every rank then runs the softmax over every class.

Here each rank works on its own classes (what Megatron's vocabulary-parallel cross-entropy does, and
GSPMD derives on JAX): the largest logit of each row (an all-reduce of one number per row), the sum
of ``exp(logit - max)`` and the target's logit where this rank holds the target class (one all-reduce
of two numbers per row); the loss is ``log(sum) + max - target logit``. The backward needs no
communication: the gradient on this rank's classes is ``softmax - one_hot(target)``, computed from
this rank's logits and the global ``log(sum) + max`` saved in the forward.

Only what this handles goes here: logits from ``from_logits=True``, a DTensor whose class axis is
split over exactly one mesh dim, every other mesh dim replicated or splitting another axis, eager or
while torch.compile traces. Everything else (plain tensors: bit for bit; ``from_logits=False``;
partial sums; a class axis split over two mesh dims) goes to Keras' own function. ``ignore_class`` is
handled by ``keras.losses`` before the backend function is called, so it comes through here.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Tuple

from ..._lifecycle.recorder import PatchRecorder
from ..backend.local_pieces import first_index_here, from_pieces, piece, reduced
from ..boundary import keras_modules
from ..boundary.overrides import Override
from ..boundary.patches import rebind_everywhere


def _vocab_parallel_loss(patches: PatchRecorder) -> None:
    nn = keras_modules.backend_nn()
    original = nn.sparse_categorical_crossentropy
    rebind_everywhere(patches, original, _vocab_parallel(original, keras_modules.core().convert_to_tensor))


OVERRIDE = Override(
    name="vocab-parallel loss", attributes=("sparse_categorical_crossentropy",),
    description="ops: sparse categorical cross-entropy over class-split logits never gathers them",
    apply=_vocab_parallel_loss)


def _vocab_parallel(original: Any, convert_to_tensor: Any) -> Any:
    # convert_to_tensor is looked up at install, not in the call: TorchDynamo cannot trace the module lookup
    @functools.wraps(original)
    def sparse_categorical_crossentropy(target: Any, output: Any, from_logits: bool = False, axis: int = -1) -> Any:
        plan = _plan(target, output, from_logits, axis) if from_logits else None
        if plan is None:
            return original(target, output, from_logits=from_logits, axis=axis)
        target = convert_to_tensor(target, dtype="int64")
        return vocab_parallel_cross_entropy(target, output, *plan)

    return sparse_categorical_crossentropy


def _plan(target: Any, output: Any, from_logits: bool, axis: int) -> Optional[Tuple[int, int]]:
    """``(class dim, mesh dim splitting it)`` when this module handles the call, else None."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(output, DTensor) or output.ndim < 2 or not hasattr(target, "shape"):
        return None
    if not output.dtype.is_floating_point:
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
    """Per-row ``logsumexp(logits) - logits[target]`` for class-split DTensor ``logits`` (``target`` a
    tensor of class indices, plain or a DTensor); a DTensor
    replicated on ``vocab_mesh_dim`` and split like ``logits``' rows on the other mesh dims.

    Written with :mod:`..backend.local_pieces` (DTensor's differentiable ``to_local``/``from_local``/``redistribute``)
    around local ops, so autograd derives the backward (local: the reduced sums come back whole on every rank, and
    DTensor keeps a replicated gradient replicated where it meets a partial sum) and TorchDynamo
    traces it (the two reductions become functional all-reduces in the compiled graph).
    """
    import torch
    from torch.distributed.tensor import Replicate, Shard

    from ..._torch.api import compute_local_shape_and_global_offset

    mesh = logits.device_mesh
    row_placements = tuple(
        Replicate() if mesh_dim == vocab_mesh_dim
        else Shard(p.dim - (p.dim > class_dim)) if isinstance(p, Shard) else p
        for mesh_dim, p in enumerate(logits.placements))
    row_shape = tuple(logits.shape[:class_dim]) + tuple(logits.shape[class_dim + 1:])
    if target.ndim == logits.ndim:
        target = target.squeeze(class_dim)
    own = piece(target, mesh, row_placements).to(torch.int64)  # this rank's rows, no gradient
    if type(logits.placements[vocab_mesh_dim]) is Shard:
        first_class = first_index_here(logits.shape[class_dim], mesh, vocab_mesh_dim)
    else:  # a strided shard: torch's reading (a graph break when compiled)
        first_class = compute_local_shape_and_global_offset(logits.shape, mesh, logits.placements)[1][class_dim]
    own = own - first_class  # the target's index among this rank's classes, if it holds it

    def reduced_over_classes(local: Any, reduce_op: str) -> Any:
        """``local`` (this rank's rows, a value per row and trailing dims) reduced over the class pieces."""
        return reduced(local, mesh, vocab_mesh_dim, reduce_op, row_placements,
                       row_shape + tuple(local.shape[len(row_shape):]))

    local = piece(logits, mesh, logits.placements)
    # half precisions: the exponentials and their sum in float32, as F.cross_entropy accumulates
    work = local.float() if local.dtype in (torch.float16, torch.bfloat16) else local
    work = work.movedim(class_dim, -1)
    classes = work.shape[-1]
    if classes:
        row_max = work.detach().amax(dim=-1)
    else:  # an empty trailing shard (uneven split): contributes nothing
        row_max = work.new_full(work.shape[:-1], float("-inf")).detach()
    row_max = reduced_over_classes(row_max, "max")  # a constant shift: no gradient through it
    shifted = work - row_max.unsqueeze(-1)
    held = (own >= 0) & (own < classes)
    if classes:
        picked = shifted.gather(-1, own.clamp(0, classes - 1).unsqueeze(-1)).squeeze(-1)
    else:
        picked = shifted.new_zeros(row_max.shape)
    # one collective for the denominator and the target's logit
    sums = reduced_over_classes(torch.stack([shifted.exp().sum(dim=-1), torch.where(held, picked, 0.0)], dim=-1),
                                "sum")
    loss = (sums[..., 0].log() - sums[..., 1]).to(local.dtype)
    return from_pieces(loss, mesh, row_placements, row_shape)

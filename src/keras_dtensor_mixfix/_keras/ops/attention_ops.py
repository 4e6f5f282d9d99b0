"""Keras' ``dot_product_attention`` of DTensors, run on each rank's batch rows and heads.

DTensor has no strategy for CPU's ``_scaled_dot_product_flash_attention_for_cpu`` and derives one through its
decomposition, which on a 2-D mesh runs a long search for each new shape and then finds none (Keras 3.15.1).
Keras 3.16 runs attention on local tensors itself, but takes every operand's local piece as if it had the query's
placements: a whole mask meeting batch-split queries (keras_hub's ``generate()`` under ``DataParallel`` or on a
(2, 2) mesh) fails "The size of tensor a (2) must match the size of tensor b (4)". Attention is independent per
batch row and per head, so it runs on this rank's rows and heads (query, key, value and mask or bias taken to the
query's batch/head sharding, everything else replicated) and the result is wrapped with those placements: the same
values, differentiably.
"""

from __future__ import annotations

import functools
from typing import Any, List

from ..._lifecycle.recorder import PatchRecorder
from ..backend.local_pieces import from_pieces, piece
from ..boundary import keras_modules
from ..boundary.overrides import Override
from ..boundary.patches import rebind_everywhere


def _attention_on_local_rows_and_heads(patches: PatchRecorder) -> None:
    nn = keras_modules.backend_nn()
    rebind_everywhere(patches, nn.dot_product_attention, _local_attention(nn.dot_product_attention))


OVERRIDE = Override(
    name="attention", attributes=("dot_product_attention",), description="ops: attention runs on local rows and heads",
    apply=_attention_on_local_rows_and_heads)


BATCH, HEADS = 0, 2  # dims of Keras' (batch, length, heads, depth) attention operands


def _local_attention(original: Any) -> Any:
    import inspect

    parameters = list(inspect.signature(original).parameters)
    # where Keras takes flash_attention among the arguments after query, key, value, bias and mask
    flash_position = parameters.index("flash_attention") - 5 if "flash_attention" in parameters else None

    @functools.wraps(original)
    def dot_product_attention(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None,
                              *args: Any, **kwargs: Any) -> Any:
        import torch
        from torch.distributed.tensor import DTensor

        peer = next((t for t in (query, key, value) if isinstance(t, DTensor)), None)
        if peer is None or not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
            return original(query, key, value, bias, mask, *args, **kwargs)
        mesh = peer.device_mesh
        placements = _attention_placements(query, key, value, peer)
        local = [_local_piece(t, mesh, placements, {BATCH: BATCH, HEADS: HEADS}, 4) for t in (query, key, value)]
        # mask and bias are in SDPA's (batch, heads, query length, key length) order
        extra = [None if t is None else _local_piece(t, mesh, placements, {BATCH: 0, HEADS: 1}, 4)
                 for t in (bias, mask)]
        if flash_position is not None and torch.compiler.is_compiling() and local[0].device.type != "cuda":
            args, kwargs = _flash_attention_off(args, kwargs, flash_position)
        out = original(*local, extra[0], extra[1], *args, **kwargs)
        return from_pieces(out, mesh, placements, (query.shape[0], query.shape[1], query.shape[2], value.shape[3]))

    return dot_product_attention


def _flash_attention_off(args: tuple, kwargs: dict, position: int) -> tuple:
    """``args``/``kwargs`` with ``flash_attention=False`` where the caller left it to Keras (None).

    Keras then asks torch whether flash attention can run, through ``SDPAParams``, a C++ class
    TorchDynamo cannot trace: a graph break inside Keras' ``name_scope``, which made TorchDynamo trace
    the model again (keras_hub Llama3 and Qwen compiled). Off CUDA torch always answers no ("All
    tensors need to be on cuda device"), so this is Keras' own decision, made without asking.
    """
    if len(args) > position:
        if args[position] is None:
            args = args[:position] + (False,) + args[position + 1:]
    elif kwargs.get("flash_attention") is None:
        kwargs = dict(kwargs, flash_attention=False)
    return args, kwargs


def _attention_placements(query: Any, key: Any, value: Any, peer: Any) -> tuple:
    """Per mesh dim: the query's sharding of batch rows or heads where key and value can follow it."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    reference = query if isinstance(query, DTensor) else peer
    mesh = reference.device_mesh
    placements = []
    for mesh_dim, placement in enumerate(reference.placements):
        size = mesh.size(mesh_dim)
        keep = isinstance(placement, Shard) and placement.dim in (BATCH, HEADS)
        if keep and placement.dim == HEADS:  # each rank's query heads must meet their key/value heads
            keep = query.shape[HEADS] % size == 0 and all(
                t.shape[HEADS] == 1 or t.shape[HEADS] % size == 0 for t in (key, value))
        placements.append(Shard(placement.dim) if keep else Replicate())
    return tuple(placements)


def _local_piece(tensor: Any, mesh: Any, placements: tuple, dims: dict, full_rank: int) -> Any:
    """This rank's piece of ``tensor`` under ``placements`` (dims mapped through ``dims``; a dim of
    size 1, or one the tensor lacks, broadcasts and stays whole); differentiable."""
    import torch
    from torch.distributed.tensor import Replicate, Shard

    if not isinstance(tensor, torch.Tensor):
        return tensor
    missing = full_rank - tensor.ndim
    own: List[Any] = []
    for placement in placements:
        if isinstance(placement, Shard):
            dim = dims[placement.dim] - missing
            if dim >= 0 and tensor.shape[dim] > 1:
                own.append(Shard(dim))
                continue
        own.append(Replicate())
    return piece(tensor, mesh, own)

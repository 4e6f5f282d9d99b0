"""Keras backend ops that DTensor (torch 2.13) cannot run on sharded values as Keras writes them.

- ``take`` on a table sharded along the looked-up axis (a vocabulary-sharded embedding): DTensor
  returns a ``_MaskPartial`` result, whose mask buffer the first reduction releases, so a second
  consumer of the same result fails with a bare ``AssertionError`` in
  ``_MaskPartial._reduce_shard_value``, without the package too (Llama's and Qwen's
  ``LlamaLayerNorm`` read the embedding twice: ``x * rsqrt(mean(x**2))``). The result is reduced
  at once to what DTensor gives it on first use (``Replicate`` on that mesh dim), differentiably:
  one all-reduce, as before, and any number of consumers.
- ``min``, ``max``, ``amin``, ``amax``, ``all`` and ``any`` over a sharded axis (a batch-sharded
  prompt under ``DataParallel``): DTensor returns a ``Partial`` result, and in torch 2.13 turning
  a ``Partial`` DTensor into a Python number (``item()``, ``int()``, ``bool()``, or indexing with it,
  as ``mask[:, index]`` does) reads this rank's unreduced value, with or without the package.
  keras_hub's ``generate()`` starts at ``index = ops.min(row_lengths)`` and so wrote each rank's
  tokens at its own (wrong) positions. These results are reduced at once (one all-reduce of a
  small result, which the next op that reads it would have needed anyway); ``sum``, ``mean`` and
  ``prod``, whose partial sums DTensor carries on into losses and gradients, are left as they are.
- ``argmax`` and ``argmin`` over a dim split on a 2-D mesh (a sparse categorical accuracy over
  vocabulary-split logits, one batch row per rank): DTensor's handler gathers the pieces and fails
  reshaping them ("shape '[1, 8, 2, 2, 8, 1]' is invalid for input of size 16", torch 2.12-2.13, fixed in 2.15;
  repro: ``repros/torch_argmax_2d.py``). An input split over two or more mesh dims is gathered
  along the reduced dim first (the mesh dims that split it become ``Replicate``); an input split
  over one mesh dim keeps DTensor's own handler, which gathers only each piece's winner.
- ``slice_update`` clones its input and writes into the clone with ``index_put_``; DTensor refuses
  an in-place op whose strategy needs another placement ("in-place operations that require
  placement changes are not supported"), as for a prompt sharded on the batch axis (keras_hub's
  ``generate()``). A sharded input is made ``Replicate`` first, so the write is allowed; values
  are unchanged and the (small) result is replicated.
- ``dot_product_attention``: DTensor has no strategy for CPU's
  ``_scaled_dot_product_flash_attention_for_cpu`` and derives one through its decomposition, which
  on a 2-D mesh took minutes per new shape and then found none (Keras 3.15.1). Keras 3.16 runs
  attention on local tensors itself, but takes every operand's local piece as if it had the
  query's placements: a whole mask meeting batch-split queries (keras_hub's ``generate()`` under
  ``DataParallel`` or on a (2, 2) mesh) failed "The size of tensor a (2) must match the size of
  tensor b (4)". Attention is
  independent per batch row and per head, so it runs on this rank's rows and heads (query, key,
  value and mask or bias taken to the query's batch/head sharding, everything else replicated)
  and the result is wrapped with those placements: the same values, differentiably.
- ``max`` and ``min`` of a DTensor while compiling: Keras 3.12-3.15's break the graph (they read
  ``getattr(result, "values", None)``), which left keras_hub GPT-OSS's row maximum a graph output torch's
  backward fails on; the same reduction runs as ``amax``/``amin`` instead.
- ``one_hot`` while compiling: DTensor has no strategy for the range check torch's ``one_hot`` makes
  when traced (keras_hub's Qwen MoE router); each rank encodes its own piece.
"""

from __future__ import annotations

import functools
from typing import Any

from . import keras_modules
from .._lifecycle.recorder import PatchRecorder
from .local_pieces import first_index_here, from_pieces, gathered, piece
from .patches import rebind_everywhere


def install(patches: PatchRecorder) -> None:
    numpy_module = keras_modules.backend_numpy()
    core = keras_modules.core()
    if not _SETTLE:
        _SETTLE.append(_settle_function())
    rebind_everywhere(patches, numpy_module.take, _settled_take(numpy_module.take, core.convert_to_tensor))
    for name in SETTLED_REDUCTIONS:
        original = getattr(numpy_module, name, None)
        if original is not None:  # Keras 3.16 has no amin/amax of its own: ops.amin is ops.min
            settled = _settled_reduction(original)
            if name in ONE_VALUE_FORM and hasattr(numpy_module, ONE_VALUE_FORM[name]):
                settled = _traceable_extreme(settled, numpy_module, ONE_VALUE_FORM[name])
            rebind_everywhere(patches, original, settled)
    for name in ARG_REDUCTIONS:
        original = getattr(numpy_module, name)
        rebind_everywhere(patches, original, _whole_along_reduced(original))
    rebind_everywhere(patches, core.slice_update, _replicated_slice_update(core.slice_update))
    nn = keras_modules.backend_nn()
    rebind_everywhere(patches, nn.dot_product_attention, _local_attention(nn.dot_product_attention))
    rebind_everywhere(patches, nn.one_hot, _local_one_hot(nn.one_hot))


def _settled_take(original: Any, convert_to_tensor: Any) -> Any:
    # convert_to_tensor is looked up here, not in the call: TorchDynamo cannot trace the module
    # lookup (importlib), and a graph break there, under Keras' name_scope, threw the whole layer
    # call out of the graph
    @functools.wraps(original)
    def take(x: Any, indices: Any, axis: Any = None) -> Any:
        table = whole_where_indices_split(x, indices, convert_to_tensor)
        if axis == 0:
            looked_up = lookup_on_local_vocabulary(table, indices)
            if looked_up is not None:
                return looked_up
        return settle_mask_partial(original(table, indices, axis=axis))

    return take


def whole_where_indices_split(table: Any, indices: Any, convert_to_tensor: Any) -> Any:
    """``table`` gathered (differentiably) on the mesh dims where ``indices`` are split too.

    On a (batch, model) mesh keras_hub's layouts shard an embedding table over both axes (the
    vocabulary on "model", the hidden dim on "batch"), while the token ids are split over "batch".
    DTensor's lookup strategy then gathers the ids on "batch" but builds the ``_MaskPartial`` mask
    from this rank's ids before the gather: the reduction fails with "The shape of the mask [2, 8]
    ... does not match the shape of the indexed tensor [4, 8, 8]" (torch 2.12-2.15, with or without
    the package; repro: ``repros/torch_embedding_mask_2d.py``). The table is taken whole on such a
    mesh dim instead, as fully sharded data parallelism does with a weight: each rank looks up its
    own ids, the result stays split by batch rows, and in backward the table's gradient is reduced
    and scattered back to the table's layout.
    """
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(indices, DTensor):
        return table
    if not isinstance(table, DTensor) and hasattr(table, "value"):  # a Keras Variable
        table = convert_to_tensor(table)
    if not isinstance(table, DTensor) or table.device_mesh != indices.device_mesh:
        return table
    wanted = tuple(Replicate() if not isinstance(own, Replicate) and not isinstance(theirs, Replicate) else own
                   for own, theirs in zip(table.placements, indices.placements))
    if wanted == tuple(table.placements):
        return table
    return table.redistribute(table.device_mesh, wanted)


def lookup_on_local_vocabulary(table: Any, indices: Any) -> Any:
    """While compiling, the rows of a vocabulary-split 2-D ``table`` at ``indices``, looked up on this
    rank's piece; ``None`` where this does not apply (eager, or another layout).

    Eager, DTensor's lookup gives a ``_MaskPartial`` result, which ``SettleMaskPartial`` reduces and
    whose backward reduces a partial-sum gradient first. Traced, that Function's backward does not
    run as written, and DTensor's own redistribution cannot take a ``Partial`` gradient (the lookup
    meeting a head-split projection, keras_hub Gemma) to the masked partial: "Redistribution from
    one partial type ... is unsupported". So no masked partial is made: each rank looks up the ids
    that fall in its piece (zeros elsewhere) and the result is a plain ``Partial`` sum, reduced at
    once as eager reduces it; ``from_local`` takes a ``Partial`` gradient to ``Replicate`` first.
    The same values: every other rank adds exact zeros.
    """
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if not torch.compiler.is_compiling() or not isinstance(table, DTensor) or table.ndim != 2:
        return None
    mesh = table.device_mesh
    vocabulary_dims = [i for i, p in enumerate(table.placements) if type(p) is Shard and p.dim == 0]
    if len(vocabulary_dims) != 1:  # one split of the vocabulary: this rank's rows are one range
        return None
    if isinstance(indices, DTensor):
        if indices.device_mesh != mesh:
            return None
        ids_placements = tuple(indices.placements)
    else:
        ids_placements = (Replicate(),) * mesh.ndim
    local_ids = piece(indices, mesh, ids_placements)
    # the result's placements, and the table gradient's: where the ids are split by rows, each rank's
    # rows add their share of the table's gradient, a partial sum over that mesh dim
    placements, gradient_placements = [], list(table.placements)
    for mesh_dim, (own, theirs) in enumerate(zip(table.placements, ids_placements)):
        if mesh_dim in vocabulary_dims and isinstance(theirs, Replicate):
            placements.append(Partial())
        elif isinstance(own, Replicate) and type(theirs) is Shard:
            placements.append(theirs)
            gradient_placements[mesh_dim] = Partial()
        elif type(own) is Shard and own.dim == 1 and isinstance(theirs, Replicate):
            placements.append(Shard(local_ids.ndim))
        elif isinstance(own, Replicate) and isinstance(theirs, Replicate):
            placements.append(Replicate())
        else:
            return None
    vocabulary = table.shape[0]
    start = first_index_here(vocabulary, mesh, vocabulary_dims[0])
    local_table = piece(table, mesh, table.placements, gradient=gradient_placements)
    local_ids = local_ids.long()
    local_ids = torch.where(local_ids < 0, local_ids + vocabulary, local_ids)  # Keras' take: "fill" mode
    here = (local_ids >= start) & (local_ids < start + local_table.shape[0])
    rows = torch.nn.functional.embedding(torch.where(here, local_ids - start, 0), local_table)
    rows = torch.where(here.unsqueeze(-1), rows, 0)
    looked_up = from_pieces(rows, mesh, placements, (*indices.shape, table.shape[1]))
    settled = [Replicate() if isinstance(p, Partial) else p for p in placements]
    return looked_up.redistribute(mesh, settled)


def settle_mask_partial(value: Any) -> Any:
    """A DTensor with a ``_MaskPartial`` placement, reduced on those mesh dims; anything else as is."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate

    from .._torch.api import is_masked_partial  # imports torch: not at module import

    if not isinstance(value, DTensor):
        return value
    placements = value.placements
    if not any(is_masked_partial(p) for p in placements):
        return value
    settled = [Replicate() if is_masked_partial(p) else p for p in placements]
    if torch.compiler.is_compiling():
        return value.redistribute(value.device_mesh, settled)
    return _SETTLE[0].apply(value, tuple(settled))


# The autograd.Function, made by install() (torch is imported lazily) and read from here while
# tracing: TorchDynamo cannot trace a class definition, and an lru_cache'd factory that made the
# class on first use broke the graph inside Keras' name_scope (the first use is traced)
_SETTLE: list = []


def _settle_function() -> Any:
    import torch
    from torch.distributed.tensor import Replicate

    from .._torch.api import is_masked_partial

    class SettleMaskPartial(torch.autograd.Function):
        """``redistribute`` to ``settled``, whose backward reduces a ``Partial`` gradient first.

        DTensor's own backward of this redistribution takes the gradient to the source's placements
        with ``Replicate`` for a plain ``Partial`` only: a ``Partial`` gradient (a row-sharded
        matmul downstream, when the batch axis is trivial) met ``_MaskPartial`` and failed with
        "Redistribution from one partial type ... is unsupported". The gradient of a sum over ranks
        is the whole gradient on every rank: ``Replicate`` on those mesh dims.
        """

        @staticmethod
        def forward(ctx: Any, value: Any, settled: tuple) -> Any:
            ctx.masked = [is_masked_partial(p) for p in value.placements]
            return value.redistribute(value.device_mesh, settled)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            wanted = [Replicate() if masked else p for masked, p in zip(ctx.masked, grad.placements)]
            if list(grad.placements) != wanted:
                grad = grad.redistribute(grad.device_mesh, wanted)
            return grad, None

    return SettleMaskPartial


SETTLED_REDUCTIONS = ("min", "max", "amin", "amax", "all", "any")


def _settled_reduction(original: Any) -> Any:
    @functools.wraps(original)
    def reduction(*args: Any, **kwargs: Any) -> Any:
        return settle_partial(original(*args, **kwargs))

    return reduction


ONE_VALUE_FORM = {"max": "amax", "min": "amin"}
"""Keras' ``max``/``min`` and the reduction that computes the same, with no ``initial``, on a non-empty tensor."""


def _traceable_extreme(settled: Any, numpy_module: Any, one_value_name: str) -> Any:
    """Keras' ``max``/``min`` of a DTensor, while TorchDynamo traces, as ``amax``/``amin``.

    Keras 3.12 to 3.15's ``max`` and ``min`` read ``getattr(result, "values", None)`` of their result, which
    TorchDynamo cannot type: a graph break in every model that takes a row maximum (keras_hub GPT-OSS's attention
    sinks). Breaking there leaves the maximum an output of the graph before the break, and when no gradient
    reaches it (it is subtracted for stability, without one) torch's backward fails on the plain zero it is given
    (``repros/torch_compile_dtensor_output_without_gradient.py``). ``amax``/``amin`` is the reduction Keras' own
    ``max``/``min`` runs along an axis (over every dim, ``torch.max(x)`` and ``torch.amax(x)`` give the same value
    and both split the gradient evenly among ties), so the value and its gradient are unchanged.
    """
    import torch
    from torch.distributed.tensor import DTensor

    @functools.wraps(settled)
    def extreme(x: Any, axis: Any = None, keepdims: bool = False, initial: Any = None) -> Any:
        if (initial is None and isinstance(x, DTensor) and 0 not in x.shape
                and torch.compiler.is_compiling()):
            return settle_partial(getattr(numpy_module, one_value_name)(x, axis=axis, keepdims=keepdims))
        return settled(x, axis=axis, keepdims=keepdims, initial=initial)

    return extreme


def settle_partial(value: Any) -> Any:
    """A DTensor with ``Partial`` placements, reduced to ``Replicate`` on those mesh dims
    (differentiably); anything else as is."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import Partial

    if not isinstance(value, DTensor) or not any(isinstance(p, Partial) for p in value.placements):
        return value
    return value.redistribute(value.device_mesh,
                              [Replicate() if isinstance(p, Partial) else p for p in value.placements])


ARG_REDUCTIONS = ("argmax", "argmin")


def _whole_along_reduced(original: Any) -> Any:
    largest = original.__name__ == "argmax"

    @functools.wraps(original)
    def reduction(x: Any, axis: Any = None, keepdims: bool = False) -> Any:
        found = winner_across_pieces(x, axis, keepdims, largest)
        if found is not None:
            return found
        return original(whole_along(x, axis), axis, keepdims)

    return reduction


def winner_across_pieces(value: Any, axis: Any, keepdims: bool, largest: bool) -> Any:
    """While compiling, ``argmax`` (``largest``) or ``argmin`` of a floating DTensor along an ``axis`` split by
    a plain ``Shard`` over one mesh dim, as Keras' int32; ``None`` where this does not apply.

    DTensor's own handler finds each piece's winner too, but reads the piece's offset out of a tensor
    (``int(offsets[0])``): a data-dependent graph break, which inside Keras' ``name_scope`` (a metric's
    sparse categorical accuracy over vocabulary-split logits) sends the whole frame back to be traced
    again. Here each rank takes its piece's winner and value, both are gathered over that mesh dim (one
    small all-gather each), and the best piece's index is kept: the first of equal values, as in one
    process, since pieces are in index order (``NaN`` wins, as in torch).
    """
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if (axis is None or not torch.compiler.is_compiling() or not isinstance(value, DTensor)
            or not value.dtype.is_floating_point or value.ndim == 0):
        return None
    axis = axis % value.ndim
    split = [mesh_dim for mesh_dim, p in enumerate(value.placements) if isinstance(p, Shard) and p.dim == axis]
    if (len(split) != 1 or type(value.placements[split[0]]) is not Shard
            or not all(isinstance(p, (Shard, Replicate)) for p in value.placements)):
        return None
    mesh, pieces_dim = value.device_mesh, split[0]
    local = piece(value, mesh, value.placements).detach()
    if local.shape[axis]:
        best, index = (local.max if largest else local.min)(dim=axis, keepdim=True)
    else:  # an empty last piece (uneven split): it never wins
        shape = tuple(1 if dim == axis else size for dim, size in enumerate(local.shape))
        best = local.new_full(shape, float("-inf") if largest else float("inf"))
        index = torch.zeros(shape, dtype=torch.int64, device=local.device)
    index = index + first_index_here(value.shape[axis], mesh, pieces_dim)
    best, index = (gathered(part, mesh, pieces_dim, axis, value.placements, value.shape) for part in (best, index))
    winner = (best.argmax if largest else best.argmin)(dim=axis, keepdim=True)
    found = index.gather(axis, winner)
    if not keepdims:
        found = found.squeeze(axis)
    placements = [Replicate() if mesh_dim == pieces_dim or isinstance(p, Replicate)
                  else Shard(p.dim - (p.dim > axis and not keepdims)) for mesh_dim, p in enumerate(value.placements)]
    shape = torch.Size(1 if dim == axis else size for dim, size in enumerate(value.shape) if keepdims or dim != axis)
    return from_pieces(found.to(torch.int32), mesh, placements, shape)


def whole_along(value: Any, axis: Any) -> Any:
    """A DTensor split over two or more mesh dims, gathered along ``axis`` (every dim when None); anything
    else as is."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(value, DTensor) or sum(isinstance(p, Shard) for p in value.placements) < 2:
        return value
    reduced = set(range(value.ndim)) if axis is None else {axis % max(value.ndim, 1)}
    wanted = tuple(Replicate() if isinstance(p, Shard) and p.dim in reduced else p for p in value.placements)
    if wanted == tuple(value.placements):
        return value
    return value.redistribute(value.device_mesh, wanted)


def _replicated_slice_update(original: Any) -> Any:
    @functools.wraps(original)
    def slice_update(inputs: Any, start_indices: Any, updates: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate

        if isinstance(inputs, DTensor) and any(not isinstance(p, Replicate) for p in inputs.placements):
            inputs = inputs.redistribute(inputs.device_mesh, [Replicate()] * inputs.device_mesh.ndim)
        return original(inputs, start_indices, updates)

    return slice_update


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


def _local_one_hot(original: Any) -> Any:
    """Keras' ``one_hot``; while compiling, of a DTensor's local piece, wrapped with its placements.

    Traced, torch's ``one_hot`` of a DTensor checks its input's range with ``aten._assert_async.msg``,
    which DTensor has no strategy for (``repros/torch_dtensor_one_hot_compiled.py``): a graph break
    inside Keras' ``name_scope`` (keras_hub's Qwen MoE router), and the split graph then returned a
    view of its DTensor input, which AOTAutograd replays with ``as_strided`` ("as_strided not supported
    with DTensor"). Each element is encoded on its own, so the local piece gives this rank's part of the
    result; the new class axis is whole.
    """

    @functools.wraps(original)
    def one_hot(x: Any, num_classes: Any, axis: int = -1, *args: Any, **kwargs: Any) -> Any:
        import torch
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if not (torch.compiler.is_compiling() and isinstance(x, DTensor)
                and all(type(p) is Shard or isinstance(p, Replicate) for p in x.placements)):
            return original(x, num_classes, axis, *args, **kwargs)
        encoded = original(piece(x, x.device_mesh, x.placements), num_classes, axis, *args, **kwargs)
        class_dim = axis % encoded.ndim
        placements = [Shard(p.dim + (p.dim >= class_dim)) if isinstance(p, Shard) else p for p in x.placements]
        shape = torch.Size((*x.shape[:class_dim], encoded.shape[class_dim], *x.shape[class_dim:]))
        return from_pieces(encoded, x.device_mesh, placements, shape)

    return one_hot


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
    own = []
    for placement in placements:
        if isinstance(placement, Shard):
            dim = dims[placement.dim] - missing
            if dim >= 0 and tensor.shape[dim] > 1:
                own.append(Shard(dim))
                continue
        own.append(Replicate())
    return piece(tensor, mesh, own)

"""Keras' ``take`` (an embedding lookup) on a table DTensor shards along the looked-up axis.

DTensor (torch 2.13) returns a ``_MaskPartial`` result for a vocabulary-sharded table, whose mask buffer the
first reduction releases, so a second consumer of the same result fails with a bare ``AssertionError`` in
``_MaskPartial._reduce_shard_value``, without the package too (Llama's and Qwen's ``LlamaLayerNorm`` read the
embedding twice: ``x * rsqrt(mean(x**2))``). The result is reduced at once to what DTensor gives it on first use
(``Replicate`` on that mesh dim), differentiably: one all-reduce, as before, and any number of consumers. Ids
split where the table is split too take the table whole there (:func:`whole_where_indices_split`); while
compiling, a vocabulary-split table is looked up on each rank's rows (:func:`lookup_on_local_vocabulary`).
"""

from __future__ import annotations

import functools
from typing import Any, List, cast

from ..._lifecycle.recorder import PatchRecorder
from ..backend.local_pieces import first_index_here, from_pieces, piece
from ..boundary import keras_modules
from ..boundary.defects import running_release_has
from ..boundary.overrides import Override
from ..boundary.patches import rebind_everywhere


def _settled_lookup(patches: PatchRecorder) -> None:
    numpy_module = keras_modules.backend_numpy()
    core = keras_modules.core()
    if not _SETTLE:
        _SETTLE.append(_settle_function())
    # the table taken whole where the ids are split too: only where torch has the defect the repro shows
    whole_where_split = running_release_has("embedding_mask_2d")
    rebind_everywhere(patches, numpy_module.take,
                      _settled_take(numpy_module.take, core.convert_to_tensor, whole_where_split))


OVERRIDE = Override(
    name="take", attributes=("take",),
    description="ops: take gathers a table split where its ids are and settles masked partials",
    apply=_settled_lookup)


def _settled_take(original: Any, convert_to_tensor: Any, whole_where_split: bool) -> Any:
    # convert_to_tensor is looked up here, not in the call: TorchDynamo cannot trace the module
    # lookup (importlib), and a graph break there, under Keras' name_scope, threw the whole layer
    # call out of the graph
    @functools.wraps(original)
    def take(x: Any, indices: Any, axis: Any = None) -> Any:
        table = whole_where_indices_split(x, indices, convert_to_tensor) if whole_where_split else x
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

    from ..._torch.api import is_exactly  # imports torch: not at module import

    if not torch.compiler.is_compiling() or not isinstance(table, DTensor) or table.ndim != 2:
        return None
    mesh = table.device_mesh
    vocabulary_dims = [i for i, p in enumerate(table.placements) if is_exactly(p, Shard) and cast(Shard, p).dim == 0]
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
    placements: List[Any]
    own: Any  # a Placement; a Shard where is_exactly says so
    placements, gradient_placements = [], list(table.placements)
    for mesh_dim, (own, theirs) in enumerate(zip(table.placements, ids_placements)):
        if mesh_dim in vocabulary_dims and isinstance(theirs, Replicate):
            placements.append(Partial())
        elif isinstance(own, Replicate) and is_exactly(theirs, Shard):
            placements.append(theirs)
            gradient_placements[mesh_dim] = Partial()
        elif is_exactly(own, Shard) and own.dim == 1 and isinstance(theirs, Replicate):
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

    from ..._torch.api import is_masked_partial  # imports torch: not at module import

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
# tracing: TorchDynamo cannot trace a class definition, so the class is not made on first use either
# (the first use may be traced, and defining it there breaks the graph inside Keras' name_scope)
_SETTLE: list = []


def _settle_function() -> Any:
    import torch
    from torch.distributed.tensor import Replicate

    from ..._torch.api import is_masked_partial

    class SettleMaskPartial(torch.autograd.Function):
        """``redistribute`` to ``settled``, whose backward reduces a ``Partial`` gradient first.

        DTensor's own backward of this redistribution takes the gradient to the source's placements
        with ``Replicate`` for a plain ``Partial`` only: a ``Partial`` gradient (a row-sharded
        matmul downstream, when the batch axis is trivial) meets ``_MaskPartial`` and fails with
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

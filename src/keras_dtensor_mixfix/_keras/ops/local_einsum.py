"""``einsum`` on DTensors computed on each rank's own pieces, when their shardings already line up.

torch's ``einsum`` is not one op for DTensor: it decomposes into permutes, reshapes and ``bmm``.
Reshaping a head-sharded attention operand merges heads into the batch dim, which DTensor can
only describe as a strided shard; its sharding propagation then searches redistribution graphs
(a slow search, repeated for each new shape) and may pick a plan that gathers. Yet an einsum whose
operands are sharded along the same label needs no communication at all: each rank contracts its own
pieces. Per mesh dim, the result is

- ``Replicate`` when every operand is replicated;
- ``Shard`` of the output dim of label ``L`` when every operand that has ``L`` is sharded along it
  (and the others are replicated), or ``Partial`` (sum) when ``L`` is contracted away;
- ``Partial`` (sum) when exactly one operand is a partial sum and the others are replicated
  (einsum is linear in each operand).

Where operands are sharded along different labels on one mesh dim (on a (batch, model) mesh,
keras_hub's layouts split a kernel's input dim over "batch" while the activations' batch rows are
split over it too), they are first lined up as fully sharded data parallelism does
(``line_up``): the operand sharded along a label the output keeps (the batch rows) keeps its
split, the others are gathered on that mesh dim, and one that has that label whole takes its own
slice of it. DTensor's einsum on such operands either gathers the activations or fails its
sharding propagation ("Cannot unflatten unevenly sharded tensor"). In backward, a gathered
operand's gradient (a partial sum over the batch pieces) is reduced and scattered back to its
layout.

A plain operand beside DTensors (keras_hub's generate reads keys and values from a plain cache) is the same
whole value on every rank: replicated, or sliced where it lines up. Left to DTensor's decomposition, torch 2.11
fails to flatten the head-split operand into ``bmm``'s batch (``repros/torch_view_flatten_split_dim.py``).

Anything else (``...``, a repeated label, a label sharded on several mesh dims,
strided shards, other partial reductions) goes to DTensor as before. The pieces come out and go back
through :mod:`..backend.local_pieces` (``to_local`` and ``from_local``, both differentiable), so backward is local too;
the gradient of an operand that was whole where the work was split is a partial sum
(``gradient_placements``), reduced where it meets the rest of the gradient, as in tensor-parallel
training.

The same path runs while ``torch.compile`` traces (Keras' ``jit_compile``): ``to_local`` and
``from_local`` with explicit shape and stride trace on torch 2.13, and the planning is plain Python
on placements, written so TorchDynamo can follow it (``_exactly``). Left to DTensor, compiled
attention fails sharding propagation of ``aten.bmm`` on a strided shard under fake tensors.
"""

from __future__ import annotations

import functools
from typing import Any, List, Optional, Sequence, Tuple, cast

from ..._lifecycle.recorder import PatchRecorder
from ..backend.local_pieces import from_pieces, piece
from ..boundary import keras_modules
from ..boundary.overrides import Override
from ..boundary.patches import rebind_everywhere


def _einsum_on_local_pieces(patches: PatchRecorder) -> None:
    from ..._torch.versions import has_defect, running_torch_version

    whole_otherwise = has_defect("view_flatten_split_dim", running_torch_version())
    numpy_module = keras_modules.backend_numpy()
    rebind_everywhere(patches, numpy_module.einsum, _sharded_einsum(numpy_module.einsum, whole_otherwise))
    rebind_everywhere(patches, numpy_module.matmul, _sharded_matmul(numpy_module.matmul, whole_otherwise))


OVERRIDE = Override(
    name="local einsum", attributes=("einsum", "matmul"),
    description="ops: einsum and matmul run on local pieces where shardings line up",
    apply=_einsum_on_local_pieces)


def _sharded_einsum(original: Any, whole_otherwise: bool = False) -> Any:
    """Keras' ``einsum`` on local pieces where the shardings line up; elsewhere Keras' own, or, with
    ``whole_otherwise`` (torch 2.11), on the operands' whole values (:func:`on_whole_values`)."""

    @functools.wraps(original)
    def einsum(subscripts: Any, *operands: Any, **kwargs: Any) -> Any:
        local = _local_einsum(original, subscripts, operands, kwargs)
        if local is None and whole_otherwise:
            local = on_whole_values(lambda *whole: original(subscripts, *whole, **kwargs), operands)
        return original(subscripts, *operands, **kwargs) if local is None else local

    return einsum


def on_whole_values(function: Any, operands: Sequence[Any]) -> Any:
    """``function`` of the operands' whole values (every DTensor replicated, its local tensor taken), the result
    wrapped as a replicated DTensor; None where no operand is a DTensor (or they lie on different meshes).

    For torch 2.11, whose DTensor cannot flatten dims into one when a dim after the first is split
    (``repros/torch_view_flatten_split_dim.py``), which its ``einsum`` and ``matmul`` do on their way to ``bmm``: the
    same computation as one process, at the cost of gathering the split operands."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate

    operands = [getattr(o, "value", o) if not isinstance(o, torch.Tensor) else o for o in operands]
    meshes = {o.device_mesh for o in operands if isinstance(o, DTensor)}
    if len(meshes) != 1:
        return None
    (mesh,) = meshes
    whole = (Replicate(),) * mesh.ndim
    local = function(*(piece(o, mesh, whole) if isinstance(o, DTensor) else o for o in operands))
    return from_pieces(local, mesh, whole, local.shape, stride=local.stride())


def _sharded_matmul(original: Any, whole_otherwise: bool = False) -> Any:
    """Keras' ``matmul`` of two DTensors as the einsum it is (:func:`matmul_subscripts`), on local pieces where
    their shardings line up: Keras' own ``matmul`` runs on the pieces. keras_hub's Bloom multiplies head-split
    queries and keys so; left to DTensor, the batched product is reshaped to a strided shard, whose sharding
    propagation fails while compiling ("Sharding propagation failed for aten.bmm.default")."""

    @functools.wraps(original)
    def matmul(x1: Any, x2: Any) -> Any:
        subscripts = matmul_subscripts(getattr(x1, "ndim", 0), getattr(x2, "ndim", 0))
        local = None if subscripts is None else _local_einsum(
            lambda _subscripts, a, b: original(a, b), subscripts, (x1, x2), {})
        if local is None and whole_otherwise:
            local = on_whole_values(original, (x1, x2))
        return original(x1, x2) if local is None else local

    return matmul


def matmul_subscripts(rank1: int, rank2: int) -> Optional[str]:
    """The einsum of ``matmul`` of operands of ``rank1`` and ``rank2`` dims (batch dims broadcast from the right,
    then rows by columns), or None where an operand is a vector (matmul then drops a dim einsum would keep)."""
    if rank1 < 2 or rank2 < 2:
        return None
    batch = "abcdefgh"[:max(rank1, rank2) - 2]
    if len(batch) < max(rank1, rank2) - 2:
        return None
    first = batch[len(batch) - (rank1 - 2):] + "ij"
    second = batch[len(batch) - (rank2 - 2):] + "jk"
    return f"{first},{second}->{batch}ik"


def parse(subscripts: str, count: int) -> Optional[Tuple[List[str], str]]:
    """``(input labels per operand, output labels)``, or None for forms left to DTensor."""
    text = subscripts.replace(" ", "")
    if "." in text:
        return None
    inputs_text, arrow, output = text.partition("->")
    inputs = inputs_text.split(",")
    if len(inputs) != count or not all(label.isalpha() for label in "".join(inputs) + output):
        return None
    if any(len(set(labels)) != len(labels) for labels in inputs) or len(set(output)) != len(output):
        return None  # a repeated label (diagonal, trace)
    if not arrow:
        every = "".join(inputs)
        output = "".join(sorted(label for label in set(every) if every.count(label) == 1))
    return inputs, output


def plan(inputs: Sequence[str], output: str, shapes: Sequence[Sequence[int]],
         placements: Sequence[Sequence[Any]]) -> Optional[Tuple[Any, ...]]:
    """The output placements of an einsum computed on local pieces, or None if it cannot be."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    sizes = label_sizes(inputs, shapes)
    if sizes is None:
        return None
    result: List[Any] = []
    sharded_labels: set = set()
    for mesh_dim in range(len(placements[0])):
        here = [p[mesh_dim] for p in placements]
        if not all(_exactly(p, Replicate, Shard, Partial) for p in here):
            return None  # strided shards, masked partials
        partial = [p for p in here if isinstance(p, Partial)]
        if partial:
            if len(partial) != 1 or partial[0].reduce_op != "sum" or any(
                    not isinstance(p, (Replicate, Partial)) for p in here):
                return None
            result.append(Partial("sum"))
            continue
        labels_sharded = {labels[p.dim] for labels, p in zip(inputs, here) if isinstance(p, Shard)}
        if not labels_sharded:
            result.append(Replicate())
            continue
        if len(labels_sharded) != 1:
            return None
        (label,) = labels_sharded
        if label in sharded_labels or len(sizes[label]) != 1:
            return None  # sharded on several mesh dims, or broadcast against a size-1 dim
        sharded_labels.add(label)
        for labels, p in zip(inputs, here):
            if label in labels and not (isinstance(p, Shard) and labels[p.dim] == label):
                return None
        result.append(Shard(output.index(label)) if label in output else Partial("sum"))
    return tuple(result)


def line_up(inputs: Sequence[str], output: str, placements: Sequence[Sequence[Any]]) -> Optional[List[Tuple[Any, ...]]]:
    """Operand placements under which ``plan`` can work on local pieces, or None when nothing is to line up.

    Per mesh dim whose operands are sharded along different labels: the first operand sharded along
    a label of the output keeps its split; every other operand is gathered there, or, where it has
    that label, takes its own slice of it.
    """
    from torch.distributed.tensor import Replicate, Shard

    lined = [list(p) for p in placements]
    changed = False
    for mesh_dim in range(len(placements[0])):
        here = [p[mesh_dim] for p in placements]
        if not all(_exactly(p, Replicate, Shard) for p in here):
            return None
        sharded = [(index, labels[p.dim]) for index, (labels, p) in enumerate(zip(inputs, here))
                   if isinstance(p, Shard)]
        if len({label for _, label in sharded}) < 2:
            continue
        keeper = next((label for _, label in sharded if label in output), None)
        if keeper is None:
            return None
        for index, labels in enumerate(inputs):
            wanted = Shard(labels.index(keeper)) if keeper in labels else Replicate()
            if lined[index][mesh_dim] != wanted:
                lined[index][mesh_dim] = wanted
                changed = True
    return [tuple(p) for p in lined] if changed else None


def _exactly(placement: Any, *classes: Any) -> bool:
    """Whether ``placement`` is of one of ``classes`` exactly (not a subclass: a strided shard, a masked partial)."""
    from ..._torch.api import is_exactly  # imports torch: not at module import

    return is_exactly(placement, *classes)


def label_sizes(inputs: Sequence[str], shapes: Sequence[Sequence[int]]) -> Optional[dict]:
    """Each label's sizes over the operands (one, or several where a size-1 dim broadcasts), or None
    when an operand's labels do not match its dims."""
    sizes: dict = {}
    for labels, shape in zip(inputs, shapes):
        if len(labels) != len(shape):
            return None
        for label, size in zip(labels, shape):
            sizes.setdefault(label, set()).add(size)
    return sizes


def gradient_placements(operand: Sequence[Any], result: Sequence[Any]) -> Tuple[Any, ...]:
    """Placements of an operand's gradient when the einsum ran on local pieces.

    Where the operand is whole (``Replicate``) but the computation was split along a label it
    lacks (the result is sharded or a partial sum on that mesh dim), each rank's gradient covers
    only its part: a partial sum. A sharded operand's gradient is sharded like it; a partial-sum
    operand's gradient is whole (einsum is linear in it).
    """
    from torch.distributed.tensor import Partial, Replicate

    gradient = []
    for mine, out in zip(operand, result):
        if isinstance(mine, Replicate):
            gradient.append(Replicate() if isinstance(out, Replicate) else Partial("sum"))
        else:
            gradient.append(Replicate() if isinstance(mine, Partial) else mine)
    return tuple(gradient)


def _local_einsum(original: Any, subscripts: Any, operands: Sequence[Any], kwargs: dict) -> Any:
    import torch
    from torch.distributed.tensor import DTensor

    from ..._engine.specs import stride_in_order_of  # imports torch: not at the module's import

    if not operands or not isinstance(subscripts, str):
        return None
    # Keras variables (a layer's kernel) hold their DTensor as ``value``
    operands = [getattr(o, "value", o) if not isinstance(o, torch.Tensor) else o for o in operands]
    dtensors = [o for o in operands if isinstance(o, DTensor)]
    if not dtensors or not all(isinstance(o, torch.Tensor) for o in operands):
        return None
    mesh = dtensors[0].device_mesh
    if any(o.device_mesh != mesh for o in dtensors[1:]):
        return None
    if any(not isinstance(o, DTensor) and o.device.type != mesh.device_type for o in operands):
        return None  # a plain operand on another device: the engine's device rules decide
    if all(o.dtype == torch.int8 for o in operands):
        return None  # Keras casts the result itself; left to its own path
    parsed = parse(subscripts, len(operands))
    if parsed is None:
        return None
    inputs, output = parsed
    shapes = [o.shape for o in operands]
    lined: Sequence[Sequence[Any]] = [
        tuple(o.placements) if isinstance(o, DTensor) else _plain_layout(labels, inputs, operands, mesh.ndim)
        for o, labels in zip(operands, inputs)]
    placements = plan(inputs, output, shapes, lined)
    if placements is None:
        lined_up = line_up(inputs, output, lined)
        placements = None if lined_up is None else plan(inputs, output, shapes, lined_up)
        if placements is None or lined_up is None:
            return None
        lined = lined_up
    pieces = [piece(o, mesh, wanted, gradient=gradient_placements(wanted, placements))
              for o, wanted in zip(operands, lined)]
    local = original(subscripts, *pieces, **kwargs)
    sizes = label_sizes(inputs, shapes)  # not None: plan() checked the labels against the dims
    assert sizes is not None
    shape = torch.Size(max(sizes[label]) for label in output)  # a size-1 dim broadcasts
    # einsum may return a view: the global tensor is laid out in its dim order
    return from_pieces(local, mesh, placements, shape, stride=stride_in_order_of(local, shape))


def _plain_layout(labels: str, inputs: Sequence[str], operands: Sequence[Any], mesh_ndim: int) -> Tuple[Any, ...]:
    """The placements a plain operand with ``labels`` is taken with: on each mesh dim where the DTensor operands are
    split along one label, and the plain one has it, its own slice of it (no communication: the plain operand is the
    same whole value on every rank); replicated elsewhere."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    layout = []
    for mesh_dim in range(mesh_ndim):
        split = {other[cast(Shard, o.placements[mesh_dim]).dim] for other, o in zip(inputs, operands)
                 if isinstance(o, DTensor) and _exactly(o.placements[mesh_dim], Shard)}
        label = next(iter(split)) if len(split) == 1 else None
        layout.append(Shard(labels.index(label)) if label is not None and label in labels else Replicate())
    return tuple(layout)



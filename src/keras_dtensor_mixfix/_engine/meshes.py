"""Operands on another mesh: a DTensor whose value every rank holds whole is, for the op, a plain tensor.

Two meshes over the same ranks are common (transformers' expert parallelism puts the experts on a
second mesh; FSDP2 and tensor parallelism may build their own), and a value computed on one meets a
value computed on the other: ``clip_grad_norm_`` stacks one norm per parameter. DTensor refuses any
op whose operands sit on different meshes. A DTensor on another mesh spanning the same ranks,
``Replicate`` on every mesh dim, carries the same whole value on every rank as a plain tensor does;
a ``Partial`` one does too once reduced over its own mesh (a collective every rank of the op takes
part in, since the ranks are the same). Such an operand is replaced by that whole value and the op
runs again: the value then meets the op's DTensors as any plain operand does (one-element: torch's
own path; larger: the rules). Anything else (a DTensor sharded on the other mesh, or a mesh over
other ranks) is left to torch, which raises its own error naming both meshes.

The op's mesh is the mesh of the first DTensor operand that is sharded, else of the first DTensor.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

from .caches import CACHES, remember
from .operands import dtensors_in
from .whole import whole_value

_SAME_RANKS = CACHES.same_ranks
_EQUAL_MESHES = CACHES.equal_meshes


def one_mesh(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """Whether the call's DTensors, on distinct mesh objects, all sit on one mesh after all (torch makes a new
    object for each submesh lookup). Equal pairs are remembered, so the dispatch rule lets the next call of two
    DTensors on them through at the cost of a dict lookup."""
    meshes: List[Any] = []
    for tensor in dtensors_in(args, kwargs):
        mesh = tensor._spec.mesh
        if not any(mesh is known for known in meshes):
            meshes.append(mesh)
    first = meshes[0]
    for other in meshes[1:]:
        if other != first:
            return False
    for one in meshes:
        for other in meshes:
            if one is not other:
                remember(_EQUAL_MESHES, (id(one), id(other)), (one, other))
    return True


def same_ranks(one: Any, other: Any) -> bool:
    """Whether two device meshes span the same set of global ranks (in any arrangement)."""
    key = (one, other)
    found = _SAME_RANKS.get(key)
    if found is None:
        found = sorted(one.mesh.flatten().tolist()) == sorted(other.mesh.flatten().tolist())
        remember(_SAME_RANKS, key, found)
    return found


def op_mesh(dtensors: List[DTensor]) -> Any:
    """The mesh the op runs on: the first sharded DTensor's, else the first DTensor's."""
    for tensor in dtensors:
        if any(isinstance(p, Shard) for p in tensor.placements):
            return tensor.device_mesh
    return dtensors[0].device_mesh


def as_plain_on_one_mesh(args: Tuple[Any, ...],
                         kwargs: Dict[str, Any]) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
    """The call with every DTensor operand that is not on the op's mesh replaced by its whole value, or None
    when the DTensors sit on one mesh or one of them cannot be replaced (sharded, or other ranks)."""
    dtensors = dtensors_in(args, kwargs)
    if not dtensors:
        return None
    mesh = op_mesh(dtensors)
    values: Dict[int, torch.Tensor] = {}
    for tensor in dtensors:
        other = tensor.device_mesh
        if other is mesh or other == mesh or id(tensor) in values:
            continue
        if not same_ranks(mesh, other):
            return None
        value = whole_value(tensor)
        if value is None:
            return None
        values[id(tensor)] = value
    if not values:
        return None

    def swap(value: Any) -> Any:
        if isinstance(value, DTensor):
            return values.get(id(value), value)
        if type(value) is list or type(value) is tuple:
            items = [values.get(id(item), item) if isinstance(item, DTensor) else item for item in value]
            return items if type(value) is list else tuple(items)
        return value

    return tuple(swap(a) for a in args), {name: swap(v) for name, v in kwargs.items()}

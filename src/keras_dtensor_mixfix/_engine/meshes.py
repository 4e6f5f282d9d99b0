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
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .._torch.api import DTensorSpec, redistribute_local_tensor
from .caches import CACHES, remember
from .operands import dtensors_in

_SAME_RANKS = CACHES.same_ranks


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


def whole_value(tensor: DTensor) -> Optional[torch.Tensor]:
    """The whole value of a DTensor that every rank can have without a gather (Replicate, or Partial reduced
    over its mesh), as a plain tensor; None for a sharded one."""
    placements = tensor.placements
    if all(isinstance(p, Replicate) for p in placements):
        return tensor._local_tensor
    if not all(isinstance(p, (Replicate, Partial)) for p in placements):
        return None
    spec = tensor._spec
    target = DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim, tensor_meta=spec.tensor_meta)
    return redistribute_local_tensor(tensor._local_tensor, spec, target)


def as_plain_on_one_mesh(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
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

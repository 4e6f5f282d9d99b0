"""A DTensor's whole value on every rank: the engine's own collectives, outside the op's.

Two places need it: an op that writes into a plain tensor (the plain tensor is the whole value, so the op
runs on whole values: every DTensor operand made ``Replicate`` first, general.py), and a value on another
mesh taken as a plain tensor (meshes.py). ``Replicate`` costs nothing, ``Partial`` an all-reduce over its
mesh, ``Shard`` an all-gather: the same collectives DTensor's ``redistribute`` makes.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate

from .._torch.api import DTensorSpec, redistribute_local_tensor
from .construct import new_dtensor


def _replicated_spec(tensor: DTensor) -> DTensorSpec:
    spec = tensor._spec
    return DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim, tensor_meta=spec.tensor_meta)


def replicated(tensor: DTensor) -> DTensor:
    """``tensor`` with every mesh dim ``Replicate`` (itself if it already is)."""
    if all(isinstance(p, Replicate) for p in tensor.placements):
        return tensor
    target = _replicated_spec(tensor)
    local = redistribute_local_tensor(tensor._local_tensor, tensor._spec, target)
    return new_dtensor(local, target, eager=type(local) is torch.Tensor)


def whole_value(tensor: DTensor) -> Optional[torch.Tensor]:
    """The whole value of a DTensor that every rank can have without a gather (Replicate, or Partial reduced
    over its mesh), as a plain tensor; None for a sharded one."""
    placements = tensor.placements
    if all(isinstance(p, Replicate) for p in placements):
        return tensor._local_tensor
    if not all(isinstance(p, (Replicate, Partial)) for p in placements):
        return None
    return redistribute_local_tensor(tensor._local_tensor, tensor._spec, _replicated_spec(tensor))

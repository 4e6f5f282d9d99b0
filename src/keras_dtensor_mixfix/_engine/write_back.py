"""Write a value into a tensor in place, as that tensor's own placements hold it: the second half of running an
in-place op as its out-of-place form where a torch release cannot run the in-place one on DTensors.

Runs below autograd (inside the dispatch rule: autograd has already recorded the in-place op with its own
derivative), and communicates only where DTensor's redistribution of the value to the target's layout does.
"""

from __future__ import annotations

from typing import Any, Tuple, cast

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate


def write_into(row: Any, value: Any) -> None:
    """Write ``value`` (a DTensor or a plain tensor of ``row``'s global shape) into the tensor ``row`` in place.

    A DTensor ``row`` keeps its placements: the value is laid out along its ``Shard`` and ``Replicate`` dims by
    DTensor's redistribution, and along each ``Partial`` dim held whole by the ranks at coordinate 0 of that dim
    and as zeros by the others for a ``sum`` (the zeros add nothing: the reduced value is exactly the value), whole
    by every rank for ``max``, ``min`` and ``avg``. A plain ``row`` gets the whole value.
    """
    if not isinstance(row, DTensor):
        row.copy_(value.full_tensor() if isinstance(value, DTensor) else value)
        return
    spec = row._spec
    mesh, placements = spec.mesh, tuple(spec.placements)
    if isinstance(value, DTensor) and value._spec.mesh == mesh and tuple(value._spec.placements) == placements:
        row._local_tensor.copy_(value._local_tensor)
        return
    held = [Replicate() if isinstance(p, Partial) else p for p in placements]
    if not isinstance(value, DTensor):
        value = DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
    local = value.redistribute(mesh, held)._local_tensor
    coordinate = cast(Tuple[int, ...], mesh.get_coordinate())  # this rank holds a piece of row: it is in the mesh
    for dim, placement in enumerate(placements):
        if isinstance(placement, Partial) and placement.reduce_op == "sum" and coordinate[dim] != 0:
            local = torch.zeros_like(local)
            break
    row._local_tensor.copy_(local)

"""Variables' initial values made in pieces under a distribution (Keras 3.12 to 3.15, whose variables we make).

- :func:`distribute_constant_variable`: zeros, ones, a constant: each rank fills its own piece;
- :func:`distribute_drawn_variable`: a position-keyed random draw (:mod:`.initial_values`): each rank draws its own;
- :func:`distribute_variable_from_rank_zero`: any other random value, drawn by rank 0 alone, which sends the pieces
  (:func:`shards_across_processes` says where that is needed, :func:`rank_zero_succeeded` whether rank 0's draw
  worked).

Each returns the ``nn.Parameter`` a variable holds (``step/reductions.py`` hooks each one's gradient layout).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from ..ranks.agreement import from_rank_zero
from .distribution_lib import resolved_layout, this_ranks_device
from .layouts import fit_placements
from .local_pieces import from_pieces


def distribute_constant_variable(shape: Tuple[int, ...], fill: Any, dtype: torch.dtype, layout: Any,
                                 trainable: bool = True) -> torch.nn.Parameter:
    """An ``nn.Parameter`` holding a DTensor of ``shape`` filled with ``fill``, each rank making only its own piece
    (what ``distribute_variable`` gives for ``torch.full(shape, fill)``, with no whole tensor and no collective).
    Not for a layout ``on_one_device``: the variables take Keras' own path there."""
    from torch.distributed.tensor import full as sharded_full

    mesh, placements = resolved_layout(layout)
    placements = fit_placements(tuple(shape), mesh, placements, "variable")
    return torch.nn.Parameter(sharded_full(tuple(shape), fill, dtype=dtype, device_mesh=mesh,
                                           placements=list(placements)), requires_grad=trainable)


def distribute_drawn_variable(draw_piece: Any, shape: Tuple[int, ...], layout: Any,
                              trainable: bool = True) -> Optional[torch.nn.Parameter]:
    """An ``nn.Parameter`` holding a DTensor of ``shape`` with ``layout`` whose pieces each rank draws itself, with no
    collective: ``draw_piece(box)`` gives the values at ``box`` (one slice per dim of ``shape``), the same values for
    the same positions on every rank (a position-keyed draw). None where ``draw_piece`` gives None. Under torch's
    rank simulator each simulated rank draws its own piece. Not for a layout ``on_one_device``."""
    from ..._engine.specs import region
    from ..._torch.api import compute_local_shape_and_global_offset
    from ..._torch.processes import per_simulated_rank

    mesh, placements = resolved_layout(layout)
    placements = fit_placements(tuple(shape), mesh, placements, "variable")
    local_shape, offset = compute_local_shape_and_global_offset(tuple(shape), mesh, placements)
    device = this_ranks_device()

    def drawn(local_shape: Any, offset: Any) -> Optional[torch.Tensor]:
        piece = draw_piece(region(offset, local_shape))
        return None if piece is None else piece.to(device)

    local = per_simulated_rank(drawn)(local_shape, offset)
    if local is None:
        return None
    return torch.nn.Parameter(from_pieces(local, mesh, list(placements), shape), requires_grad=trainable)


def shards_across_processes(shape: Tuple[int, ...], layout: Any) -> bool:
    """Whether ``layout`` splits a tensor of ``shape`` over a mesh of every process (one per device)."""
    from torch.distributed.tensor import Shard

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return False
    mesh, placements = resolved_layout(layout)
    return mesh.size() == dist.get_world_size() and any(  # fit_placements replicates the other splits
        isinstance(p, Shard) and shape[p.dim] >= mesh.size(mesh_dim) for mesh_dim, p in enumerate(placements))


def rank_zero_succeeded(succeeded: bool) -> bool:
    """Every rank learns whether rank 0 succeeded (rank 0 passes whether it did; the others' argument is ignored)."""
    return bool(from_rank_zero(int(succeeded)))


def distribute_variable_from_rank_zero(whole: Optional[torch.Tensor], shape: Tuple[int, ...], dtype: torch.dtype,
                                       layout: Any, trainable: bool = True) -> torch.nn.Parameter:
    """An ``nn.Parameter`` holding a DTensor with ``layout`` whose value only rank 0 has (``whole``; None elsewhere):
    rank 0 sends each rank its piece, and no other rank ever holds the whole."""
    from ..._engine.specs import region
    from ..._torch.api import compute_local_shape_and_global_offset

    mesh, placements = resolved_layout(layout)
    placements = fit_placements(tuple(shape), mesh, placements, "variable")
    local_shape, offset = compute_local_shape_and_global_offset(tuple(shape), mesh, placements)
    header = torch.tensor(list(local_shape) + list(offset), dtype=torch.int64)
    rank = dist.get_rank()
    headers = [torch.empty_like(header) for _ in range(dist.get_world_size())] if rank == 0 else None
    dist.gather(header, headers, dst=0)
    if rank == 0:
        assert whole is not None
        whole = whole.detach().to(dtype)
        for other, other_header in enumerate(headers or ()):
            other_shape, other_offset = other_header[:len(shape)].tolist(), other_header[len(shape):].tolist()
            if other and 0 not in other_shape:
                dist.send(whole[region(other_offset, other_shape)].contiguous(), dst=other)
        local = whole[region(offset, local_shape)].clone()
    else:
        local = torch.empty(tuple(local_shape), dtype=dtype, device=this_ranks_device())
        if local.numel():
            dist.recv(local, src=0)
    return torch.nn.Parameter(from_pieces(local, mesh, list(placements), shape), requires_grad=trainable)

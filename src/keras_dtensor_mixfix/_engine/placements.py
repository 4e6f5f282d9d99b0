"""Which placements a promoted operand gets: lined up with its DTensor peer, or inferred for a local piece."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from .._rules.decisions import Operand
from .._rules.errors import promotion_error
from .._rules.ops import OpTraits

def shard_dim(placement: Placement, ndim: int) -> Optional[int]:
    # Only plain Shard: _StridedShard and other subclasses carry layouts we do not reproduce.
    if type(placement) is Shard:
        dim = placement.dim
        return dim + ndim if dim < 0 else dim
    return None


def aligned_placements(plain: torch.Tensor, peer: DTensor) -> Tuple[Placement, ...]:
    """Placements that make the whole tensor ``plain`` line up with ``peer`` (right-aligned dims).

    A mesh dim that shards a peer dim the plain tensor also has, at the same global size,
    shards the plain tensor there too (a local slice, no communication); anything else is
    Replicate. Any answer is correct: the DTensor still holds all of ``plain``.
    """
    offset = peer.ndim - plain.ndim
    result: List[Placement] = []
    for placement in peer.placements:
        dim = shard_dim(placement, peer.ndim)
        plain_dim = None if dim is None else dim - offset
        if plain_dim is not None and 0 <= plain_dim < plain.ndim and plain.shape[plain_dim] == peer.shape[dim]:
            result.append(Shard(plain_dim))
        else:
            result.append(Replicate())
    return tuple(result)


def broadcastable(a: Sequence[int], b: Sequence[int]) -> bool:
    a = tuple(a)
    b = tuple(b)
    if all(type(size) is int for size in a + b):
        # Concrete sizes (eager): the broadcasting rule itself, without torch.broadcast_shapes'
        # overhead (about 2.5 us a call).
        for x, y in zip(reversed(a), reversed(b)):
            if x != y and x != 1 and y != 1:
                return False
        return True
    try:
        torch.broadcast_shapes(a, b)
    except RuntimeError:
        return False
    return True


def choose_whole_placements(operand: Operand, peer: DTensor, mesh: Any, traits: OpTraits) -> Tuple[Placement, ...]:
    plain = operand.tensor
    if peer.device_mesh != mesh:
        return (Replicate(),) * mesh.ndim
    if traits.elementwise:
        if broadcastable(plain.shape, peer.shape):
            return aligned_placements(plain, peer)
        local_shape = tuple(peer._local_tensor.shape)
        if local_shape != tuple(peer.shape) and broadcastable(plain.shape, local_shape):
            raise promotion_error(
                traits.name,
                "under the 'replicate' rule a plain operand is the whole tensor, but this one has the shape of the "
                "DTensor's local shard, not of its global shape; it looks like this rank's piece",
                operand_label=operand.label, operand=plain, peers=[peer],
                advice="If it is this rank's piece, use the 'local' rule (patch(default='local') or "
                       f"register_rule({traits.name!r}, 'local')); if it is the whole tensor, its shape is wrong.",
            )
        return (Replicate(),) * mesh.ndim
    # Not elementwise: a matching shape says nothing about which dims line up (a conv weight can
    # have its input's shape), and DTensor strategies may mishandle an unexpectedly sharded
    # operand, so the operand is replicated (still no communication).
    return (Replicate(),) * mesh.ndim


def mapped_local_placements(plain: torch.Tensor, peer: DTensor) -> Tuple[Placement, ...]:
    offset = peer.ndim - plain.ndim
    local_peer_shape = peer._local_tensor.shape
    result: List[Placement] = []
    for placement in peer.placements:
        dim = shard_dim(placement, peer.ndim)
        if dim is not None:
            plain_dim = dim - offset
            broadcast = 0 <= plain_dim < plain.ndim and plain.shape[plain_dim] == 1 and local_peer_shape[dim] != 1
            if 0 <= plain_dim < plain.ndim and not broadcast:
                result.append(Shard(plain_dim))
            else:
                result.append(Replicate())
        elif isinstance(placement, Partial):
            result.append(placement)
        else:
            result.append(Replicate())
    return tuple(result)


def infer_global_shape(operand: Operand, peer: DTensor, placements: Tuple[Placement, ...], traits: OpTraits, explicit: bool, mesh: Any) -> Tuple[int, ...]:
    plain = operand.tensor
    shape = list(plain.shape)
    offset = peer.ndim - plain.ndim
    sharded: Dict[int, int] = {}
    for mesh_dim, placement in enumerate(placements):
        dim = shard_dim(placement, plain.ndim)
        if dim is not None:
            sharded[dim] = sharded.get(dim, 1) * mesh.size(mesh_dim)
    for dim, shards in sharded.items():
        peer_dim = dim + offset
        peer_sharded_same = (
            not explicit
            and 0 <= peer_dim < peer.ndim
            and plain.shape[dim] == peer._local_tensor.shape[peer_dim]
        )
        if peer_sharded_same:
            # The peer's global size also covers uneven shards, which local * shards would not.
            shape[dim] = peer.shape[peer_dim]
        elif explicit:
            shape[dim] = plain.shape[dim] * shards
        else:
            raise promotion_error(
                traits.name,
                f"under the 'local' rule dim {dim} of this operand is sharded like the DTensor's dim {peer_dim}, but "
                f"its local size {plain.shape[dim]} differs from the DTensor's local size "
                f"{tuple(peer._local_tensor.shape)[peer_dim] if 0 <= peer_dim < peer.ndim else '?'}, so the global "
                "shape cannot be inferred",
                operand_label=operand.label, operand=plain, peers=[peer],
                advice="Give the global shape with a callable rule returning Decision('local', placements=..., shape=...).",
            )
    return tuple(shape)

"""Stage 4, placements: how a promoted operand is laid out as a DTensor.

A ``"replicate"`` operand is the whole tensor: its placements line up with its DTensor peer's
where that needs no communication (a local slice), else Replicate. A ``"local"`` operand is this
rank's piece: its placements follow the peer's, and its global shape is inferred. Each answer is
checked here, with the errors that say why it cannot be; construct.py then builds the DTensor.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, cast

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from .._rules.decisions import Decision, Operand
from .._rules.errors import describe_mesh, promotion_error
from .._rules.ops import OpTraits
from .._torch.api import DTensorSpec, is_exactly, is_traced
from .caches import CACHES, remember
from .specs import local_slice, make_spec

_WHOLE_LAYOUTS = CACHES.whole_layouts
_LOCAL_READINGS = CACHES.local_readings


def shard_dim(placement: Placement, ndim: int) -> Optional[int]:
    # Only plain Shard: _StridedShard and other subclasses carry layouts we do not reproduce.
    if is_exactly(placement, Shard):
        dim = cast(Shard, placement).dim
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
        if (dim is not None and plain_dim is not None and 0 <= plain_dim < plain.ndim
                and plain.shape[plain_dim] == peer.shape[dim]):
            result.append(Shard(plain_dim))
        else:
            result.append(Replicate())
    return tuple(result)


def broadcastable(a: Sequence[int], b: Sequence[int]) -> bool:
    a = tuple(a)
    b = tuple(b)
    if all(type(size) is int for size in a + b):
        # Concrete sizes (eager): the broadcasting rule itself, without torch.broadcast_shapes'
        # per-call overhead.
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


def infer_global_shape(operand: Operand, peer: DTensor, placements: Tuple[Placement, ...], traits: OpTraits,
                       explicit: bool, mesh: Any) -> Tuple[int, ...]:
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
                advice="Give the global shape with a callable rule returning "
                       "Decision('local', placements=..., shape=...).",
            )
    return tuple(shape)


class WholeLayout(NamedTuple):
    """How an eager whole tensor is promoted next to a peer under the default decision."""

    placements: Tuple[Placement, ...]
    local_index: Optional[Tuple[slice, ...]]
    """This rank's slice of the whole tensor; None: all of it."""
    spec: DTensorSpec
    """The promoted operand's spec (shared: see specs.make_spec)."""


def whole_layout(operand: Operand, peer: DTensor, traits: OpTraits) -> WholeLayout:
    """The layout of an eager plain operand (not written) promoted whole next to ``peer`` on its mesh.

    The caller has checked that the operand sits on the peer's local device (devices.py): the
    layout holds no device (a spec does not say where local pieces sit: a meta-initialized DTensor
    has a CPU one's), so every caller compares the two devices on each call before using a cached
    layout. Raises ``choose_whole_placements``'s errors."""
    plain = operand.tensor
    mesh = peer.device_mesh
    placements = choose_whole_placements(operand, peer, mesh, traits)
    shape = tuple(plain.shape)
    local_index: Optional[Tuple[slice, ...]] = None
    if not all(p.is_replicate() for p in placements):
        local_index = local_slice(shape, mesh, placements)
        if local_index is None:  # only eager local pieces reach here (layout_cacheable): never under the simulator
            raise AssertionError("a whole layout asked for on a rank-symbolic mesh coordinate")
        if all(piece.start == 0 and piece.stop == size for piece, size in zip(local_index, shape)):
            local_index = None  # this rank's piece is all of it (e.g. a mesh dim of size 1)
    return WholeLayout(placements, local_index,
                       make_spec(mesh, placements, shape, plain.stride(), plain.dtype, cache=True))


EAGER_TYPES = (torch.Tensor, torch.nn.Parameter)
"""The exact types of an eager tensor: while torch.compile traces, tensors are subclasses (fake, functional)."""


def layout_cacheable(plain: torch.Tensor, peer: DTensor, written: bool) -> bool:
    """Whether the whole layout of the plain operand ``plain`` beside ``peer`` may be taken from the cache.

    It may for an eager operand the op only reads, beside an eager local piece: a layout holds this rank's
    slice of the operand, whose offset must never be baked into a traced graph, and a written operand
    runs on whole values (general.py). fast.py and foreach.py's direct path test the same while they scan
    a call's arguments (the types decide which argument is the plain one).

    Args:
        plain: the plain operand.
        peer: the DTensor it is promoted beside.
        written: whether the op writes into ``plain``.

    Returns:
        True where ``cached_whole_layout`` may serve it.
    """
    return not written and type(plain) in EAGER_TYPES and type(peer._local_tensor) in EAGER_TYPES


def cached_whole_layout(plain: torch.Tensor, peer: DTensor, traits: OpTraits, position: Tuple[Any, ...]) -> WholeLayout:
    """``whole_layout`` for a plain operand at ``position`` that ``layout_cacheable`` admits, cached."""
    key = (traits.elementwise, plain.shape, plain.stride(), plain.dtype, peer._spec)
    layout = _WHOLE_LAYOUTS.get(key)
    if layout is None:
        layout = whole_layout(Operand(position, plain, True, False), peer, traits)
        remember(_WHOLE_LAYOUTS, key, layout)
    return layout


def whole_placements(operand: Operand, peer: DTensor, mesh: Any, traits: OpTraits,
                     decision: Decision) -> Tuple[Placement, ...]:
    """The placements of a ``"replicate"`` operand: the decision's, Replicate for a written one, else lined up."""
    plain = operand.tensor
    if decision.placements is not None:
        placements = tuple(decision.placements)
        if any(isinstance(p, Partial) for p in placements):
            raise promotion_error(traits.name, "a whole-tensor ('replicate') operand cannot be Partial",
                                  operand_label=operand.label, operand=plain, peers=[peer])
    elif operand.written:
        # The op writes into this operand: its DTensor must own exactly this storage.
        placements = (Replicate(),) * mesh.ndim
    else:
        placements = choose_whole_placements(operand, peer, mesh, traits)
    if operand.written and any(not p.is_replicate() for p in placements):
        raise promotion_error(traits.name, "an operand the op writes into can only be promoted as Replicate under "
                              "'replicate' (its storage must stay whole)", operand_label=operand.label,
                              operand=plain, peers=[peer])
    return placements


def local_layout(operand: Operand, peer: DTensor, mesh: Any, traits: OpTraits,
                 decision: Decision) -> Tuple[Tuple[Placement, ...], Tuple[int, ...]]:
    """The placements and global shape of a ``"local"`` operand (this rank's piece)."""
    plain = operand.tensor
    memo = _LOCAL_READINGS.get(plain)
    if memo is not None and memo[0] == mesh and decision.placements is None and decision.shape is None:
        # Already read as this rank's piece (e.g. in forward, now in backward against a gradient
        # with other placements): a tensor is one piece of one global tensor, so reuse that reading.
        return memo[1], memo[2]
    if decision.placements is not None:
        placements = tuple(decision.placements)
    else:
        if peer.device_mesh != mesh:
            raise promotion_error(traits.name, "the 'local' rule needs a DTensor peer on the op's mesh",
                                  operand_label=operand.label, operand=plain, peers=[peer])
        placements = mapped_local_placements(plain, peer)
    if len(placements) != mesh.ndim:
        raise promotion_error(traits.name, f"{len(placements)} placements given for a {mesh.ndim}-D mesh "
                              f"{describe_mesh(mesh)}", operand_label=operand.label, operand=plain, peers=[peer])
    if decision.shape is not None:
        shape = tuple(int(s) for s in decision.shape)
    else:
        shape = infer_global_shape(operand, peer, placements, traits, explicit=decision.placements is not None,
                                   mesh=mesh)
    if shape != tuple(plain.shape) and plain.requires_grad and torch.is_grad_enabled() and not is_traced(plain):
        # Autograd recorded this operand with its local shape and checks the gradient against it
        # before any hook can run, so a gradient for a local piece cannot be delivered from here.
        raise promotion_error(
            traits.name,
            "a 'local' operand that requires grad cannot be promoted below autograd: autograd recorded its local "
            f"shape {tuple(plain.shape)} and would reject the gradient of global shape {shape}",
            operand_label=operand.label, operand=plain, peers=[peer],
            advice=f"Wrap it yourself, differentiably: DTensor.from_local(x, mesh, {list(placements)}) (its .grad is "
                   "then this rank's piece), or detach it if it needs no gradient.",
        )
    _LOCAL_READINGS[plain] = (mesh, placements, shape)
    return placements, shape

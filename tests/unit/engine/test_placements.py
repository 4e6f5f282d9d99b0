"""Stage 4 of the engine, placements: how a promoted operand is laid out, and the errors that say why not.

The placement functions read a DTensor peer's global shape, placements, mesh and local piece only, so
they are tested here with stand-in peers on stand-in meshes of any size (no process group); the
engine applying them to real DTensors on several ranks is tested in tests/engine/test_eager.py and
tests/engine/test_decisions.py.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from keras_dtensor_mixfix._engine.caches import CACHES
from keras_dtensor_mixfix._engine.placements import (aligned_placements, broadcastable, choose_whole_placements,
                                                     infer_global_shape, local_layout, mapped_local_placements,
                                                     whole_placements)
from keras_dtensor_mixfix._rules.decisions import Decision, Operand
from keras_dtensor_mixfix._rules.errors import MixedOperandError
from keras_dtensor_mixfix._rules.ops import op_traits

MUL = op_traits(torch.ops.aten.mul.Tensor)  # elementwise
MM = op_traits(torch.ops.aten.mm.default)  # not elementwise


class _Mesh:
    """What the placement functions read of a mesh: its dims and their sizes."""

    def __init__(self, *sizes: int) -> None:
        self.sizes = sizes
        self.ndim = len(sizes)

    def size(self, dim: int) -> int:
        return self.sizes[dim]


def _peer(shape, placements, mesh, local_shape=None):
    """A stand-in DTensor: global ``shape``, ``placements`` on ``mesh``, a local piece of ``local_shape``."""
    local = torch.empty(local_shape if local_shape is not None else shape)
    return types.SimpleNamespace(shape=torch.Size(shape), ndim=len(shape), placements=tuple(placements),
                                 dtype=local.dtype, device=local.device, device_mesh=mesh, _local_tensor=local,
                                 _spec=types.SimpleNamespace(mesh=mesh))


def _operand(tensor, written=False):
    return Operand((1,), tensor, True, written)


MESH2 = _Mesh(2)


@pytest.mark.parametrize("plain_shape, peer_shape, peer_placements, expected", [
    ((8, 6), (8, 6), [Shard(0)], (Shard(0),)),        # same shape: sharded like the peer (a local slice)
    ((6,), (8, 6), [Shard(1)], (Shard(0),)),          # right-aligned: the plain dim 0 is the peer's dim 1
    ((6,), (8, 6), [Shard(0)], (Replicate(),)),       # the peer shards a dim the plain tensor lacks
    ((1, 6), (8, 6), [Shard(0)], (Replicate(),)),     # a broadcast dim (size 1) cannot be sliced
    ((8, 6), (8, 6), [Shard(-2)], (Shard(0),)),       # a negative Shard dim counts from the peer's end
    ((8, 6), (8, 6), [Partial()], (Replicate(),)),    # only Shard lines up; anything else is Replicate
    ((8, 6), (8, 6), [Replicate(), Shard(1)], (Replicate(), Shard(1))),  # per mesh dim
])
def test_aligned_placements_line_the_whole_tensor_up_with_its_peer(plain_shape, peer_shape, peer_placements,
                                                                   expected):
    mesh = _Mesh(*([2] * len(peer_placements)))
    got = aligned_placements(torch.empty(plain_shape), _peer(peer_shape, peer_placements, mesh))
    assert got == expected


@pytest.mark.parametrize("a, b, expected", [
    ((8, 6), (8, 6), True), ((6,), (8, 6), True), ((1, 6), (8, 6), True), ((8, 1), (1, 6), True),
    ((4, 6), (8, 6), False), ((7,), (8, 6), False), ((), (8, 6), True),
])
def test_broadcastable_is_torchs_rule(a, b, expected):
    assert broadcastable(a, b) is expected
    try:
        torch.broadcast_shapes(a, b)
        torch_says = True
    except RuntimeError:
        torch_says = False
    assert torch_says is expected


def test_choose_whole_placements_lines_up_only_elementwise_ops_on_the_peers_mesh():
    peer = _peer((8, 6), [Shard(0)], MESH2, local_shape=(4, 6))
    plain = torch.empty(8, 6)
    assert choose_whole_placements(_operand(plain), peer, MESH2, MUL) == (Shard(0),)
    # not elementwise: a matching shape says nothing about which dims line up
    assert choose_whole_placements(_operand(plain), peer, MESH2, MM) == (Replicate(),)
    # promoted to another mesh than the peer's: nothing to line up with
    other = _Mesh(2, 2)
    assert choose_whole_placements(_operand(plain), peer, other, MUL) == (Replicate(), Replicate())
    # not broadcastable with the peer: left to the op, replicated
    assert choose_whole_placements(_operand(torch.empty(3, 5)), peer, MESH2, MUL) == (Replicate(),)


def test_a_whole_operand_shaped_like_the_peers_local_shard_is_refused_with_advice():
    peer = _peer((8, 6), [Shard(0)], MESH2, local_shape=(4, 6))
    with pytest.raises(MixedOperandError, match="local shard") as info:
        choose_whole_placements(_operand(torch.empty(4, 6)), peer, MESH2, MUL)
    assert "'local'" in str(info.value) and "args[1]" in str(info.value)


def test_whole_placements_take_a_decisions_placements_and_keep_written_operands_whole():
    peer = _peer((8, 6), [Shard(0)], MESH2, local_shape=(4, 6))
    plain = torch.empty(8, 6)
    given = Decision("replicate", placements=[Replicate()])
    assert whole_placements(_operand(plain), peer, MESH2, MUL, given) == (Replicate(),)
    assert whole_placements(_operand(plain), peer, MESH2, MUL, Decision("replicate")) == (Shard(0),)
    # an operand the op writes into: its DTensor must own exactly its storage
    assert whole_placements(_operand(plain, written=True), peer, MESH2, MUL, Decision("replicate")) == (Replicate(),)
    with pytest.raises(MixedOperandError, match="only be promoted as Replicate"):
        whole_placements(_operand(plain, written=True), peer, MESH2, MUL, Decision("replicate", placements=[Shard(0)]))
    with pytest.raises(MixedOperandError, match="cannot be Partial"):
        whole_placements(_operand(plain), peer, MESH2, MUL, Decision("replicate", placements=[Partial()]))


def test_mapped_local_placements_follow_the_peer_except_where_the_piece_broadcasts():
    peer = _peer((8, 6), [Shard(0)], MESH2, local_shape=(4, 6))
    assert mapped_local_placements(torch.empty(4, 6), peer) == (Shard(0),)
    assert mapped_local_placements(torch.empty(1, 6), peer) == (Replicate(),)  # broadcasts along the sharded dim
    assert mapped_local_placements(torch.empty(6), peer) == (Replicate(),)  # lacks the sharded dim
    partial = _peer((8, 6), [Partial()], MESH2)
    assert mapped_local_placements(torch.empty(8, 6), partial) == (Partial(),)  # a partial sum stays one


def test_infer_global_shape_takes_the_peers_global_size_even_for_uneven_shards():
    mesh = _Mesh(2)
    even = _peer((8, 6), [Shard(0)], mesh, local_shape=(4, 6))
    piece = _operand(torch.empty(4, 6))
    assert infer_global_shape(piece, even, (Shard(0),), MUL, explicit=False, mesh=mesh) == (8, 6)
    uneven = _peer((7, 6), [Shard(0)], mesh, local_shape=(4, 6))  # rank 0 of 7 rows on 2 ranks
    assert infer_global_shape(piece, uneven, (Shard(0),), MUL, explicit=False, mesh=mesh) == (7, 6)
    # explicit placements: the piece times the shards (the peer says nothing about this operand)
    assert infer_global_shape(piece, uneven, (Shard(0),), MUL, explicit=True, mesh=mesh) == (8, 6)
    with pytest.raises(MixedOperandError, match="global shape cannot be inferred"):
        infer_global_shape(_operand(torch.empty(3, 6)), even, (Shard(0),), MUL, explicit=False, mesh=mesh)


@pytest.fixture
def clean_caches():
    CACHES.clear()
    yield
    CACHES.clear()


def test_local_layout_remembers_a_tensors_reading_until_the_caches_are_cleared(clean_caches):
    peer = _peer((8, 6), [Shard(0)], MESH2, local_shape=(4, 6))
    piece = torch.empty(4, 6)
    assert local_layout(_operand(piece), peer, MESH2, MUL, Decision("local")) == ((Shard(0),), (8, 6))
    # against a replicated peer (a gradient in backward, say) the same tensor keeps its first reading
    replicated = _peer((4, 6), [Replicate()], MESH2)
    assert local_layout(_operand(piece), replicated, MESH2, MUL, Decision("local")) == ((Shard(0),), (8, 6))
    CACHES.clear()
    assert local_layout(_operand(piece), replicated, MESH2, MUL, Decision("local")) == ((Replicate(),), (4, 6))


def test_local_layout_refuses_what_cannot_be_promoted_below_autograd(clean_caches):
    peer = _peer((8, 6), [Shard(0)], MESH2, local_shape=(4, 6))
    with pytest.raises(MixedOperandError, match="2 placements given for a 1-D mesh"):
        local_layout(_operand(torch.empty(4, 6)), peer, MESH2, MUL,
                     Decision("local", placements=[Shard(0), Replicate()]))
    with torch.enable_grad(), pytest.raises(MixedOperandError, match="requires grad") as info:
        local_layout(_operand(torch.empty(4, 6, requires_grad=True)), peer, MESH2, MUL, Decision("local"))
    assert "DTensor.from_local" in str(info.value)
    with pytest.raises(MixedOperandError, match="DTensor peer on the op's mesh"):
        local_layout(_operand(torch.empty(4, 6)), peer, _Mesh(2), MUL, Decision("local"))

"""Stage 5 of the engine, construct: promoted DTensors, their specs and slices, the rebuilt call.

Specs and DTensors need a real mesh: one process, a world of size 1 (a gloo group on an in-memory
store, created for this module and destroyed after it). On it every rank's piece is the whole
tensor; slices of several ranks are tested on real ranks in tests/engine/test_eager.py.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from keras_dtensor_mixfix._engine.caches import CACHES, CACHE_LIMIT, NO_OPTIONS_SEEN, FastOptions, remember
from keras_dtensor_mixfix._engine.construct import local_dtensor, local_piece, rebuild, whole_dtensor, wrap
from keras_dtensor_mixfix._engine.specs import contiguous_stride, local_slice, make_spec
from keras_dtensor_mixfix._engine.placements import cached_whole_layout, whole_layout
from keras_dtensor_mixfix._rules.decisions import Operand
from keras_dtensor_mixfix._rules.ops import op_traits
from keras_dtensor_mixfix._rules.options import Options

MUL = op_traits(torch.ops.aten.mul.Tensor)


@pytest.fixture(scope="module")
def mesh():
    """A 1-D CPU mesh of one rank (and its process group, for this module only)."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process; these tests create their own")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def clean_caches():
    CACHES.clear()
    yield
    CACHES.clear()


def test_contiguous_stride_is_torchs():
    for shape in [(8, 6), (3,), (), (2, 0, 5), (4, 1, 3)]:
        assert contiguous_stride(shape) == torch.empty(shape).stride()


def test_eager_specs_are_shared_and_forgotten_by_clear(mesh):
    first = make_spec(mesh, (Shard(0),), (8, 6), (6, 1), torch.float32, cache=True)
    assert make_spec(mesh, (Shard(0),), (8, 6), (6, 1), torch.float32, cache=True) is first
    assert make_spec(mesh, (Shard(0),), (8, 6), (6, 1), torch.float32) is not first  # traced: never shared
    assert make_spec(mesh, (Shard(0),), (8, 6), (6, 1), torch.float64, cache=True) is not first
    assert first.shape == torch.Size((8, 6)) and first.placements == (Shard(0),)
    CACHES.clear()
    assert make_spec(mesh, (Shard(0),), (8, 6), (6, 1), torch.float32, cache=True) is not first


def test_specs_with_placement_types_we_do_not_know_are_built_afresh(mesh):
    class MyShard(Shard):
        pass

    spec = make_spec(mesh, (MyShard(0),), (8, 6), (6, 1), torch.float32, cache=True)
    assert make_spec(mesh, (MyShard(0),), (8, 6), (6, 1), torch.float32, cache=True) is not spec
    assert not CACHES.specs


def test_one_ranks_slice_is_the_whole_tensor_and_is_cached(mesh):
    assert local_slice((8, 6), mesh, (Shard(0),)) == (slice(0, 8), slice(0, 6))
    assert list(CACHES.slices.values()) == [(slice(0, 8), slice(0, 6))]


def test_local_piece_detaches_and_slices():
    plain = torch.arange(12.0).reshape(4, 3).requires_grad_()
    whole = local_piece(plain, None)
    assert not whole.requires_grad and whole.data_ptr() == plain.data_ptr()
    piece = local_piece(plain, (slice(2, 4), slice(0, 3)))
    assert torch.equal(piece, plain.detach()[2:]) and not piece.requires_grad
    no_grad = torch.ones(3)
    assert local_piece(no_grad, None) is no_grad


def test_a_whole_tensor_becomes_a_dtensor_over_its_own_storage(mesh):
    plain = torch.randn(8, 6)
    for placements in [(Replicate(),), (Shard(0),), (Shard(1),)]:
        dtensor = whole_dtensor(plain, mesh, placements)
        assert type(dtensor) is DTensor and dtensor.placements == placements
        assert dtensor.shape == plain.shape and dtensor.stride() == plain.stride()
        assert dtensor._local_tensor.data_ptr() == plain.data_ptr()  # no copy: one rank holds all of it
        assert torch.equal(dtensor.full_tensor(), plain)


def test_a_local_piece_is_wrapped_with_its_global_shape_and_a_contiguous_stride(mesh):
    piece = torch.randn(4, 6, requires_grad=True)
    dtensor = local_dtensor(piece, mesh, (Replicate(),), (4, 6))
    assert dtensor.shape == (4, 6) and dtensor.stride() == (6, 1)
    assert not dtensor.requires_grad and not dtensor._local_tensor.requires_grad  # below autograd: detached
    assert dtensor._local_tensor.data_ptr() == piece.data_ptr()
    # a partial sum stays one
    assert wrap(piece, mesh, (Partial(),), (4, 6), (6, 1), piece.dtype).placements == (Partial(),)


def test_rebuild_puts_each_promoted_operand_in_its_place_and_keeps_container_types():
    a, b, c, d = (torch.ones(1) * i for i in range(4))
    args = (a, [b, c], (c, d))
    kwargs = {"out": d, "other": (a, b)}
    new_args, new_kwargs = rebuild(args, kwargs, {(0,): "A", (1, 1): "C", (2, 0): "C2", ("other", 1): "B"})
    assert new_args == ("A", [b, "C"], ("C2", d))
    assert type(new_args[1]) is list and type(new_args[2]) is tuple
    assert new_kwargs == {"out": d, "other": (a, "B")}
    assert args == (a, [b, c], (c, d)) and kwargs["other"] == (a, b)  # the call's own containers are untouched


def test_whole_layout_is_what_whole_dtensor_builds_and_is_cached_per_layout(mesh):
    from torch.distributed.tensor import distribute_tensor

    peer = distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)])
    plain = torch.randn(8, 6)
    layout = whole_layout(Operand((1,), plain, True, False), peer, MUL)
    assert layout.placements == (Shard(0),)
    assert layout.local_index is None  # this rank's piece is all of it
    built = whole_dtensor(plain, mesh, layout.placements)
    assert layout.spec == built._spec
    cached = cached_whole_layout(plain, peer, MUL, (1,))
    assert cached == layout and cached_whole_layout(plain, peer, MUL, (1,)) is cached
    assert cached_whole_layout(torch.randn(6), peer, MUL, (1,)).placements == (Replicate(),)


def test_caches_clear_empties_every_container_in_place():
    containers = [CACHES.slices, CACHES.specs, CACHES.whole_layouts, CACHES.op_states]
    for container in containers:
        container["key"] = "value"
    kept = torch.ones(2)
    CACHES.local_readings[kept] = ("mesh", (), (2,))
    CACHES.fast_options = FastOptions(Options())
    CACHES.clear()
    # the stages bound these containers at import: each must be the same object, emptied
    assert [CACHES.slices, CACHES.specs, CACHES.whole_layouts, CACHES.op_states] == [{}, {}, {}, {}]
    assert all(now is before for now, before in zip(
        [CACHES.slices, CACHES.specs, CACHES.whole_layouts, CACHES.op_states], containers))
    assert kept not in CACHES.local_readings
    assert CACHES.fast_options is NO_OPTIONS_SEEN


def test_fast_options_say_when_the_fast_paths_may_run():
    default = FastOptions(Options())
    assert (default.replicate_default, default.allowed, default.direct, default.plain_grads) == (True, True, True, True)
    assert not FastOptions(Options(check="warn")).allowed  # a check adds per-operand work
    assert not FastOptions(Options(default="local")).replicate_default
    # a callable may answer anything
    assert not FastOptions(Options(default=lambda call: "replicate")).replicate_default
    assert not FastOptions(Options(direct=False)).direct
    assert not FastOptions(Options(plain_grads=False)).plain_grads


def test_a_full_cache_is_emptied_before_it_grows():
    cache = {}
    for key in range(CACHE_LIMIT):
        remember(cache, key, key)
    assert len(cache) == CACHE_LIMIT
    remember(cache, "one more", 0)
    assert cache == {"one more": 0}

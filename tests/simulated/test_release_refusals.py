"""Views torch 2.11's DTensor cannot run (a split dim folded into the dim before it: ``q @ rot`` with q's heads split),
under the rank simulator on 8 ranks: the package refuses exactly the views torch refuses, with an error naming the
release that runs them, and the advice it gives, followed, computes what one process does; on later releases the same
programs run and equal plain math (``_engine/release_refusals.py``, ``repros/torch_view_flatten_split_dim.py``)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor import distribute_tensor as _distribute_tensor

import keras_dtensor_mixfix as mf
from keras_dtensor_mixfix._engine.release_refusals import FLATTEN_DEFECT, folded_split_dim, release_rules
from keras_dtensor_mixfix._torch.versions import has_defect

import _simulator

HAS_DEFECT = has_defect(FLATTEN_DEFECT, torch.__version__)
SHAPES = [(2, 8, 3, 8), (8, 2, 8), (2, 1, 8, 8), (8, 8, 1, 2)]
"""Tensors whose every dim of 8 splits evenly over 8 simulated ranks."""


def _views(shape):
    """Every view of ``shape`` that merges runs of adjacent dims (what a matmul's flattening does), every view as two
    dims (splitting and merging), one with a -1, and the whole as one dim."""
    numel = math.prod(shape)
    views = {(numel,), (-1, shape[-1])}
    views.update((a, numel // a) for a in range(1, numel + 1) if numel % a == 0)
    for cuts in range(2 ** (len(shape) - 1)):  # each bit: a cut between dims i and i + 1
        merged, run = [], shape[0]
        for i, size in enumerate(shape[1:]):
            if cuts >> i & 1:
                merged.append(run)
                run = size
            else:
                run *= size
        views.add((*merged, run))
    return sorted(views)


def _distribute(tensor, mesh, placements):
    return _distribute_tensor(tensor, mesh, placements, src_data_rank=None)


@pytest.fixture(scope="module")
def mesh():
    with _simulator.fake_process_group(8), _simulator.simulated_mesh((8,)) as simulated:
        yield simulated


def test_the_rules_are_installed_where_the_defect_table_lists_the_defect():
    assert bool(release_rules()) == HAS_DEFECT
    with mf.patched():
        from keras_dtensor_mixfix._engine import context

        installed = context.state().installed
        assert [installed.owns(name) for name in ("aten::view", "aten::_unsafe_view")] == [
            True, True] if HAS_DEFECT else [None, None]


def _view(split, view):
    """The view, or the error it raised (a RuntimeError: torch refuses some views of split dims on every release, as
    unflattening an uneven split)."""
    try:
        return split.view(view)
    except RuntimeError as error:
        return error


def _pieces(tensor):
    """Every simulated rank's local piece of a DTensor."""
    local = tensor._local_tensor
    return [local._local_tensors[rank] for rank in sorted(local._local_tensors)]


def _assert_same_view(patched, unpatched, whole, view, where):
    """The patched view is torch's own, piece by piece and placement by placement; where its placements are plain
    splits and replicas, its pieces are those of the whole tensor's view, split so (2.12 and later give a folded
    split a strided split instead: torch's own then)."""
    assert tuple(patched.placements) == tuple(unpatched.placements), where
    for got, want in zip(_pieces(patched), _pieces(unpatched)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    if all(type(p) in (Shard, Replicate) for p in unpatched.placements):
        expected = _distribute(whole.view(view), unpatched.device_mesh, unpatched.placements)
        for got, want in zip(_pieces(unpatched), _pieces(expected)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_package_refuses_exactly_the_views_torch_refuses(mesh):
    """Unpatched, torch 2.11 raises its flatten error for a view iff ``folded_split_dim`` finds a folded split dim
    (later releases never raise it); patched, those views raise ``ReleaseLimitationError`` and every other view gives
    what torch gives: the same values, or the same refusal."""
    counts = {"ran": 0, "refused by the package": 0, "torch's other refusals": 0}
    assert not mf.is_patched()
    torch.manual_seed(0)
    for shape in SHAPES:
        whole = torch.randn(shape)
        for dim in (d for d, n in enumerate(shape) if n == 8):
            split = _distribute(whole, mesh, [Shard(dim)])
            for view in _views(shape):
                predicted = folded_split_dim(shape, view, [Shard(dim)]) is not None
                where = (shape, f"Shard({dim})", view)
                unpatched = _view(split, view)
                with mf.patched():
                    patched = _view(split, view)
                flattens = isinstance(unpatched, RuntimeError) and "flatten multiple dimensions" in str(unpatched)
                assert flattens == (HAS_DEFECT and predicted), (*where, unpatched)
                if flattens:
                    assert isinstance(patched, mf.ReleaseLimitationError), (*where, patched)
                    counts["refused by the package"] += 1
                elif isinstance(unpatched, RuntimeError):
                    assert type(patched) is type(unpatched) and str(patched) == str(unpatched), (*where, patched)
                    counts["torch's other refusals"] += 1
                else:
                    _assert_same_view(patched, unpatched, whole, view, where)
                    counts["ran"] += 1
    assert counts["ran"] > 40 and (counts["refused by the package"] > 20 or not HAS_DEFECT), counts


def test_a_refused_matmul_names_the_release_and_its_advice_computes_one_process(mesh):
    """``q @ rot`` with q's heads split (rotary embedding as a matmul) and rot plain: refused on 2.11 with the
    release that runs it and the redistribution to make; that redistribution, then the same matmul, equals plain
    math, values and gradients (on later releases the call itself does)."""
    torch.manual_seed(1)
    query, rotation = torch.randn(2, 8, 3, 4), torch.randn(4, 4)
    expected = query @ rotation
    with mf.patched():
        q = _distribute(query, mesh, [Shard(1)]).requires_grad_()
        if HAS_DEFECT:
            with pytest.raises(mf.ReleaseLimitationError) as refused:
                q @ rotation
            message = str(refused.value)
            for text in ("aten.view", "torch 2.11", "(2, 8, 3, 4)", "Shard(dim=1)", "2.12 and later",
                         "x.redistribute(x.device_mesh, [Replicate()])", "flatten multiple dimensions"):
                assert text in message, (text, message)
            got = q.redistribute(q.device_mesh, [Replicate()]) @ rotation  # the advice, as written
        else:
            got = q @ rotation
        got.sum().backward()
    torch.testing.assert_close(got.full_tensor(), expected)
    # d(sum(q @ rot))/dq = ones @ rot^T: every row the sums of rot's rows
    torch.testing.assert_close(q.grad.full_tensor(), torch.ones_like(expected) @ rotation.T)

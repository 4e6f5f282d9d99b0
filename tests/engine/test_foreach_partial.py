"""In-place calls the package promotes that torch 2.11's DTensor cannot run: ``_foreach_*`` into ``Partial`` rows,
and ``index_put_``.

torch 2.11's DTensor drops in-place foreach writes into ``Partial`` DTensors
(``repros/torch_foreach_inplace_partial.py``) and has no strategy for ``index_put_``
(``repros/torch_index_put_inplace.py``); the engine runs those calls exactly on that release
(``_engine/foreach_partial.py``, ``_engine/corrections.py``). Each case is compared with one process on
plain tensors: on every release as the release runs it, and with the exact form forced on every release,
so that the form itself is proven wherever CI runs (1-D mesh on 2 ranks, (2, 2) on 4).
"""

from __future__ import annotations

import pytest
import torch

from _ranks import close, forced_defect, mesh_for, shard
from keras_dtensor_mixfix.testing import run_on_ranks


def _partial_placements(m):
    """The Partial layouts the cases use: on a 2-D mesh, split on one axis and partial on the other, both ways."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if m.ndim == 1:
        return [(Partial(),)]
    return [(Shard(0), Partial()), (Partial(), Replicate())]


def _partial(whole, m, placements):
    """A DTensor of value ``whole`` laid out as ``placements``, its partial pieces unequal across the ranks."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    held = [Replicate() if isinstance(p, Partial) else p for p in placements]
    local = DTensor.from_local(whole, m, [Replicate()] * m.ndim).redistribute(m, held).to_local().clone()
    partial_dims = [d for d, p in enumerate(placements) if isinstance(p, Partial)]
    count = 1
    for d in partial_dims:
        count *= m.size(d)
    index = 0
    for d in partial_dims:
        index = index * m.size(d) + m.get_coordinate()[d]
    # rank k of the partial dims holds (k + 1) / sum(1..count) of the value: the pieces add up to it
    piece = local * ((index + 1) * 2.0 / (count * (count + 1)))
    return DTensor.from_local(piece, m, list(placements), shape=whole.shape, stride=whole.stride())


def partial_rows(world_size, forced):
    """Mixed in-place foreach calls into Partial rows, SGD with momentum and clip_grad_norm_ over Partial
    gradients beside plain ones; values equal one process."""
    import keras_dtensor_mixfix as mf
    from keras_dtensor_mixfix._engine import foreach_partial
    from keras_dtensor_mixfix._engine.caches import CACHES
    from keras_dtensor_mixfix._torch.versions import drops_inplace_foreach_on_partial

    exact = forced or drops_inplace_foreach_on_partial(torch.__version__)
    written = []
    write_into = foreach_partial._write_into
    if forced:
        foreach_partial.drops_inplace_foreach_on_partial = lambda version: True
        CACHES.clear()  # op states made before hold the release's own call
    foreach_partial._write_into = lambda row, value: (written.append(row), write_into(row, value))

    def check(what, value, expected, rows_written):
        close(value, expected, what, rtol=1e-12, atol=1e-12)
        # the exact form wrote the rows itself, or the release did
        assert len(written) == (rows_written if exact else 0), (what, len(written))
        written.clear()

    try:
        m = mesh_for(world_size)
        torch.manual_seed(0)
        a, b, c = (torch.randn(8, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64),
                   torch.randn(5, dtype=torch.float64))
        pa, pb = torch.randn(8, 4, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
        for placements in _partial_placements(m):
            label = f"{tuple(placements)}"
            with mf.patched():
                rows = [_partial(a, m, placements), _partial(b, m, placements), c.clone()]
                torch._foreach_mul_(rows, [pa, pb, c])  # plain multipliers, a plain row
                close(rows[2], c * c, f"mul_ list plain row {label}")
                close(rows[1], b * pb, f"mul_ list {label}", rtol=1e-12, atol=1e-12)
                check(f"mul_ list {label}", rows[0], a * pa, 2)
                rows = [_partial(a, m, placements), _partial(b, m, placements)]
                torch._foreach_add_(rows, [pa, pb], alpha=0.5)
                close(rows[1], b + 0.5 * pb, f"add_ list {label}", rtol=1e-12, atol=1e-12)
                check(f"add_ list {label}", rows[0], a + 0.5 * pa, 2)
                rows = [_partial(a, m, placements), c.clone()]
                torch._foreach_mul_(rows, 0.25)  # the DTensor rows are a group of their own
                check(f"mul_ scalar {label}", rows[0], a * 0.25, 1)
                assert tuple(rows[0].placements) == tuple(placements), rows[0].placements
        _sgd_and_clipping(m)
        assert bool(written) == exact, len(written)  # clipping's and momentum's in-place writes
    finally:
        foreach_partial._write_into = write_into
        if forced:
            foreach_partial.drops_inplace_foreach_on_partial = drops_inplace_foreach_on_partial
            CACHES.clear()
    return "ok"


def _sgd_and_clipping(m):
    """SGD with momentum (its buffers start as clones of the gradients: Partial) and clip_grad_norm_, foreach, over a
    Replicate DTensor parameter whose gradient is Partial and a plain parameter."""
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import DTensor, Replicate

    torch.manual_seed(1)
    w, d = torch.randn(4, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    grads = [(torch.randn(4, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)) for _ in range(3)]
    placements = _partial_placements(m)[-1]
    dw = torch.nn.Parameter(DTensor.from_local(w.clone(), m, [Replicate()] * m.ndim))
    dd = torch.nn.Parameter(d.clone())
    rw, rd = torch.nn.Parameter(w.clone()), torch.nn.Parameter(d.clone())
    dopt = torch.optim.SGD([dw, dd], lr=0.1, momentum=0.9, foreach=True)
    ropt = torch.optim.SGD([rw, rd], lr=0.1, momentum=0.9, foreach=True)
    with mf.patched():
        for gw, gd in grads:
            dw.grad, dd.grad = _partial(gw, m, placements), gd.clone()
            rw.grad, rd.grad = gw.clone(), gd.clone()
            torch.nn.utils.clip_grad_norm_([dw, dd], max_norm=1.0, foreach=True)
            torch.nn.utils.clip_grad_norm_([rw, rd], max_norm=1.0, foreach=True)
            dopt.step()
            ropt.step()
    close(dw, rw.detach(), "SGD momentum, Partial gradient", rtol=1e-12, atol=1e-12)
    close(dd, rd.detach(), "SGD momentum, plain parameter", rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("forced", [False, True], ids=["as_the_release_runs", "exact_form_forced"])
def test_inplace_foreach_into_partial_rows_equals_one_process(world_size, forced):
    assert run_on_ranks(partial_rows, world_size, forced, world_size=world_size) == ["ok"] * world_size


def refusals():
    """The exact form runs eagerly without autograd; elsewhere it refuses, saying what to do."""
    import keras_dtensor_mixfix as mf
    from keras_dtensor_mixfix._engine import foreach_partial
    from keras_dtensor_mixfix._engine.caches import CACHES
    from keras_dtensor_mixfix._torch.versions import drops_inplace_foreach_on_partial

    foreach_partial.drops_inplace_foreach_on_partial = lambda version: True
    CACHES.clear()
    try:
        m = mesh_for(2)
        row = _partial(torch.randn(4, 2), m, _partial_placements(m)[0]).requires_grad_()
        with mf.patched(), pytest.raises(mf.MixedOperandError) as caught:
            torch._foreach_mul_([row * 1.0], [torch.randn(4, 2)])
        text = str(caught.value)
        assert "grad mode" in text and "torch.no_grad()" in text and "aten::_foreach_mul_.List" in text, text
        assert "Partial" in text, text
    finally:
        foreach_partial.drops_inplace_foreach_on_partial = drops_inplace_foreach_on_partial
        CACHES.clear()
    return "ok"


def test_inplace_foreach_into_partial_rows_under_autograd_is_refused_with_advice():
    assert run_on_ranks(refusals, world_size=2) == ["ok", "ok"]


def index_put_rows(world_size, forced):
    """Mixed in-place index_put_ (``x[rows] = values``) into a DTensor and into a plain tensor; torch 2.11 has no
    strategy for it and the engine runs it as index_put written back. Values equal one process."""
    import keras_dtensor_mixfix as mf
    from keras_dtensor_mixfix._engine import corrections
    from keras_dtensor_mixfix._torch.versions import has_defect
    from torch.distributed.tensor import Replicate, Shard

    exact = forced or has_defect("index_put_inplace_without_strategy", torch.__version__)
    written = []
    write_into = corrections.write_into
    corrections.write_into = lambda row, value: (written.append(row), write_into(row, value))
    try:
        with forced_defect("index_put_inplace_without_strategy", forced):
            m = mesh_for(world_size)
            torch.manual_seed(3)
            whole, rows, values = torch.randn(8, 4), torch.tensor([1, 6, 3]), torch.randn(3, 4)
            expected = whole.index_put((rows,), values)
            for placements in ([Replicate()] * m.ndim, [Replicate()] * (m.ndim - 1) + [Shard(1)]):
                target = shard(whole, m, placements)
                with mf.patched():
                    target[rows] = values  # plain index and values into a DTensor
                close(target, expected, f"x[rows] = plain values, x {placements}")
                assert tuple(target.placements) == tuple(placements), target.placements
            plain = whole.clone()
            with mf.patched():
                # DTensor values into a plain tensor
                plain.index_put_((rows,), shard(values, m, [Replicate()] * m.ndim))
            close(plain, expected, "plain.index_put_(DTensor values)")
            assert bool(written) == exact, len(written)
    finally:
        corrections.write_into = write_into
    return "ok"


@pytest.mark.parametrize("forced", [False, True], ids=["as_the_release_runs", "exact_form_forced"])
def test_inplace_index_put_equals_one_process(world_size, forced):
    assert run_on_ranks(index_put_rows, world_size, forced, world_size=world_size) == ["ok"] * world_size

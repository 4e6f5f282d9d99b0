"""``_foreach_*`` optimizer kernels over mixed lists, clip_grad_norm_, and mixed ops born in backward."""

from __future__ import annotations

import pytest
import torch

from _ranks import close, mesh_for, placements_for, plain_grad, shard
from keras_dtensor_mixfix.testing import run_on_ranks


def _params(m):
    torch.manual_seed(0)
    values = [torch.randn(8, 4), torch.randn(4, 6), torch.randn(6), torch.randn(3, 3)]
    from torch.distributed.tensor import Replicate

    dparams = [
        shard(values[0], m, placements_for(m, 0), True),
        shard(values[1], m, placements_for(m, 1), True),
        shard(values[2], m, [Replicate()] * m.ndim, True),
        values[3].clone().requires_grad_(),  # a plain parameter in the same optimizer
    ]
    rparams = [v.clone().requires_grad_() for v in values]
    return dparams, rparams


def _loss(params, x):
    a, b, c, d = params
    h = (x @ a) @ b + c
    return (h * h).mean() + (d * d).sum()


@pytest.mark.parametrize("optimizer", ["sgd_momentum_nesterov", "adam", "adamw_amsgrad", "rmsprop", "adagrad"])
def test_optimizer_steps_mixing_dtensor_and_plain_parameters(world_size, optimizer):
    assert run_on_ranks(optimizer_steps, world_size, optimizer, world_size=world_size) == ["ok"] * world_size


def optimizer_steps(world_size, optimizer):
    import keras_dtensor_mixfix as mf

    m = mesh_for(world_size)
    dparams, rparams = _params(m)
    factories = {
        "sgd_momentum_nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
        "adam": lambda p: torch.optim.Adam(p, lr=0.05, foreach=True),
        "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=0.05, amsgrad=True, foreach=True),
        "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, foreach=True),
        "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, foreach=True),
        "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.05, fused=True),
        "adam_fused_amsgrad": lambda p: torch.optim.Adam(p, lr=0.05, amsgrad=True, fused=True),
    }
    dopt, ropt = factories[optimizer](dparams), factories[optimizer](rparams)
    torch.manual_seed(1)
    batches = [torch.randn(5, 8) for _ in range(3)]
    with mf.patched():
        for x in batches:
            for opt, params in ((dopt, dparams), (ropt, rparams)):
                opt.zero_grad()
                _loss(params, x).backward()
                torch.nn.utils.clip_grad_norm_(params, max_norm=0.5, foreach=True)  # norms over a mixed list
                opt.step()
        ops = mf.stats()
    for index, (d, r) in enumerate(zip(dparams, rparams)):
        close(d, r.detach(), f"{optimizer} param {index}", rtol=1e-4, atol=1e-5)
    assert type(dparams[3]) is torch.Tensor and type(dparams[3].grad) is torch.Tensor
    assert any(op.startswith("aten::_foreach_") or op.startswith("aten::stack") or op.startswith("aten::_fused_")
               for op in ops), ops
    return "ok"


@pytest.mark.parametrize("optimizer", ["adamw_fused", "adam_fused_amsgrad"])
def test_fused_optimizer_steps_mixing_dtensor_and_plain_parameters(world_size, optimizer):
    """``fused=True``, the default of some optimizers on CUDA, forced on CPU (torch's fused Adam/AdamW/SGD kernels
    run on CPU too), over one parameter list mixing DTensor and plain parameters, with ``clip_grad_norm_(...,
    foreach=True)``; values compared with one process on plain tensors. (``SGD(fused=True)`` is not here: DTensor
    has no sharding strategy for ``_fused_sgd_``, so it fails on DTensor parameters with or without plain ones.)"""
    assert run_on_ranks(optimizer_steps, world_size, optimizer, world_size=world_size) == ["ok"] * world_size


def foreach_direct(world_size):
    """Direct _foreach_ calls: mixed rows, plain rows, tensor scalars, per-row scalar tensors, two meshes."""
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import Shard

    m = mesh_for(world_size)
    torch.manual_seed(2)
    a, b, c = torch.randn(8, 4), torch.randn(6), torch.randn(3)
    ga, gb, gc = torch.randn(8, 4), torch.randn(6), torch.randn(3)
    da, db = shard(a, m, placements_for(m, 0)), shard(b, m, placements_for(m, 0))
    pc = c.clone()
    with mf.patched():
        torch._foreach_add_([da, db, pc], [ga, gb, gc], alpha=0.5)  # plain grads for DTensor params; a plain row
        close(da, a + 0.5 * ga, "foreach add_ row 0")
        close(db, b + 0.5 * gb, "foreach add_ row 1")
        close(pc, c + 0.5 * gc, "foreach add_ plain row")
        assert type(pc) is torch.Tensor

        lr = torch.tensor(0.25)  # tensor scalar
        torch._foreach_mul_([da, db, pc], lr)
        close(da, (a + 0.5 * ga) * 0.25, "foreach mul_ by tensor scalar")

        outs = torch._foreach_mul([da, pc], [ga, gc])  # out-of-place, results in the original order
        close(outs[0], (a + 0.5 * ga) * 0.25 * ga, "foreach mul row 0")
        close(outs[1], (c + 0.5 * gc) * 0.25 * gc, "foreach mul plain row")

        x, y = torch.randn(8, 4), torch.randn(8, 4)
        before = da.full_tensor()
        scalars = torch.tensor([2.0, 3.0])  # one scalar per row
        t1, t2 = torch.randn(6), torch.randn(6)
        before_b = db.full_tensor()
        torch._foreach_addcdiv_([da, db], [x, t1], [y.abs() + 1, t2.abs() + 1], scalars)
        close(da, before + 2.0 * x / (y.abs() + 1), "foreach addcdiv_ with per-row scalars, row 0")
        close(db, before_b + 3.0 * t1 / (t2.abs() + 1), "foreach addcdiv_ with per-row scalars, row 1")

        if world_size == 4:  # parameters on two different meshes in one foreach call
            p_dp = shard(torch.ones(4), m["dp"], [Shard(0)])
            p_tp = shard(torch.ones(6), m["tp"], [Shard(0)])
            g_dp, g_tp = torch.arange(4.0), torch.arange(6.0)
            torch._foreach_add_([p_dp, p_tp], [g_dp, g_tp])
            close(p_dp, 1 + g_dp, "two meshes: dp row")
            close(p_tp, 1 + g_tp, "two meshes: tp row")
    return "ok"


def test_foreach_mixed_lists_tensor_scalars_and_meshes(world_size):
    assert run_on_ranks(foreach_direct, world_size, world_size=world_size) == ["ok"] * world_size



def foreach_written_plain_row(world_size):
    """An in-place foreach whose one plain tensor written into sits in row 1 (a Keras 3.16 optimizer slot of a
    weight the layout map leaves plain): that row runs on whole values, the sharded rows beside it stay sharded
    (no all-gather; before, every row's sharded operand was gathered whole). Values against one process; the
    collectives counted: the row-1 Partial gradient's all-reduce (one per mesh dim) and nothing else."""
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor.debug import CommDebugMode

    m = mesh_for(world_size)
    torch.manual_seed(5)
    # the fourth draw is unused: drawn still, so that the values drawn after it stay the same
    slot, grad, plain_slot, _ = torch.randn(8, 6), torch.randn(8, 6), torch.randn(6), torch.randn(6)
    d_slot = shard(slot, m, placements_for(m, 1))  # the moment of a column-sharded kernel
    d_grad = shard(grad, m, placements_for(m, 1))
    # the bias gradient of a row-sharded layer: each rank holds a summand (Partial on every mesh dim)
    pieces = [torch.randn(6) for _ in range(m.size())]
    d_bias_grad = DTensor.from_local(pieces[torch.distributed.get_rank()].clone(), m, [Partial()] * m.ndim,
                                     run_check=False)
    kept = plain_slot.clone()
    with mf.patched(), CommDebugMode() as comms:
        torch._foreach_add_([d_slot, kept], [d_grad, d_bias_grad], alpha=0.5)
    counts = {str(op).split(".")[-1]: n for op, n in comms.get_comm_counts().items()}
    close(d_slot, slot + 0.5 * grad, "foreach add_ sharded row")
    torch.testing.assert_close(kept, plain_slot + 0.5 * sum(pieces), msg="foreach add_ into the plain row")
    assert type(kept) is torch.Tensor
    assert counts == {"all_reduce": m.ndim}, counts  # the sharded row moved nothing
    return "ok"


def test_foreach_gathers_only_the_rows_that_write_a_plain_tensor(world_size):
    assert run_on_ranks(foreach_written_plain_row, world_size, world_size=world_size) == ["ok"] * world_size

class _ScaleInBackward(torch.autograd.Function):
    """Forward is pure DTensor; backward multiplies the DTensor gradient by a plain tensor."""

    @staticmethod
    def forward(ctx, x, plain_scale):
        ctx.plain_scale = plain_scale
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.plain_scale, None


def backward_only(world_size):
    import keras_dtensor_mixfix as mf

    m = mesh_for(world_size)
    torch.manual_seed(3)
    w, scale = torch.randn(8, 4), torch.randn(8, 4)
    dw = shard(w, m, placements_for(m, 0), True)
    rw = w.clone().requires_grad_()
    _ScaleInBackward.apply(rw, scale).sum().backward()
    with mf.patched():
        y = _ScaleInBackward.apply(dw, scale)  # no mixed op in forward
        assert mf.stats() == {}
        y.sum().backward()
        ops = mf.stats()
    close(dw.grad, rw.grad, "grad from a mixed op that only exists in backward")

    # indexing with a plain index tensor: IndexBackward builds index_put with plain indices
    idx = torch.tensor([0, 3, 5, 7, 3])
    dv = shard(w, m, placements_for(m, 1), True)
    rv = w.clone().requires_grad_()
    (rv[idx] * 2).sum().backward()
    with mf.patched():
        picked = dv[idx]
        (picked * 2).sum().backward()
    close(picked, w[idx], "index with plain indices")
    close(dv.grad, rv.grad, "index backward")
    return sorted(ops)


def test_mixed_op_that_only_appears_in_backward(world_size):
    ops = run_on_ranks(backward_only, world_size, world_size=world_size)[0]
    assert ops == ["aten::mul.Tensor"], ops


def plain_grad_paths(world_size):
    """A plain tensor used by mixed and plain ops, leaf and non-leaf: plain .grad, reference value."""
    import keras_dtensor_mixfix as mf

    m = mesh_for(world_size)
    torch.manual_seed(4)
    w, x0 = torch.randn(8, 4), torch.randn(8, 4)
    dw = shard(w, m, placements_for(m, 0))
    leaf = x0.clone().requires_grad_()
    rleaf = x0.clone().requires_grad_()
    rh = rleaf.tanh()
    (((w * rh) + rh * 3).sum() + (w * rleaf).pow(2).sum()).backward()
    with mf.patched():
        h = leaf.tanh()  # a plain non-leaf
        loss = ((dw * h) + h * 3).sum() + (dw * leaf).pow(2).sum()  # mixed and plain uses of the same tensors
        loss.backward()
    plain_grad(leaf, rleaf.grad, "plain leaf used by mixed and plain ops")
    return "ok"


def test_plain_tensors_that_require_grad_get_plain_reference_gradients(world_size):
    assert run_on_ranks(plain_grad_paths, world_size, world_size=world_size) == ["ok"] * world_size

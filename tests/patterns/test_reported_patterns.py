"""The mixed-operand failures users report, each right (values and gradients = one process) or refused with
advice that works when followed, on real gloo meshes: (2,) on 2 ranks, ("dp", "tp") = (2, 2) on 4.

- class-weighted / ``ignore_index`` / label-smoothed mean losses over logits split along the batch
  (DTensor alone averages each rank's own mean: ``repros/torch_nll_loss_weighted_mean.py``);
- ``scatter_add`` and ``scatter_add_``: promoted where DTensor computes them right, refused where not;
- boolean-mask indexing with a plain mask (``x[mask]``, ``x[:, mask]``);
- DTensors on two meshes over the same ranks (``clip_grad_norm_`` over parameters on two meshes);
- the advice of each refusal, followed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from _ranks import close, mesh_for, shard
from keras_dtensor_mixfix.testing import run_on_ranks


def _error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - returned for inspection
        return exc
    return None


def _batch_layouts(m):
    """Placements splitting a tensor's dim 0 (the batch): over every mesh dim, and over the last only."""
    from torch.distributed.tensor import Replicate, Shard

    if m.ndim == 1:
        return [[Shard(0)]]
    return [[Shard(0), Shard(0)], [Replicate(), Shard(0)], [Shard(0), Replicate()]]


# --------------------------------------------------------------------------- losses


def weighted_losses(world_size):
    import keras_dtensor_mixfix as mf

    m = mesh_for(world_size)
    torch.manual_seed(0)
    cases = []
    classes = 5
    weight = torch.rand(classes) + 0.1
    for rows in (8, 7):  # 7: uneven shards (DTensor's own mean refuses those)
        logits = torch.randn(rows, classes)
        labels = torch.randint(0, classes, (rows,))
        ignored = labels.clone()
        ignored[: rows // 2 - 1] = -100  # more ignored rows on the first ranks
        calls = {
            "nll weight": lambda x: F.nll_loss(F.log_softmax(x, -1), labels, weight=weight),
            "ce weight": lambda x: F.cross_entropy(x, labels, weight=weight),
            "ce ignore_index": lambda x: F.cross_entropy(x, ignored),
            "ce weight ignore_index smoothing": lambda x: F.cross_entropy(x, ignored, weight=weight,
                                                                          label_smoothing=0.1),
            "ce sum": lambda x: F.cross_entropy(x, ignored, weight=weight, reduction="sum"),
            "ce none": lambda x: F.cross_entropy(x, ignored, weight=weight, reduction="none"),
        }
        for name, call in calls.items():
            reference_input = logits.clone().requires_grad_()
            reference = call(reference_input)
            reference.sum().backward()
            for placements in _batch_layouts(m):
                x = shard(logits, m, placements, requires_grad=True)
                with mf.patched():
                    loss = call(x)
                    loss.sum().backward()
                what = f"{name}, {rows} rows, {placements}"
                close(loss, reference.detach(), f"{what}: loss")
                close(x.grad, reference_input.grad, f"{what}: gradient")
                cases.append(what)
    # 2-D targets (nll_loss2d): a (N, C, H, W) input split along N and along H
    from torch.distributed.tensor import Shard

    image = torch.randn(4, 3, 4, 2)
    target = torch.randint(0, 3, (4, 4, 2))
    target[0] = -100
    class_weight = torch.rand(3) + 0.1
    reference_input = image.clone().requires_grad_()
    reference = F.cross_entropy(reference_input, target, weight=class_weight)
    reference.backward()
    for dim in (0, 2):
        x = shard(image, m, [Shard(dim)] * m.ndim if m.ndim == 1 else [Shard(0), Shard(dim)], requires_grad=True)
        with mf.patched():
            loss = F.cross_entropy(x, target, weight=class_weight)
            loss.backward()
        close(loss, reference.detach(), f"nll_loss2d split along {dim}: loss")
        close(x.grad, reference_input.grad, f"nll_loss2d split along {dim}: gradient")
        cases.append(f"2d {dim}")
    return cases


def test_weighted_and_ignore_index_mean_losses_over_batch_split_logits_equal_one_process(world_size):
    cases = run_on_ranks(weighted_losses, world_size, world_size=world_size)[0]
    assert len(cases) == 2 * 6 * (1 if world_size == 2 else 3) + 2, cases


def elementwise_losses(world_size):
    import keras_dtensor_mixfix as mf

    m = mesh_for(world_size)
    torch.manual_seed(0)
    calls = {
        "mse": lambda x, t: F.mse_loss(x, t),
        "huber": lambda x, t: F.huber_loss(x, t, delta=0.5),
        "smooth_l1": lambda x, t: F.smooth_l1_loss(x, t, beta=0.5),
        "soft_margin": lambda x, t: F.soft_margin_loss(x, t.sign()),
        "bce": lambda x, t: F.binary_cross_entropy(x.sigmoid(), t.sigmoid()),
        "bce weight": lambda x, t: F.binary_cross_entropy(x.sigmoid(), t.sigmoid(), weight=torch.linspace(0.5, 1, 3)),
        "bce logits": lambda x, t: F.binary_cross_entropy_with_logits(x, t.sigmoid()),
        "bce logits pos_weight": lambda x, t: F.binary_cross_entropy_with_logits(
            x, t.sigmoid(), weight=torch.linspace(0.5, 1, 3), pos_weight=torch.linspace(2, 0.5, 3)),
        "mse sum": lambda x, t: F.mse_loss(x, t, reduction="sum"),
    }
    cases = []
    for rows in (8, 7):  # 7: uneven shards
        x, t = torch.randn(rows, 3), torch.randn(rows, 3)
        for name, call in calls.items():
            reference_input = x.clone().requires_grad_()
            reference = call(reference_input, t)
            reference.backward()
            for placements in _batch_layouts(m):
                dx = shard(x, m, placements, requires_grad=True)
                with mf.patched():
                    loss = call(dx, t)
                    loss.backward()
                what = f"{name}, {rows} rows, {placements}"
                close(loss, reference.detach(), f"{what}: loss")
                close(dx.grad, reference_input.grad, f"{what}: gradient")
                cases.append(what)
    return cases


def test_elementwise_losses_mean_over_a_split_batch_value_and_gradient_equal_one_process(world_size):
    cases = run_on_ranks(elementwise_losses, world_size, world_size=world_size)[0]
    assert len(cases) == 2 * 9 * (1 if world_size == 2 else 3), cases


def writes_into_plain(world_size):
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import Replicate, Shard

    m = mesh_for(world_size)
    torch.manual_seed(0)
    base = torch.randn(4, 4)
    split = lambda d: [Replicate()] * (m.ndim - 1) + [Shard(d)]  # noqa: E731
    index, src = torch.randint(0, 4, (4, 4)), torch.randn(4, 4)
    rows, rows_src = torch.tensor([3, 0, 3, 1]), torch.randn(4, 4)
    mask = torch.rand(4, 4) > 0.5
    cases = {
        "scatter_add_": (lambda t, i, s: t.scatter_add_(0, i, s), (index, src)),
        "index_add_": (lambda t, i, s: t.index_add_(1, i, s, alpha=2), (rows, rows_src)),
        "index_copy_": (lambda t, i, s: t.index_copy_(0, i, s), (torch.tensor([2, 0, 3, 1]), rows_src)),
        "masked_fill_": (lambda t, i, s: t.masked_fill_(i, 7.0), (mask, None)),
    }
    done = []
    for name, (call, (first, second)) in cases.items():
        expected = call(base.clone(), first, second)
        for dim in (0, 1):
            plain = base.clone()
            operands = [shard(first, m, split(dim) if first.ndim > dim else split(0)),
                        None if second is None else shard(second, m, split(dim))]
            with mf.patched():
                result = call(plain, *operands)
            assert result is plain
            torch.testing.assert_close(plain, expected, msg=lambda text: f"{name}, operands split on {dim}: {text}")
            done.append(f"{name} {dim}")
    return done


def test_an_op_writing_into_a_plain_tensor_from_split_operands_writes_the_whole_result(world_size):
    done = run_on_ranks(writes_into_plain, world_size, world_size=world_size)[0]
    assert len(done) == 8, done


# --------------------------------------------------------------------------- scatter_add


def scatter_cases(world_size):
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import Replicate, Shard

    m = mesh_for(world_size)
    torch.manual_seed(0)
    split = lambda d: [Replicate()] * (m.ndim - 1) + [Shard(d)]  # noqa: E731
    base = torch.randn(4, 6)
    results = {}
    for dim in (0, 1):
        index = torch.randint(0, base.shape[dim], (4, 6))
        src = torch.randn(4, 6)
        expected = base.scatter_add(dim, index, src)
        for split_dim in (0, 1):
            x = shard(base, m, split(split_dim))
            with mf.patched():
                out = x.scatter_add(dim, index, src)  # out of place: DTensor computes it right
            close(out, expected, f"scatter_add dim {dim}, split {split_dim}")
            x = shard(base, m, split(split_dim))
            with mf.patched():
                error = _error(lambda: x.scatter_add_(dim, index, src))
            if split_dim == dim:
                # in place along the split dim: refused; the advice (out of place) followed
                results[f"inplace {dim}"] = str(error)
                assert isinstance(error, mf.MixedOperandError), error
                assert "out-of-place scatter_add" in str(error), error
                with mf.patched():
                    x = x.scatter_add(dim, index, src)
                close(x, expected, "scatter_add_ advice followed")
            else:
                assert error is None, error
                close(x, expected, f"scatter_add_ dim {dim}, split {split_dim}")
    # in place into a tensor split along a dim the index is smaller on (DTensor writes a local-shaped result)
    tall = torch.randn(10, 5)
    small_index, small_src = torch.randint(0, 5, (5, 5)), torch.randn(5, 5)
    x = shard(tall, m, split(0))
    with mf.patched():
        error = _error(lambda: x.scatter_add_(1, small_index, small_src))
        assert isinstance(error, mf.MixedOperandError) and "out-of-place scatter_add" in str(error), error
        x = x.scatter_add(1, small_index, small_src)  # the advice
    close(x, tall.scatter_add(1, small_index, small_src), "scatter_add_ smaller index: advice followed")
    # src larger than the index along the split dim: DTensor would split src at other rows
    index = torch.randint(0, 6, (4, 6))
    src = torch.randn(8, 6)
    expected = base.scatter_add(1, index, src)
    x = shard(base, m, split(0))
    with mf.patched():
        error = _error(lambda: x.scatter_add(1, index, src))
        assert isinstance(error, mf.MixedOperandError) and "Narrow src" in str(error), error
        results["misaligned"] = str(error)
        out = x.scatter_add(1, index, src[tuple(slice(0, n) for n in index.shape)])  # the advice
    close(out, expected, "scatter_add misaligned src, advice followed")
    return results


def test_scatter_add_is_promoted_where_dtensor_is_right_and_refused_with_working_advice_where_not(world_size):
    results = run_on_ranks(scatter_cases, world_size, world_size=world_size)[0]
    assert "inplace 0" in results and "inplace 1" in results and "misaligned" in results, results


# --------------------------------------------------------------------------- boolean masks


def mask_cases(world_size):
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import Replicate, Shard

    m = mesh_for(world_size)
    torch.manual_seed(0)
    x = torch.randn(8, 6, 4)
    row_mask, grid_mask, column_mask = torch.rand(8) > 0.5, torch.rand(8, 6) > 0.5, torch.rand(6) > 0.4
    calls = {"x[rows]": (lambda t: t[row_mask], {0}), "x[grid]": (lambda t: t[grid_mask], {0, 1}),
             "x[:, columns]": (lambda t: t[:, column_mask], {1})}
    ran, refused = [], []
    for name, (call, indexed) in calls.items():
        reference_input = x.clone().requires_grad_()
        reference = call(reference_input)
        weights = torch.arange(reference.numel(), dtype=torch.float32).reshape(reference.shape)
        (reference * weights).sum().backward()
        for split_dim in (None, 0, 1, 2):
            placements = ([Replicate()] * m.ndim if split_dim is None
                          else [Replicate()] * (m.ndim - 1) + [Shard(split_dim)])
            dx = shard(x, m, placements, requires_grad=True)
            what = f"{name} split {split_dim}"
            if split_dim in indexed:
                with mf.patched():
                    error = _error(lambda: call(dx))
                assert isinstance(error, mf.MixedOperandError) and "redistribute" in str(error), (what, error)
                dx = dx.redistribute(m, [Replicate()] * m.ndim)  # the advice
                refused.append(what)
            with mf.patched():
                out = call(dx)
                (out * weights).sum().backward()
            close(out, reference.detach(), f"{what}: value")
            grad = dx.grad if dx.is_leaf else None
            if grad is not None:
                close(grad, reference_input.grad, f"{what}: gradient")
            ran.append(what)
    return ran, refused


def test_boolean_mask_indexing_with_a_plain_mask_runs_on_local_pieces(world_size):
    ran, refused = run_on_ranks(mask_cases, world_size, world_size=world_size)[0]
    assert len(ran) == 12 and len(refused) == 4, (ran, refused)


# --------------------------------------------------------------------------- two meshes


def two_mesh_cases(world_size):
    import keras_dtensor_mixfix as mf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    m = mesh_for(world_size)
    experts = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))  # the same ranks, another mesh
    torch.manual_seed(0)
    # a parameter split on the op's mesh, one split on the experts' mesh, one replicated, one plain (a norm weight)
    weights = [torch.randn(4, 6), torch.randn(8, 4), torch.randn(6), torch.randn(5)]
    grads = [torch.randn(4, 6), torch.randn(8, 4), torch.randn(6), torch.randn(5)]
    out = {}
    for foreach in (False, True):
        reference = [torch.nn.Parameter(w.clone()) for w in weights]
        for p, g in zip(reference, grads):
            p.grad = g.clone()
        reference_norm = torch.nn.utils.clip_grad_norm_(reference, 1.0, foreach=foreach)
        layouts = [(m, [Replicate()] * (m.ndim - 1) + [Shard(0)]), (experts, [Shard(0)]), (m, [Replicate()] * m.ndim),
                   (None, None)]
        params = []
        for (mesh, placements), w, g in zip(layouts, weights, grads):
            p = torch.nn.Parameter(w.clone() if mesh is None else shard(w, mesh, placements))
            p.grad = g.clone() if mesh is None else shard(g, mesh, placements)
            params.append(p)
        kernel = {"foreach": True} if foreach else {"fused": True}  # AdamW's two list kernels
        with mf.patched():
            norm = torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=foreach)
            torch.optim.AdamW(params, lr=0.1, **kernel).step()
        torch.optim.AdamW(reference, lr=0.1, **kernel).step()
        close(norm, reference_norm, f"clip foreach={foreach}: norm")
        for index, (p, r) in enumerate(zip(params, reference)):
            close(p.grad, r.grad, f"clip foreach={foreach}: grad {index}")
            close(p, r, f"AdamW {kernel}: parameter {index}")
        # without the package (workers run unpatched outside patched()), torch refuses the same program
        unpatched = [torch.nn.Parameter(shard(w, mesh, placements))
                     for (mesh, placements), w in zip(layouts[:3], weights)]
        for p, g, (mesh, placements) in zip(unpatched, grads, layouts):
            p.grad = shard(g, mesh, placements)
        error = _error(lambda: torch.nn.utils.clip_grad_norm_(unpatched, 1.0, foreach=foreach))  # not patched here
        out[f"unpatched {foreach}"] = f"{type(error).__name__}: {error}"

    # a Replicate and a Partial value on another mesh meet the op's mesh like plain tensors, with gradients
    a_value, b_value = torch.randn(4, 6), torch.randn(6)
    ra, rb = a_value.clone().requires_grad_(), b_value.clone().requires_grad_()
    (ra * rb).sum().backward()
    a = shard(a_value, m, [Replicate()] * (m.ndim - 1) + [Shard(0)], requires_grad=True)
    b = shard(b_value, experts, [Replicate()], requires_grad=True)
    with mf.patched():
        product = a * b
        product.sum().backward()
        partial = shard(torch.randn(6), experts, [Shard(0)]).sum()  # Partial on the experts' mesh
        total = a.sum() + partial
    close(product, (ra * rb).detach(), "Replicate on another mesh: value")
    close(a.grad, ra.grad, "Replicate on another mesh: gradient of the op's DTensor")
    close(b.grad, rb.grad, "Replicate on another mesh: its own gradient")
    assert isinstance(partial, DTensor) and partial.placements[0].is_partial(), partial.placements
    close(total, a_value.sum() + partial.full_tensor(), "Partial on another mesh")
    # a DTensor sharded on the other mesh is torch's business: its own error, patched or not
    sharded = shard(torch.randn(4, 6), experts, [Shard(1)])
    with mf.patched():
        patched_error = _error(lambda: a + sharded)
    plain_error = _error(lambda: a + sharded)
    out["sharded other mesh"] = (str(patched_error), str(plain_error))
    # a plain operand next to DTensors on two meshes, one sharded on the other: a clear error, advice followed
    with mf.patched():
        error = _error(lambda: torch.ops.aten.addcmul.default(a, sharded, torch.randn(4, 6)))
        assert isinstance(error, mf.MixedOperandError) and "same ranks" in str(error), error
        fixed = torch.ops.aten.addcmul.default(a, sharded.redistribute(experts, [Replicate()]), torch.ones(4, 6))
    close(fixed, a_value + sharded.full_tensor(), "two meshes: advice followed")
    out["mixed two meshes"] = str(error)
    return out


def test_dtensors_on_two_meshes_over_the_same_ranks_clip_and_step_like_one_process(world_size):
    out = run_on_ranks(two_mesh_cases, world_size, world_size=world_size)[0]
    for foreach in (False, True):
        assert "same mesh" in out[f"unpatched {foreach}"] or "different meshes" in out[f"unpatched {foreach}"], out
    patched_error, plain_error = out["sharded other mesh"]
    assert patched_error == plain_error and "mesh" in plain_error, out["sharded other mesh"]


def one_mesh_two_objects(world_size):
    import keras_dtensor_mixfix as mf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    names = ("dp", "tp") if world_size == 4 else ("tp",)
    shape = (2, 2) if world_size == 4 else (2,)
    one, other = (init_device_mesh("cpu", shape, mesh_dim_names=names) for _ in range(2))
    assert one is not other and one == other  # torch builds a new object each time (submeshes too)
    if world_size == 4:
        one, other = one["tp"], other["tp"]
    torch.manual_seed(0)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    results = []
    for patched in (False, True):
        a, b = shard(x, one, [Shard(0)]), shard(y, other, [Replicate()])
        if patched:
            with mf.patched():
                out = [a * b, torch.stack([a, b]), torch.ops.aten.addcmul.default(a, b, b)]
                promoted = mf.stats()
        else:
            out = [a * b, torch.stack([a, b]), torch.ops.aten.addcmul.default(a, b, b)]
        results.append([(o.placements, o.to_local()) for o in out])
    for (placements, local), (patched_placements, patched_local) in zip(*results):
        assert placements == patched_placements and torch.equal(local, patched_local)
    return promoted


def test_dtensors_on_two_objects_of_one_mesh_run_torchs_own_path(world_size):
    for promoted in run_on_ranks(one_mesh_two_objects, world_size, world_size=world_size):
        assert promoted == {}, promoted


# --------------------------------------------------------------------------- advice of other refusals


_lib = torch.library.Library("mixfix_patterns", "DEF")
_lib.define("fused(Tensor a, Tensor b) -> Tensor")
_lib.impl("fused", lambda a, b: a * 2 + b, "CompositeExplicitAutograd")


def _batch_norm_cases(mf, m, x):
    from torch.distributed.tensor import Replicate, Shard

    expected = [torch.zeros(6), torch.ones(6)]
    reference = torch.ops.aten._batch_norm_with_update(x, torch.ones(6), torch.zeros(6), *expected, 0.1, 1e-5)
    split_channels = [Replicate()] * (m.ndim - 1) + [Shard(1)]
    stats = [torch.zeros(6), torch.ones(6)]
    with mf.patched():
        got = torch.ops.aten._batch_norm_with_update(shard(x, m, split_channels), torch.ones(6), torch.zeros(6),
                                                     *stats, 0.1, 1e-5)
    close(got[0], reference[0], "batch norm, plain statistics: output")
    close(stats[0], expected[0], "batch norm, plain statistics: running mean")
    close(stats[1], expected[1], "batch norm, plain statistics: running var")
    replicate = [Replicate()] * m.ndim
    stats = [shard(torch.zeros(6), m, replicate), shard(torch.ones(6), m, replicate)]
    dx = shard(x, m, split_channels)
    with mf.patched():
        error = _error(lambda: torch.ops.aten._batch_norm_with_update(dx, torch.ones(6), torch.zeros(6), *stats,
                                                                      0.1, 1e-5))
        assert isinstance(error, mf.MixedOperandError) and "channel dim" in str(error), error
        dx = dx.redistribute(m, [Replicate()] * (m.ndim - 1) + [Shard(0)])  # the advice: split the batch
        got = torch.ops.aten._batch_norm_with_update(dx, torch.ones(6), torch.zeros(6), *stats, 0.1, 1e-5)
    close(got[0], reference[0], "batch norm: advice followed, output")
    close(stats[0], expected[0], "batch norm: advice followed, running mean")
    close(stats[1], expected[1], "batch norm: advice followed, running var")


def advice_cases(world_size):
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import Replicate, Shard

    m = mesh_for(world_size)
    torch.manual_seed(0)
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    da = shard(a, m, [Replicate()] * (m.ndim - 1) + [Shard(0)])
    with mf.patched():
        error = _error(lambda: torch.ops.mixfix_patterns.fused(da, b))
    assert isinstance(error, mf.MixedOperandError) and "full_tensor()" in str(error), error
    assert "'local'" not in str(error), error  # a 'local' rule would fail the same way
    with mf.patched():
        out = torch.ops.mixfix_patterns.fused(da.full_tensor(), b)  # the advice
    close(out, a * 2 + b, "no strategy: advice followed")
    # what the error advised against: the 'local' rule fails again
    with mf.patched(), mf.register_rule("mixfix_patterns::fused", "local"):
        again = _error(lambda: torch.ops.mixfix_patterns.fused(da, da.to_local().clone()))
    assert isinstance(again, mf.MixedOperandError), again
    # a training batch norm with its input split along channels: right where the running statistics are plain
    # (the op then runs on whole values); refused where they are DTensors, and the advice followed works. On a
    # torch whose DTensor has no batch norm strategy at all (2.12), the patched call says so instead.
    x = torch.randn(4, 6, 5)
    replicate = [Replicate()] * m.ndim
    whole = [shard(t, m, replicate) for t in (x, torch.ones(6), torch.zeros(6), torch.zeros(6), torch.ones(6))]
    if _error(lambda: torch.ops.aten._batch_norm_with_update(*whole, 0.1, 1e-5)) is not None:
        with mf.patched():
            error = _error(lambda: torch.ops.aten._batch_norm_with_update(whole[0], torch.ones(6), torch.zeros(6),
                                                                          torch.zeros(6), torch.ones(6), 0.1, 1e-5))
        assert isinstance(error, mf.MixedOperandError) and "any layout" in str(error), error
    else:
        _batch_norm_cases(mf, m, x)
    # addmv_ into a DTensor: refused; the out-of-place addmv runs right. Into a plain vector: right.
    vector, matrix, by = torch.randn(6), torch.randn(6, 10), torch.randn(10)
    expected = torch.addmv(vector, matrix, by)
    for split_dim in (0, 1):
        target = shard(vector, m, replicate)
        split_matrix = shard(matrix, m, [Replicate()] * (m.ndim - 1) + [Shard(split_dim)])
        with mf.patched():
            error = _error(lambda: target.addmv_(split_matrix, by))
            assert isinstance(error, mf.MixedOperandError) and "out-of-place addmv" in str(error), error
            out = torch.addmv(target, split_matrix, by)  # the advice
            plain = vector.clone()
            plain.addmv_(split_matrix, by)
        close(out, expected, f"addmv, matrix split on {split_dim}: advice followed")
        close(plain, expected, f"addmv_ into a plain vector, matrix split on {split_dim}")
    return True


def test_refusals_advice_followed_works(world_size):
    assert run_on_ranks(advice_cases, world_size, world_size=world_size) == [True] * world_size

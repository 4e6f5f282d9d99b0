"""The direct plan: after the first call of a shape, a mixed call runs the op on the local
tensors and wraps the result as DTensor would, without re-dispatching.

Every case is called three times: the first call re-dispatches (and decides), the later ones take
the plan. Each call is compared with the single-process reference on plain tensors, and the later
calls with the first one bit for bit (local values and the whole spec), on 2- and 4-rank meshes.
"""

from __future__ import annotations

import pytest
import torch

from _ranks import close, mesh_for, plain_grad, shard
from keras_dtensor_mixfix.testing import run_on_ranks


def _plans(op):
    """The direct plans the fast path holds for ``op`` (``_UNDECIDED`` entries excluded)."""
    from keras_dtensor_mixfix._engine.caches import CACHES
    from keras_dtensor_mixfix._engine.opstate import UNDECIDED

    info = CACHES.op_states.get(id(op))
    if info is None:
        return []
    return [entry.direct for entry in info.fast.values() if entry.direct is not UNDECIDED]


def _placements(m, kind):
    from torch.distributed.tensor import Partial, Replicate, Shard

    last = {"S0": Shard(0), "S1": Shard(1), "R": Replicate(), "P": Partial()}[kind]
    if m.ndim == 2:
        # the other mesh dim shards rows too where it can, so 2-D meshes mix placements
        first = Shard(0) if kind in ("S1", "R") else Replicate()
        return [first, last]
    return [last]


def _peer(m, full, kind):
    from torch.distributed.tensor import DTensor, Partial, Replicate

    placements = _placements(m, kind)
    if kind == "P":
        # Partial(sum) on the last mesh dim: each rank there holds full / size, summing to ``full``
        whole = [Replicate() if isinstance(p, Partial) else p for p in placements]
        local = shard(full, m, whole).to_local() / m.size(m.ndim - 1)
        return DTensor.from_local(local, m, placements, run_check=False, shape=full.shape, stride=full.stride())
    return shard(full, m, placements)


# name: (peer shape, peer placement kind, plain factory, function, plain on the left, expect direct)
CASES = {
    "mul same shape Shard(0)": ((8, 6), "S0", lambda: torch.randn(8, 6), lambda d, p: d * p, False, True),
    "add plain on the left": ((8, 6), "S0", lambda: torch.randn(8, 6), lambda d, p: p + d, True, True),
    "sub Shard(1)": ((8, 6), "S1", lambda: torch.randn(8, 6), lambda d, p: d - p, False, True),
    "div Replicate": ((8, 6), "R", lambda: torch.rand(8, 6) + 0.5, lambda d, p: d / p, False, True),
    "uneven rows (5 over the mesh)": ((5, 3), "S0", lambda: torch.randn(5, 3), lambda d, p: d * p, False, True),
    "broadcast row vector": ((8, 6), "S1", lambda: torch.randn(6), lambda d, p: d + p, False, True),
    "broadcast column": ((8, 6), "S0", lambda: torch.randn(8, 1), lambda d, p: d * p, False, True),
    "plain larger than the DTensor": ((6,), "S0", lambda: torch.randn(4, 6), lambda d, p: d * p, False, True),
    "transposed plain": ((8, 6), "S0", lambda: torch.randn(6, 8).t(), lambda d, p: d * p, False, True),
    "float64 plain": ((8, 6), "S0", lambda: torch.randn(8, 6, dtype=torch.float64), lambda d, p: d * p, False, True),
    "int64 plain": ((8, 6), "S0", lambda: torch.randint(-3, 4, (8, 6)), lambda d, p: d + p, False, True),
    "eq (bool result)": ((8, 6), "S0", lambda: torch.randint(0, 2, (8, 6)).float(),
                         lambda d, p: (d > 0).float() == p, False, True),
    "maximum": ((8, 6), "S1", lambda: torch.randn(8, 6), lambda d, p: torch.maximum(d, p), False, True),
    "atan2 plain first": ((8, 6), "S0", lambda: torch.randn(8, 6), lambda d, p: torch.atan2(p, d), True, True),
    "pow": ((8, 6), "S0", lambda: torch.rand(8, 6) * 2, lambda d, p: d.abs() ** p, False, True),
    "mul Partial": ((8, 6), "P", lambda: torch.randn(8, 6), lambda d, p: d * p, False, None),
    # Partial + Replicate must be redistributed (the sum would count the plain operand per rank)
    "add Partial": ((8, 6), "P", lambda: torch.randn(8, 6), lambda d, p: d + p, False, False),
    "in-place mul_": ((8, 6), "S0", lambda: torch.randn(8, 6), lambda d, p: d.clone().mul_(p), False, True),
    "copy_ a full tensor into a shard": ((8, 6), "S1", lambda: torch.randn(8, 6),
                                         lambda d, p: d.clone().copy_(p), False, True),
    # kwargs (alpha) keep the re-dispatch: the plan covers two positional arguments only
    "add with alpha": ((8, 6), "S0", lambda: torch.randn(8, 6), lambda d, p: torch.add(d, p, alpha=0.5), False, False),
    # not elementwise: replicated plain operand, DTensor's own mm strategy
    "mm": ((8, 6), "S0", lambda: torch.randn(6, 4), lambda d, p: d @ p, False, None),
}


def direct_case(world_size, name):
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import DTensor

    shape, kind, make_plain, fn, _, expect_direct = CASES[name]
    m = mesh_for(world_size)
    torch.manual_seed(7)
    full = torch.randn(shape)
    plain = make_plain()
    expected = fn(full, plain)
    results = []
    with mf.patched():
        for _ in range(3):
            peer = _peer(m, full, kind)
            out = fn(peer, plain)
            assert type(out) is DTensor
            close(out, expected, name)
            results.append(out)
        plans = [plan for op in _ops_of(mf.stats()) for plan in _plans(op)]
        direct = any(plan is not None for plan in plans)
    first = results[0]
    for later in results[1:]:
        assert later._spec == first._spec, (name, later._spec, first._spec)
        assert later.placements == first.placements
        assert later.to_local().stride() == first.to_local().stride(), name
        assert torch.equal(later.to_local(), first.to_local()), name
    if expect_direct is not None:
        assert direct == expect_direct, (name, plans)
    return direct


def _ops_of(stats):
    from keras_dtensor_mixfix._rules.ops import resolve_op

    return [resolve_op(name) for name in stats]


@pytest.mark.parametrize("name", sorted(CASES))
def test_direct_plan_matches_dtensor_and_the_reference(world_size, name):
    run_on_ranks(direct_case, world_size, name, world_size=world_size)


def direct_gradients(world_size):
    """Forward and backward in a loop: later iterations take the plan in both directions
    (backward meets the DTensor gradient with the plain operand: a mixed call too)."""
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import Shard

    m = mesh_for(world_size)
    torch.manual_seed(11)
    w_full, x_full, row = torch.randn(8, 6), torch.randn(8, 6), torch.randn(6)
    rw, rx, rrow = (t.clone().requires_grad_() for t in (w_full, x_full, row))
    ((rw * rx - rrow) / (rx.abs() + 1)).pow(2).sum().backward()

    w = shard(w_full, m, [Shard(0)] * (m.ndim - 1) + [Shard(1)], True)
    x = x_full.clone().requires_grad_()
    r = row.clone().requires_grad_()
    with mf.patched():
        for _ in range(3):
            w.grad = x.grad = r.grad = None
            loss = ((w * x - r) / (x.abs() + 1)).pow(2).sum()
            loss.backward()
            close(w.grad, rw.grad, "grad of the DTensor", atol=1e-5)
            plain_grad(x, rx.grad, "grad of the plain operand")
            plain_grad(r, rrow.grad, "grad of the broadcast plain operand")
        plans = _plans(torch.ops.aten.mul.Tensor) + _plans(torch.ops.aten.sub.Tensor)
    assert plans and all(p is not None for p in plans), plans
    return True


def test_direct_plan_gradients_match_the_reference(world_size):
    assert all(run_on_ranks(direct_gradients, world_size, world_size=world_size))


def plan_refusals(world_size):
    """Calls the plan must leave to DTensor, and a torch whose internals differ."""
    from unittest import mock

    import keras_dtensor_mixfix as mf
    from keras_dtensor_mixfix._engine import direct as _direct
    from torch.distributed.tensor import DTensor, Shard

    m = mesh_for(world_size)
    torch.manual_seed(5)
    full, plain_full = torch.randn(8, 6), torch.randn(8, 6)
    a = shard(full, m, [Shard(0)] * m.ndim if m.ndim == 1 else [Shard(0), Shard(1)])
    b = shard(plain_full, m, a.placements)
    # random ops run under DTensor's RNG tracker
    assert _direct.plan(torch.ops.aten.normal.Tensor_Tensor, (a, b.abs())) is None
    # views, and outputs that are not one tensor
    assert _direct.plan(torch.ops.aten.expand_as.default, (a, b)) is None
    assert _direct.plan(torch.ops.aten.max.dim, (a, 0)) is None
    # the plain elementwise case gets DTensor's own output spec
    assert _direct.plan(torch.ops.aten.mul.Tensor, (a, b)) == (a * b)._spec

    # a propagator that fails: no plan, and the call is still right (re-dispatched)
    def broken(op_info):
        raise RuntimeError("simulated internals change")

    with mock.patch.object(DTensor._op_dispatcher.sharding_propagator, "propagate", broken), mf.patched():
        for _ in range(3):
            close(a * plain_full, full * plain_full, "with a failing propagator")
        assert _plans(torch.ops.aten.mul.Tensor) == [None]

    # a plan that disagrees with what DTensor actually returned is never used
    def wrong(func, args, kwargs):
        return b.t()._spec  # a (6, 8) spec for an (8, 6) result

    with mock.patch.object(_direct, "_plan", wrong), mf.patched():
        for _ in range(3):
            close(a * plain_full, full * plain_full, "with a wrong plan")
        assert _plans(torch.ops.aten.mul.Tensor) == [None]

    # the option turns plans off: every call re-dispatched, same result
    with mf.patched(direct=False):
        for _ in range(3):
            close(a * plain_full, full * plain_full, "with direct=False")
        assert _plans(torch.ops.aten.mul.Tensor) == []

    # unpatch() forgets the plans
    with mf.patched():
        a * plain_full
        a * plain_full
        assert _plans(torch.ops.aten.mul.Tensor)
    assert _plans(torch.ops.aten.mul.Tensor) == []
    return True


def test_direct_plan_refuses_what_it_must_leave_to_dtensor(world_size):
    assert all(run_on_ranks(plan_refusals, world_size, world_size=world_size))


# --------------------------------------------------------------------------- _foreach_* lists


def _foreach_plans(op):
    """The foreach plans held for ``op``: each a (result plan, local pieces) pair, or None."""
    from keras_dtensor_mixfix._engine.caches import CACHES

    info = CACHES.op_states.get(id(op))
    return [] if info is None else list(info.fast.values())


def foreach_direct(world_size):
    """Every row a DTensor (rows with different placements and uneven shapes) meeting plain
    tensors, called repeatedly: the first call decides, later ones run on the local lists.
    Compared with plain foreach calls on the same values each time."""
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import DTensor, Replicate, Shard

    m = mesh_for(world_size)
    torch.manual_seed(13)
    shapes = [(8, 6), (5, 3), (7,), (4, 4)]
    kinds = [[Shard(0)], [Shard(0)], [Shard(0)], [Replicate()]]
    if m.ndim == 2:
        kinds = [[Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(0), Replicate()], [Replicate(), Replicate()]]
    fulls = [torch.randn(s) for s in shapes]
    ref = [t.clone() for t in fulls]
    params = [shard(t, m, k) for t, k in zip(fulls, kinds)]
    aten = torch.ops.aten
    with mf.patched():
        first_results = None
        for step in range(4):
            grads = [torch.randn(s) for s in shapes]
            others = [torch.rand(s) + 0.5 for s in shapes]
            scalars = [0.1 * (step + 1) + i for i in range(len(shapes))]  # change every step, as optimizers' do
            torch._foreach_add_(params, grads, alpha=-0.5)
            torch._foreach_add_(ref, grads, alpha=-0.5)
            torch._foreach_addcdiv_(params, grads, others, scalars)
            torch._foreach_addcdiv_(ref, grads, others, scalars)
            for p, r in zip(params, ref):
                close(p, r, f"in-place foreach, step {step}")
            outs = torch._foreach_mul(grads, params)  # plain list first: the DTensors are the peers
            expected = torch._foreach_mul(grads, ref)
            assert all(type(o) is DTensor for o in outs)
            for o, e in zip(outs, expected):
                close(o, e, f"functional foreach, step {step}")
            if first_results is None:
                first_results = [o._spec for o in outs]
            assert [o._spec for o in outs] == first_results
        plans = (_foreach_plans(aten._foreach_add_.List) + _foreach_plans(aten._foreach_addcdiv_.ScalarList)
                 + _foreach_plans(aten._foreach_mul.List))
    # one plan per op, each taken (not None), despite the scalars changing every step
    assert len(plans) == 3 and all(p is not None for p in plans), plans
    return True


def foreach_refused(world_size):
    """Lists the direct path leaves to the general path: still right every time."""
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import Shard

    m = mesh_for(world_size)
    torch.manual_seed(17)
    a, b, g = torch.randn(8, 6), torch.randn(8, 6), torch.randn(8, 6)
    aten = torch.ops.aten
    with mf.patched():
        # a Partial row: no plan (its sharding could depend on a scalar)
        for _ in range(3):
            out = torch._foreach_mul([_peer(m, a, "P")], [g])
            close(out[0], a * g, "Partial row")
        assert _foreach_plans(aten._foreach_mul.List) == [None]
        # an all-plain row beside a DTensor row: the general path splits them
        d = shard(b, m, [Shard(0)] * m.ndim)
        plain_row = a.clone()
        torch._foreach_add_([d, plain_row], [g, g])
        close(d, b + g, "DTensor row")
        torch.testing.assert_close(plain_row, a + g)
        assert _foreach_plans(aten._foreach_add_.List) == []
        # a plain operand that is written: the general path (it must own its storage)
        target = a.clone()
        torch._foreach_add_([target], [shard(b, m, [Shard(0)] * m.ndim)])
        torch.testing.assert_close(target, a + b)
    return True


def test_foreach_direct_plan_matches_the_reference(world_size):
    assert all(run_on_ranks(foreach_direct, world_size, world_size=world_size))


def test_foreach_lists_the_direct_path_refuses_stay_right(world_size):
    assert all(run_on_ranks(foreach_refused, world_size, world_size=world_size))


def direct_threads(world_size):
    """Threads racing to decide and use plans for the same and different call shapes, from cold
    caches each burst: every result equals the reference computed before the threads start."""
    import threading

    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import Shard

    m = mesh_for(world_size)
    torch.manual_seed(19)
    full = torch.randn(8, 6)
    peer = shard(full, m, [Shard(0)] * (m.ndim - 1) + [Shard(1)])
    plains = [torch.randn(8, 6), torch.randn(6), torch.randn(8, 1), torch.randn(8, 6, dtype=torch.float64)]
    calls = [lambda p: peer * p, lambda p: p - peer, lambda p: peer.clone().add_(p)]
    expected = [[(fn(p)).to_local() for p in plains] for fn in [lambda p: peer * shard_like(p, peer),
                                                               lambda p: shard_like(p, peer) - peer,
                                                               lambda p: peer.clone().add_(shard_like(p, peer))]]
    problems = []

    def work(seed):
        order = [(i, j) for i in range(len(calls)) for j in range(len(plains))]
        for round_ in range(20):
            for i, j in order[seed::2] + order[:seed]:
                try:
                    out = calls[i](plains[j])
                    if not torch.equal(out.to_local(), expected[i][j]):
                        problems.append(f"call {i} plain {j}: wrong value")
                except BaseException as exc:  # noqa: BLE001 - reported below
                    problems.append(repr(exc))

    for _ in range(5):
        with mf.patched():  # cold caches each burst
            threads = [threading.Thread(target=work, args=(seed,)) for seed in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
            used = _plans(torch.ops.aten.mul.Tensor)
    assert not problems, problems[:5]
    assert used and all(p is not None for p in used), used
    return True


def shard_like(plain, peer):
    """``plain`` as the DTensor "replicate" promotes it to next to ``peer`` (built by hand, for references)."""
    from keras_dtensor_mixfix._engine.placements import aligned_placements
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(plain, peer.device_mesh, list(aligned_placements(plain, peer)))


def test_threads_racing_to_decide_plans_get_right_values(world_size):
    assert all(run_on_ranks(direct_threads, world_size, world_size=world_size))

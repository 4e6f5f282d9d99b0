"""P1-P4 (per-op cost of the patch) and the no-target op cases: gradients, foreach optimizers."""

from __future__ import annotations

import gc
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

from timing import SHAPE, Rounds, timed


def per_op(rounds: int, calls: int, plain_calls: int) -> Tuple[Rounds, Dict[str, Any]]:
    """P1-P4 on a 1-D mesh over every rank of the current process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    import keras_dtensor_mixfix as mf

    torch.manual_seed(0)  # every rank builds the same global tensors
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    a = distribute_tensor(torch.randn(SHAPE), mesh, [Shard(0)])
    b = distribute_tensor(torch.randn(SHAPE), mesh, [Shard(0)])
    c = distribute_tensor(torch.randn(SHAPE), mesh, [Shard(0)])
    plain = torch.randn(SHAPE)
    plain2 = torch.randn(SHAPE)

    def pure() -> Any:
        return a * b

    def pure_inplace() -> Any:
        return c.copy_(b)  # an op that writes into an argument: those get a different rule

    def plain_op() -> Any:
        return plain * plain2

    def mixed() -> Any:
        return a * plain

    def implicit() -> float:
        with implicit_replication():
            return timed(mixed, calls)

    extra: Dict[str, Any] = {}
    start = time.perf_counter()
    mf.patch()
    extra["first_patch_ms"] = (time.perf_counter() - start) * 1e3
    # Sanity: the patched mixed op is right.
    torch.testing.assert_close((a * plain).full_tensor(), a.full_tensor() * plain)
    start = time.perf_counter()
    mf.unpatch()
    extra["first_unpatch_ms"] = (time.perf_counter() - start) * 1e3

    # Warm every path once (sharding-propagation caches, our caches).
    for fn in (pure, pure_inplace, plain_op):
        timed(fn, 200)
    with implicit_replication():
        timed(mixed, 200)

    data = Rounds()
    for index in range(rounds):
        halves = ("unpatched", "patched") if index % 2 == 0 else ("patched", "unpatched")
        for half in halves:
            gc.collect()
            dist.barrier()  # on 2 ranks: both time the same half at the same time
            if half == "patched":
                start = time.perf_counter()
                mf.patch()
                data.add("patch() ms", (time.perf_counter() - start) * 1e3)
                timed(mixed, 100)  # refill caches that unpatch() cleared
                data.add("pure patched", timed(pure, calls))
                data.add("pure in-place patched", timed(pure_inplace, calls))
                data.add("plain patched", timed(plain_op, plain_calls))
                data.add("mixed patched", timed(mixed, calls))
                start = time.perf_counter()
                mf.unpatch()
                data.add("unpatch() ms", (time.perf_counter() - start) * 1e3)
            else:
                data.add("pure unpatched", timed(pure, calls))
                data.add("pure in-place unpatched", timed(pure_inplace, calls))
                data.add("plain unpatched", timed(plain_op, plain_calls))
                data.add("mixed implicit_replication", implicit())
    return data, extra


def per_op_on_rank(rounds: int, calls: int, plain_calls: int) -> Tuple[Dict[str, List[float]], Dict[str, Any]]:
    """``per_op`` in a run_on_ranks worker (the figures come back as plain data)."""
    torch.set_num_threads(1)  # two ranks share the two cores
    data, extra = per_op(rounds, calls, plain_calls)
    return data.samples, extra


def per_op_two_ranks(rounds: int, calls: int, plain_calls: int) -> Rounds:
    """The P1-P4 cases on 2 ranks (gloo): ``Shard(0)`` really slices, each rank times its own half.

    Both ranks time at once on the 2 cores; rank 0's figures are reported.
    """
    from keras_dtensor_mixfix.testing import run_on_ranks

    samples, _ = run_on_ranks(per_op_on_rank, rounds, calls, plain_calls, world_size=2, timeout=1800)[0]
    data = Rounds()
    data.samples = samples
    return data




def grad_cases(rounds: int, calls: int) -> Rounds:
    """Forward + backward of a mixed op whose plain operand requires grad."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    import keras_dtensor_mixfix as mf

    mesh = init_device_mesh("cpu", (1,))
    w = distribute_tensor(torch.randn(SHAPE), mesh, [Shard(0)]).requires_grad_()
    w2 = distribute_tensor(torch.randn(SHAPE), mesh, [Shard(0)]).requires_grad_()
    x = torch.randn(SHAPE, requires_grad=True)

    def mixed() -> None:
        w.grad = None
        x.grad = None
        (w * x).sum().backward()

    def pure() -> None:
        w.grad = None
        w2.grad = None
        (w * w2).sum().backward()

    data = Rounds()
    for index in range(rounds):
        halves = ("unpatched", "patched") if index % 2 == 0 else ("patched", "unpatched")
        for half in halves:
            gc.collect()
            if half == "patched":
                with mf.patched():
                    timed(mixed, 20)
                    data.add("grad: mixed fwd+bwd, patched", timed(mixed, calls))
                    data.add("grad: pure DTensor fwd+bwd, patched", timed(pure, calls))
                    assert type(x.grad) is torch.Tensor
            else:
                with implicit_replication():
                    timed(mixed, 20)
                    data.add("grad: mixed fwd+bwd, implicit_replication", timed(mixed, calls))
                data.add("grad: pure DTensor fwd+bwd, unpatched", timed(pure, calls))
    return data


def foreach_cases(rounds: int, steps: int, params: int = 100) -> Rounds:
    """``_foreach_*`` over 100 parameters: a mixed ``_foreach_add_`` and Adam(foreach=True) steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import keras_dtensor_mixfix as mf

    mesh = init_device_mesh("cpu", (1,))
    shape = (32, 32)
    dt_params = [distribute_tensor(torch.randn(shape), mesh, [Shard(0)]) for _ in range(params)]
    dt_updates = [distribute_tensor(torch.randn(shape), mesh, [Shard(0)]) for _ in range(params)]
    plain_updates = [torch.randn(shape) for _ in range(params)]

    def add_mixed() -> None:
        torch._foreach_add_(dt_params, plain_updates, alpha=1e-6)

    def add_pure() -> None:
        torch._foreach_add_(dt_params, dt_updates, alpha=1e-6)

    def make_adam(kind: str) -> Callable[[], None]:
        if kind == "pure":
            ps = [torch.nn.Parameter(distribute_tensor(torch.randn(shape), mesh, [Shard(0)])) for _ in range(params)]
        else:  # half DTensor, half plain parameters in one foreach list
            ps = [torch.nn.Parameter(distribute_tensor(torch.randn(shape), mesh, [Shard(0)])) if i % 2 == 0
                  else torch.nn.Parameter(torch.randn(shape)) for i in range(params)]
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = torch.optim.Adam(ps, lr=1e-3, foreach=True)

        def step() -> None:
            opt.step()

        return step

    data = Rounds()
    with mf.patched():
        adam_mixed = make_adam("mixed")
    # One optimizer for both halves: patched / unpatched compares the same parameters and state.
    adam_pure = make_adam("pure")
    for index in range(rounds):
        halves = ("unpatched", "patched") if index % 2 == 0 else ("patched", "unpatched")
        for half in halves:
            gc.collect()
            if half == "patched":
                with mf.patched():
                    add_mixed()
                    adam_mixed()
                    data.add("foreach: _foreach_add_ 100 DTensor + 100 plain, patched (us/call)",
                             timed(add_mixed, steps))
                    data.add("foreach: _foreach_add_ 100 DTensor + 100 DTensor, patched (us/call)",
                             timed(add_pure, steps))
                    data.add("foreach: Adam step, 50 DTensor + 50 plain params, patched (us/step)",
                             timed(adam_mixed, steps))
                    data.add("foreach: Adam step, 100 DTensor params, patched (us/step)", timed(adam_pure, steps))
            else:
                add_pure()
                adam_pure()
                data.add("foreach: _foreach_add_ 100 DTensor + 100 DTensor, unpatched (us/call)",
                         timed(add_pure, steps))
                data.add("foreach: Adam step, 100 DTensor params, unpatched (us/step)", timed(adam_pure, steps))
    return data

"""torch limitation: DTensor's first CPU ``scaled_dot_product_attention`` of split operands takes minutes.

DTensor has no sharding strategy for CPU's ``aten._scaled_dot_product_flash_attention_for_cpu`` and derives one
from its decomposition (``DecompShardingStrategy``): it traces the decomposition once for every combination of
candidate placements of its tensor operands (Replicate and Shard along every dim of each: with 4-D q/k/v split
``Shard(0)`` and a 2-D mask, 5 * 5 * 5 * 3 = 375 combinations), and inside each trace the decomposition's
``_scaled_dot_product_attention_math``, which has no strategy either, goes through the same search again for
its own operands (about 475 traces per combination). The first call of a shape thus traces the math attention
about 180,000 times on meta tensors: no collective and no deadlock, both ranks compute the same search, but
about 5 minutes on one core (half the search took 170 s in one process; 58 s without the mask: 125 x 124
traces), long enough that a 2-rank run on a busy 2-core machine looked hung
(``benchmarks/gpu_check_patterns.py``, row 3). Later calls of the shape hit DTensor's sharding-propagation cache.
With q/k/v ``Replicate`` there is one combination and the call is quick.

Seen on torch 2.13.0 (CPU, gloo, 2 ranks), every operand a DTensor (the mask ``Replicate``, as
keras_dtensor_mixfix promotes a plain mask, or ``Shard(0)``): no keras_dtensor_mixfix involved. Not checked on
other releases. Run with ``KERAS_DTENSOR_MIXFIX=0``; the mixed call (a plain mask) takes the same path.

Run: ``KERAS_DTENSOR_MIXFIX=0 GLOO_SOCKET_IFNAME=lo torchrun --nproc-per-node 2 --master-addr 127.0.0.1
repros/torch_sdpa_cpu_sharding_search.py`` (exits 1 after ``BUDGET_S`` seconds while the limitation is there;
prints the values checked once the first call is quick). Not run by the test suite (each run spends its budget).
"""

import datetime
import signal
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

BUDGET_S = 30
"""What the first call may take: well under a second on plain tensors, minutes while the limitation is there."""


class _OverBudget(BaseException):
    """Raised by the alarm; a BaseException, so that the search's own ``except RuntimeError`` cannot swallow it."""


def _alarm(signum, frame):
    raise _OverBudget()


def repro() -> None:
    """Raises AssertionError once the first call has run ``BUDGET_S`` seconds; returns (values checked) when it
    is quick. Each rank times its own call: nothing waits on the other rank until the values are compared."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=generator) for _ in range(3))
    mask = torch.tril(torch.ones(8, 8, dtype=torch.bool))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    dq, dk, dv = (distribute_tensor(t, mesh, [Shard(0)]) for t in (q, k, v))
    dmask = distribute_tensor(mask, mesh, [Replicate()])
    timed = threading.current_thread() is threading.main_thread()  # signals reach the main thread only
    if timed:
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, BUDGET_S, 1.0)  # and again every second, should one be lost
    start = time.monotonic()
    try:
        out = F.scaled_dot_product_attention(dq, dk, dv, attn_mask=dmask)
    except _OverBudget:
        out = None
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    elapsed = time.monotonic() - start
    assert out is not None and elapsed < BUDGET_S, (
        f"the first sdpa of Shard(0) q/k/v with a Replicate mask ran {elapsed:.0f} s "
        f"(budget {BUDGET_S} s), searching placements through the decomposition")
    torch.testing.assert_close(out.full_tensor(), want)


if __name__ == "__main__":
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    try:
        repro()
        print(f"rank {dist.get_rank()}: lifted in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

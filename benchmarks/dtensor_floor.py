"""The floor under a sharded Keras step: the same MLP step written in plain torch and in pure DTensor.

    python benchmarks/dtensor_floor.py

The MLP of ``benchmarks/keras_model_step.py`` (2 × Linear 256→1024 relu, Linear 1024→256, LayerNorm;
AdamW; batch 64; MSE) without Keras and without this package: in one process on plain tensors, and on
2 gloo ranks with torch's own tensor parallelism (``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel``, the input replicated, AdamW's foreach kernels on DTensor parameters), where no
operand is ever plain. Median of steps 3–11, one intra-op thread per process, as in that benchmark:
what torch itself costs for this math, whatever sits above it.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Dict, List

os.environ["KERAS_DTENSOR_MIXFIX"] = "0"  # nothing of the package is active here

STEPS = 12


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    blocks: List[Any] = []
    for _ in range(2):
        blocks += [torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256), torch.nn.LayerNorm(256)]
    return torch.nn.Sequential(*blocks)


def _steps(model: Any, x: Any, y: Any, barrier: Any) -> Dict[str, Any]:
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    times = []
    for _ in range(STEPS - 1):
        barrier()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return {"first_s": first, "steps_ms": times[1:]}


def _data() -> Any:
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randn(64, 256, generator=generator), torch.randn(64, 256, generator=generator)


def one_process() -> Dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    x, y = _data()
    return _steps(_model(), x, y, lambda: None)


def tensor_parallel() -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model()
    plan: Dict[str, Any] = {}
    for index in range(0, len(model), 4):
        plan[str(index)] = ColwiseParallel()
        plan[str(index + 2)] = RowwiseParallel(use_local_output=False)  # a DTensor into the LayerNorm
    model = parallelize_module(model, mesh, plan)
    for index in range(3, len(model), 4):  # LayerNorm: replicated parameters
        norm = model[index]
        norm.weight = torch.nn.Parameter(distribute_tensor(norm.weight.data, mesh, [Replicate()]))
        norm.bias = torch.nn.Parameter(distribute_tensor(norm.bias.data, mesh, [Replicate()]))
    x, y = _data()
    x = distribute_tensor(x, mesh, [Replicate()])
    y = distribute_tensor(y, mesh, [Replicate()])
    return _steps(model, x, y, dist.barrier)


def main() -> int:
    from keras_dtensor_mixfix.testing import run_on_ranks, shutdown_workers

    single = one_process()
    try:
        per_rank = run_on_ranks(tensor_parallel, world_size=2, timeout=900)
    finally:
        shutdown_workers()
    ranks = [max(a, b) for a, b in zip(per_rank[0]["steps_ms"], per_rank[1]["steps_ms"])]
    print(f"MLP step, AdamW, batch 64 (median of steps 3-{STEPS}; load average {os.getloadavg()[0]:.1f})")
    print(f"  plain torch, 1 process:                 first {single['first_s']:.2f} s, "
          f"median {statistics.median(single['steps_ms']):.1f} ms, min {min(single['steps_ms']):.1f} ms")
    print(f"  pure DTensor tensor parallel, 2 ranks:  first {max(r['first_s'] for r in per_rank):.2f} s, "
          f"median {statistics.median(ranks):.1f} ms, min {min(ranks):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

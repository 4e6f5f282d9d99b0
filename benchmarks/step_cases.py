"""Whole-program cases: the Keras step on 2 ranks (P6), torch.compile, and import times (P5)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, List

import torch
import subprocess

from timing import SHAPE, Rounds, summary, timed


def keras_step(rounds: int, steps: int) -> Rounds:
    """P6 (benchmarks/keras_step.py): a Keras ModelParallel step on 2 ranks, plain ÷ DTensor batches."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import keras_step as ks

    from keras_dtensor_mixfix.testing import run_on_ranks

    plain, dtensor = run_on_ranks(ks.measure, rounds, steps, world_size=2, timeout=1800)[0]
    data = Rounds()
    data.samples = {"keras: ModelParallel step, plain batches ms": plain,
                    "keras: ModelParallel step, DTensor batches by hand ms": dtensor}
    return data


def compile_cases(backends: List[str], steady_calls: int, rounds: int) -> Dict[str, Any]:
    """torch.compile of a function with a mixed op: first-call time and steady-state per call (patched)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import keras_dtensor_mixfix as mf

    mesh = init_device_mesh("cpu", (1,))
    w = distribute_tensor(torch.randn(SHAPE), mesh, [Shard(0)])
    x = torch.randn(SHAPE)

    def f(w: Any, x: Any) -> Any:
        return torch.relu(w * x + 1.0) * x

    results: Dict[str, Any] = {}
    with mf.patched():
        eager = [timed(lambda: f(w, x), steady_calls) for _ in range(rounds)]
        results["eager (patched)"] = {"steady_us": summary(eager)}
        for backend in backends:
            torch._dynamo.reset()
            compiled = torch.compile(f, backend=backend, fullgraph=True)
            start = time.perf_counter()
            out = compiled(w, x)
            first = time.perf_counter() - start
            torch.testing.assert_close(out.full_tensor(), f(w, x).full_tensor())
            timed(lambda: compiled(w, x), 20)
            steady = [timed(lambda: compiled(w, x), steady_calls) for _ in range(rounds)]
            results[backend] = {"first_call_s": first, "steady_us": summary(steady)}
        torch._dynamo.reset()
    return results


# ----------------------------------------------------------------------------- subprocesses


_ACTIVATE = (
    "import time, torch; t = time.perf_counter(); "
    "from keras_dtensor_mixfix._autoload import activate; activate(); "
    "print((time.perf_counter() - t) * 1e3)"
)
_IMPORT_TORCH = "import time; t = time.perf_counter(); import torch; print((time.perf_counter() - t) * 1e3)"
_FIRST_PATCH = (
    "import time, torch, torch.distributed.tensor; t = time.perf_counter(); import keras_dtensor_mixfix as mf; "
    "mf.patch(); print((time.perf_counter() - t) * 1e3)"
)
_IMPORT_DTENSOR = (
    "import time, torch; t = time.perf_counter(); import torch.distributed.tensor; "
    "print((time.perf_counter() - t) * 1e3)"
)


def _child(code: str, **env: str) -> float:
    # PYTHONDONTWRITEBYTECODE is dropped: a user's install has its bytecode cached (pip compiles
    # it), and a benchmark that recompiled our modules from source each run would time that.
    dropped = ("KERAS_DTENSOR_MIXFIX", "TORCHINDUCTOR_CACHE_DIR", "PYTHONDONTWRITEBYTECODE")
    environ = {k: v for k, v in os.environ.items() if k not in dropped}
    environ.update(env)
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def import_cases(runs: int) -> Rounds:
    variants = [
        ("first patch() in a fresh process, package import included (KERAS_DTENSOR_MIXFIX=0) ms", _FIRST_PATCH,
         {"KERAS_DTENSOR_MIXFIX": "0"}),
        ("activate(): import + run of the entry point (TORCH_DEVICE_BACKEND_AUTOLOAD=0, called by hand) ms",
         _ACTIVATE, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}),
        ("import torch, auto-activation on ms", _IMPORT_TORCH, {}),
        ("import torch, KERAS_DTENSOR_MIXFIX=0 ms", _IMPORT_TORCH, {"KERAS_DTENSOR_MIXFIX": "0"}),
        ("import torch, TORCH_DEVICE_BACKEND_AUTOLOAD=0 ms", _IMPORT_TORCH, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}),
        ("import torch.distributed.tensor after torch, auto-activation on (patches) ms", _IMPORT_DTENSOR, {}),
        ("import torch.distributed.tensor after torch, KERAS_DTENSOR_MIXFIX=0 ms", _IMPORT_DTENSOR,
         {"KERAS_DTENSOR_MIXFIX": "0"}),
    ]
    for _, code, env in variants:
        _child(code, **env)  # unmeasured: writes the bytecode caches
    data = Rounds()
    for _ in range(runs):
        for name, code, env in variants:
            data.add(name, _child(code, **env))
    return data


# ----------------------------------------------------------------------------- report

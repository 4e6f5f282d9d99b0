"""What a GPU will see of an eager Keras step, measured on the CPU: host time and the ops that would block a GPU.

    python benchmarks/host_time.py [--rounds 3] [--steps 30]

On a GPU an eager step of a small model is bound by the host: Python, Keras and dispatch, while kernels queue. This
times a tiny keras_hub Gemma's ``train_on_batch`` (compute negligible: the GPU check's "small" size) with
``ModelParallel`` on a one-device mesh and without a distribution, each in fresh processes, alternated over rounds
(ABC ABC ...), and prints the median step of each and their ratios. The mesh runs twice: as a user's job runs it (a
one-device mesh holds Keras' own plain tensors) and with ``KERAS_DTENSOR_MIXFIX_DTENSORS_ON_ONE_DEVICE=1`` (DTensors on
that one device: each op's host cost of DTensor dispatch, which every rank of a mesh of several devices pays). A
dispatch mode counts, over one step after warm-up, the ops that would block a GPU's host: ``_local_scalar_dense``
(``.item()``, ``bool()`` of a tensor), ``nonzero`` and the other ops whose output size depends on values, and copies
between devices (on the CPU none can happen: a device copy here is a non-0-dim CPU tensor moved to a mesh's device).
"Added" is the mesh run's count minus the run without a distribution. The figures go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("plain", "mesh", "mesh, DTensors")
"""No distribution; a one-device mesh as a job runs it; the same mesh with its DTensors kept."""
BLOCKING = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique", "aten::_unique",
            "aten::repeat_interleave", "aten::bincount", "aten::histc", "aten::item")
"""Ops whose result the host must wait for (a value read, or an output size that depends on values)."""


def _worker(mesh: bool, steps: int) -> Dict[str, Any]:
    sys.path.insert(0, HERE)
    import time

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import gpu_check_keras

    torch.set_num_threads(1)
    spec = {"backend": "torch", "mesh": mesh, "jit": False, "device": "cpu"}
    config = gpu_check_keras.TINY
    lm = gpu_check_keras._gemma(spec, config)
    x, y = gpu_check_keras._data(4, 8, config["vocabulary_size"])
    for _ in range(3):
        lm.train_on_batch(x, y)
    times: List[float] = []
    for _ in range(steps):
        start = time.perf_counter()
        lm.train_on_batch(x, y)
        times.append((time.perf_counter() - start) * 1e3)

    counts: collections.Counter = collections.Counter()

    class Blocking(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            counts["(every op, for scale)"] += 1
            if name in BLOCKING:
                counts[name] += 1
            if name in ("aten::_to_copy", "aten::copy_"):
                source = next((a for a in args if isinstance(a, torch.Tensor)), None)
                target = kwargs.get("device") if kwargs else None
                if name == "aten::copy_" and len(args) > 1:
                    source, target = args[1], args[0].device
                if source is not None and target is not None and torch.device(target) != source.device \
                        and source.dim() > 0:
                    counts[f"{name} across devices"] += 1
            return func(*args, **(kwargs or {}))

    with Blocking():
        lm.train_on_batch(x, y)
    return {"step_ms": statistics.median(times), "blocking": dict(counts)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--worker", choices=MODES)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker != "plain", args.steps)))
        return
    results: Dict[str, List[Dict[str, Any]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            environment = {**os.environ, "KERAS_BACKEND": "torch", "KERAS_DTENSOR_MIXFIX": "0",
                           "KERAS_DTENSOR_MIXFIX_DTENSORS_ON_ONE_DEVICE": "1" if mode == "mesh, DTensors" else "0"}
            done = subprocess.run([sys.executable, __file__, "--worker", mode, "--steps", str(args.steps)],
                                  env=environment, capture_output=True, text=True, check=True)
            results[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    step_ms = {mode: statistics.median(r["step_ms"] for r in results[mode]) for mode in MODES}
    plain_ms = step_ms["plain"]
    print("| step | no distribution, ms | one-device mesh (default), ms | ratio | one-device mesh, DTensors kept, "
          "ms | ratio |\n| --- | --- | --- | --- | --- | --- |")
    print(f"| tiny Gemma `train_on_batch`, eager | {plain_ms:.1f} | {step_ms['mesh']:.1f} | "
          f"{step_ms['mesh'] / plain_ms:.2f} | {step_ms['mesh, DTensors']:.1f} | "
          f"{step_ms['mesh, DTensors'] / plain_ms:.2f} |")
    counts = {mode: results[mode][-1]["blocking"] for mode in MODES}
    print("\n| op (one step) | no distribution | one-device mesh (default): added | DTensors kept: added |\n"
          "| --- | --- | --- | --- |")
    for name in sorted(set().union(*counts.values())) or ["(none)"]:
        plain = counts["plain"].get(name, 0)
        print(f"| {name} | {plain} | {counts['mesh'].get(name, 0) - plain} | "
              f"{counts['mesh, DTensors'].get(name, 0) - plain} |")


if __name__ == "__main__":
    main()

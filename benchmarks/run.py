"""Benchmarks of keras_dtensor_mixfix: every figure in BENCHMARKS.md comes from this one command.

    python benchmarks/run.py                 # full run (a few minutes on 2 cores)
    python benchmarks/run.py --quick         # fewer rounds, no inductor, fewer subprocesses
    python benchmarks/run.py --json out.json # also write the raw figures

CPU, float32. The per-op cases (P1-P4) run twice: in this process on world size 1, and in two
rank workers (gloo on 127.0.0.1) where ``Shard(0)`` really slices. They are timed in rounds: each round
measures the unpatched cases, then patches and measures the patched ones (the order of the two
halves alternates), so every ratio compares figures taken side by side in one process. Each
figure is microseconds per call over a batch of calls, with the garbage collector off during
the batch; min and median are over the rounds. A per-op ratio's verdict uses the median of the
per-round ratios (each pairs two figures taken seconds apart, so load that drifts during the run
cancels out); the ratio of the minima and the ratio of the medians are shown beside it, and a
verdict says when the ratio of the minima would miss.

Import-time figures run fresh Python subprocesses, interleaved, several times each. P6 runs
benchmarks/keras_step.py's measurement in the same two rank workers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Dict

# The in-process benchmark patches and unpatches explicitly: keep auto-activation out of it,
# and keep torch.compile's on-disk caches cold so first-call compile times are real.
os.environ["KERAS_DTENSOR_MIXFIX"] = "0"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("KERAS_BACKEND", "torch")  # for P6's rank workers
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="mixfix-bench-inductor-")

import torch.distributed as dist


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the case modules, also in rank workers

from op_cases import foreach_cases, grad_cases, per_op, per_op_two_ranks
from report import report
from step_cases import compile_cases, import_cases, keras_step
from timing import free_port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds; no inductor; fewer subprocess runs")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of the per-op cases (default 21, quick 5)")
    parser.add_argument("--no-imports", action="store_true", help="skip the subprocess import-time figures")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile figures")
    parser.add_argument("--no-ranks", action="store_true", help="skip the 2-rank cases (per-op and P6 Keras step)")
    parser.add_argument("--json", default=None, help="write the figures to this file too")
    args = parser.parse_args()
    try:
        args.load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        pass
    rounds = args.rounds or (5 if args.quick else 21)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        per, extra = per_op(rounds, calls=2000, plain_calls=10000)
        others = [grad_cases(max(3, rounds // 3), calls=300),
                  foreach_cases(max(3, rounds // 3), steps=20)]
        compiled: Dict[str, Any] = {}
        if not args.no_compile:
            backends = ["aot_eager"] if args.quick else ["aot_eager", "inductor"]
            compiled = compile_cases(backends, steady_calls=1000, rounds=max(3, rounds // 3))
    finally:
        dist.destroy_process_group()
    per2 = keras = None
    if not args.no_ranks:
        from keras_dtensor_mixfix.testing import shutdown_workers

        try:
            per2 = per_op_two_ranks(rounds, calls=2000, plain_calls=10000)
            keras = keras_step(3 if args.quick else 7, steps=20)
        finally:
            shutdown_workers()
    imports = None if args.no_imports else import_cases(3 if args.quick else 9)
    result = report(per, extra, others, compiled, imports, args, per2, keras)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2, default=str)


if __name__ == "__main__":
    main()

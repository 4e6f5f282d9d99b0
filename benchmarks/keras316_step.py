"""Keras 3.16 ModelParallel train step on 2 ranks: with the package's promotion ÷ Keras alone.

    pip install keras-nightly==3.16.0.dev2026102704      # Keras with its own torch distribution
    python benchmarks/keras316_step.py [--rounds 7] [--steps 10] [--jit]

With ``--jit`` both models are compiled with ``jit_compile=True`` (P7): Keras alone warns and runs
the step eagerly under ``ModelParallel``; with the package the step is compiled (inductor, static
shapes).

Keras 3.16 promotes mixed operands with ``KerasDTensorPromotionMode``, a dispatch mode every op
goes through; with the integration installed (and patched) that mode stays off and the dispatch
rules promote instead. Both sides run in the same two processes, each on its own model built in
its own state (installed, or uninstalled and unpatched), rounds interleaved A B A B...; each round
follows warm-up steps, since switching state clears the promotion caches. A 2-block MLP
(256→1024→256 twice, column- then row-sharded), AdamW, batch 64, float32, gloo on 127.0.0.1.
Prints min and median per step, wall time and both ranks' CPU time, and the ratios (target ≤ 0.7):
on a shared machine the CPU time is the steadier of the two.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")
os.environ["KERAS_DTENSOR_MIXFIX"] = "0"  # the benchmark installs what it measures explicitly

from keras_dtensor_mixfix.testing import run_on_ranks, shutdown_workers

TARGET = 0.7
JIT_TARGET = 0.35  # P7


def _model(name, jit):
    import keras

    layers = [keras.Input((256,))]
    for block in range(2):
        layers += [keras.layers.Dense(1024, activation="relu", name=f"up{block}"),
                   keras.layers.Dense(256, name=f"down{block}")]
    model = keras.Sequential(layers, name=name)
    model.compile(optimizer=keras.optimizers.AdamW(1e-3), loss="mse", jit_compile=jit)
    return model


def measure(rounds, steps, jit, warmup=3):
    import keras
    import numpy as np
    import torch

    from keras_dtensor_mixfix import keras_integration

    keras.utils.set_random_seed(0)
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((1, len(devices)), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*up./kernel"] = (None, "model")
    layout_map[".*up./bias"] = ("model",)
    layout_map[".*down./kernel"] = ("model", None)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 256)).astype("float32")
    y = rng.normal(size=(64, 256)).astype("float32")

    def switch(plugin):
        if plugin:
            keras_integration.install()
        else:
            keras_integration.uninstall()

    models = {}
    for plugin in (False, True):  # each model's step functions are made in the state it is timed in
        switch(plugin)
        models[plugin] = _model("with_package" if plugin else "keras_alone", jit)
        models[plugin].train_on_batch(x, y)
    times = {False: [], True: []}
    cpu = {False: [], True: []}
    for _ in range(rounds):
        for plugin in (False, True):
            switch(plugin)
            model = models[plugin]
            for _ in range(warmup):
                model.train_on_batch(x, y)
            torch.distributed.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                model.train_on_batch(x, y)
            cpu[plugin].append((time.process_time() - start_cpu) / steps * 1e3)
            times[plugin].append((time.perf_counter() - start) / steps * 1e3)
    keras_integration.uninstall()
    keras.distribution.set_distribution(None)
    return times[False], times[True], cpu[False], cpu[True]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--jit", action="store_true", help="both models compiled with jit_compile=True (P7)")
    parser.add_argument("--json", help="also write the medians and ratios there (for compiled_step_targets.py)")
    args = parser.parse_args()
    import keras
    import keras.src.backend as backend_module

    if getattr(backend_module, "distribution_lib", None) is None:
        print(f"Keras {keras.__version__} has no torch distribution of its own: this compares with Keras 3.16 "
              "(pip install keras-nightly==3.16.0.dev2026102704)")
        return 2
    per_rank = run_on_ranks(measure, args.rounds, args.steps, args.jit, world_size=2, timeout=1800)
    shutdown_workers()
    # wall: a step ends when the slower rank finishes (the larger of the two ranks' figures per round);
    # CPU: both ranks' process time added (what the step costs, whatever else shares the cores)
    alone = [max(a, b) for a, b in zip(per_rank[0][0], per_rank[1][0])]
    ours = [max(a, b) for a, b in zip(per_rank[0][1], per_rank[1][1])]
    alone_cpu = [a + b for a, b in zip(per_rank[0][2], per_rank[1][2])]
    ours_cpu = [a + b for a, b in zip(per_rank[0][3], per_rank[1][3])]
    print(f"Keras {keras.__version__} ModelParallel train step, 2 ranks (gloo, CPU), MLP 256-1024-256 x2, "
          f"AdamW, batch 64, jit_compile={args.jit} ({args.rounds} rounds x {args.steps} steps)")
    target = JIT_TARGET if args.jit else TARGET
    median = statistics.median
    summary = {}
    for what, a, o in (("wall time per step", alone, ours), ("CPU time per step, both ranks", alone_cpu, ours_cpu)):
        ratio = median(x / y for x, y in zip(o, a))
        summary[what] = {"alone_median_ms": median(a), "ours_median_ms": median(o), "ratio": ratio}
        print(f"  {what}:")
        print(f"    Keras alone (KerasDTensorPromotionMode): min {min(a):.2f} ms, median {median(a):.2f} ms")
        print(f"    with keras_dtensor_mixfix:               min {min(o):.2f} ms, median {median(o):.2f} ms")
        print(f"    ratio with / alone: min {min(o) / min(a):.3f}, median of per-round ratios {ratio:.3f} "
              f"(target <= {target}: {'PASS' if ratio <= target else 'MISS'})")
    if args.json:
        import json

        with open(args.json, "w") as out:
            json.dump({"keras": keras.__version__, "jit": args.jit, **summary}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

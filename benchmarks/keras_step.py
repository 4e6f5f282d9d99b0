"""P6: a Keras ModelParallel training step on 2 ranks, plain input batches ÷ batches made DTensors by hand.

    python benchmarks/keras_step.py

Both timings come from the same processes, interleaved (ABAB...), min and median of the rounds.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")
os.environ["KERAS_DTENSOR_MIXFIX"] = "0"  # the benchmark installs what it measures explicitly

from keras_dtensor_mixfix.testing import run_on_ranks, shutdown_workers


def measure(rounds: int = 7, steps: int = 20):
    import keras
    import numpy as np
    import torch

    from keras_dtensor_mixfix import keras_integration

    keras_integration.install()
    torch.set_num_threads(1)
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((1, len(devices)), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*d1/kernel"] = (None, "model")
    layout_map[".*d2/kernel"] = ("model", None)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu", name="d1"),
                              keras.layers.Dense(8, name="d2")])
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 64)).astype("float32")
    y = rng.normal(size=(32, 8)).astype("float32")
    # by hand, with exactly the placements the distribution gives a batch
    from torch.distributed.tensor import distribute_tensor

    layout = keras.distribution.distribution().get_data_layout(x.shape).backend_layout
    dx = distribute_tensor(torch.from_numpy(x), layout.mesh, list(layout.placements), src_data_rank=None)
    dy = distribute_tensor(torch.from_numpy(y), layout.mesh, list(layout.placements), src_data_rank=None)
    model.train_on_batch(x, y)
    model.train_on_batch(dx, dy)
    plain_times, dtensor_times = [], []
    for _ in range(rounds):
        for inputs, sink in (((x, y), plain_times), ((dx, dy), dtensor_times)):
            torch.distributed.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                model.train_on_batch(*inputs)
            sink.append((time.perf_counter() - start) / steps * 1e3)
    keras.distribution.set_distribution(None)
    return plain_times, dtensor_times


def main() -> int:
    plain, dtensor = run_on_ranks(measure, world_size=2, timeout=900)[0]
    shutdown_workers()
    ratio_min = min(plain) / min(dtensor)
    ratio_median = statistics.median(plain) / statistics.median(dtensor)
    print("P6 Keras ModelParallel train step, 2 ranks (gloo, CPU), Dense 64->256->8, batch 32, Adam")
    print(f"  plain NumPy batches:        min {min(plain):.2f} ms, median {statistics.median(plain):.2f} ms")
    print(f"  DTensor batches by hand:    min {min(dtensor):.2f} ms, median {statistics.median(dtensor):.2f} ms")
    print(f"  ratio plain / DTensor: min {ratio_min:.3f}, median {ratio_median:.3f} (target <= 1.10: "
          f"{'PASS' if ratio_min <= 1.10 else 'MISS'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the atomic commit costs a save: ``checkpoint.save`` beside torch's own ``dcp.save`` of the same state.

One process, a Keras model of about ``--megabytes`` of float32 weights (Dense layers) with its Adam slots, saved
``--rounds`` times into the same folder each way, alternating: ``checkpoint.save`` (staging folder, fsync of every
file, a commit record, renames, the old files removed) and ``torch.distributed.checkpoint.save`` of the same tensors
into a folder in place (what ``checkpoint.save`` did before it was atomic; DCP fsyncs its data files itself).

    python benchmarks/save_commit_cost.py --megabytes 256 --rounds 7

prints the median seconds of each and their ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "torch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=float, default=256.0)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    import keras
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp

    from keras_dtensor_mixfix import checkpoint
    from keras_dtensor_mixfix._keras.files.sharded_checkpoint import keyed_variables

    width = 1024
    layers = max(1, int(args.megabytes * 2**20 / 4 / 3 / (width * width)))  # weights + two Adam slots
    model = keras.Sequential([keras.Input((width,))] + [keras.layers.Dense(width) for _ in range(layers)])
    model.compile(optimizer="adam", loss="mse")
    x = np.zeros((8, width), "float32")
    model.fit(x, x, verbose=0)
    state = {key: variable.value.detach() for key, variable in keyed_variables(model, True).items()}
    total = sum(tensor.numel() * tensor.element_size() for tensor in state.values()) / 2**20
    work = tempfile.mkdtemp(prefix="save-commit-cost-")
    ours, torchs = [], []
    try:
        for round_ in range(args.rounds):
            for which in ((0, 1) if round_ % 2 == 0 else (1, 0)):
                started = time.perf_counter()
                if which == 0:
                    checkpoint.save(model, os.path.join(work, "ours"))
                    ours.append(time.perf_counter() - started)
                else:
                    dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(work, "torch")), no_dist=True)
                    torchs.append(time.perf_counter() - started)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mine, theirs = statistics.median(ours), statistics.median(torchs)
    print(f"torch {torch.__version__}, keras {keras.__version__}: {total:.0f} MB in {len(state)} tensors, "
          f"{args.rounds} rounds")
    print(f"checkpoint.save (atomic) {mine:.3f} s, dcp.save in place {theirs:.3f} s, ratio {mine / theirs:.2f}")


if __name__ == "__main__":
    main()

"""What a position-keyed initial value costs per element, beside torch's own generator drawing the whole tensor.

    python benchmarks/position_draws_cost.py              # (16000, 512) and (512, 2048), 1/1, 1/4 and 1/8 pieces
    python benchmarks/position_draws_cost.py --repeats 5

For each shape, kind and piece (a row block: one contiguous run; a column block: one run per row, the worst case),
the best of ``--repeats`` timings of ``position_draws.draw`` for that piece, in ns per element drawn, and the same
piece's time ÷ the time torch's CPU generator takes to draw the whole tensor (``torch.empty(shape).normal_()``,
``uniform_()``; the truncated normal: Keras' own, which draws 4 normals per element). One intra-op thread, as each
rank of a CPU job on a shared machine.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from keras_dtensor_mixfix._keras.backend import position_draws

SHAPES = [(16000, 512), (512, 2048)]


def _best(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def _torch_whole(kind: str, shape) -> None:
    if kind == "normal":
        torch.empty(shape).normal_()
    elif kind == "uniform":
        torch.empty(shape).uniform_()
    else:  # Keras' torch backend: 4 normals per element, the first within two deviations kept
        x = torch.empty(tuple(shape) + (4,)).normal_()
        valid = (x > -2) & (x < 2)
        x.gather(-1, valid.max(-1, keepdim=True)[1]).squeeze(-1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| shape | kind | piece | ns per element | piece ÷ torch's whole draw |")
    print("|---|---|---|---|---|")
    for shape in SHAPES:
        for kind in position_draws.KINDS:
            whole_s = _best(lambda: _torch_whole(kind, shape), args.repeats)
            for label, box in _pieces(shape):
                elements = math.prod(len(range(*s.indices(n))) for s, n in zip(box, shape))
                seconds = _best(lambda: position_draws.draw(kind, 7, shape, box, torch.float32), args.repeats)
                print(f"| {shape} | {kind} | {label} | {seconds / elements * 1e9:.1f} | {seconds / whole_s:.2f} |")
    return 0


def _pieces(shape):
    rows, columns = shape
    yield "whole", (slice(None), slice(None))
    for n in (4, 8):
        yield f"1/{n} rows", (slice(0, rows // n), slice(None))
        yield f"1/{n} columns", (slice(None), slice(0, columns // n))


if __name__ == "__main__":
    raise SystemExit(main())

"""Per-op cost of the patch, measured side by side in one process (world size 1, gloo on 127.0.0.1).

    python benchmarks/core_overhead.py

Prints microseconds per op (min and median of 7 runs of 2000 calls) and the ratios.
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench(fn, calls=2000, reps=7):
    for _ in range(200):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return min(times), statistics.median(times)


def main() -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    import keras_dtensor_mixfix as mf

    mesh = init_device_mesh("cpu", (1,))
    a = distribute_tensor(torch.randn(64, 64), mesh, [Shard(0)])
    b = distribute_tensor(torch.randn(64, 64), mesh, [Shard(0)])
    plain = torch.randn(64, 64)
    rows = {}
    rows["pure DTensor Shard(0)*Shard(0), unpatched"] = bench(lambda: a * b)
    rows["plain x*x, unpatched"] = bench(lambda: plain * plain)
    with implicit_replication():
        rows["mixed, torch implicit_replication()"] = bench(lambda: a * plain)
    start = time.perf_counter()
    mf.patch()
    patch_ms = (time.perf_counter() - start) * 1e3
    rows["pure DTensor Shard(0)*Shard(0), patched"] = bench(lambda: a * b)
    rows["plain x*x, patched"] = bench(lambda: plain * plain)
    rows["mixed Shard(0)*plain, patched"] = bench(lambda: a * plain)
    start = time.perf_counter()
    mf.unpatch()
    unpatch_ms = (time.perf_counter() - start) * 1e3
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, world size 1, 64x64 float32")
    print(f"{'case':48s} {'min us':>8s} {'median us':>10s}")
    for name, (low, mid) in rows.items():
        print(f"{name:48s} {low:8.2f} {mid:10.2f}")
    pure = rows["pure DTensor Shard(0)*Shard(0), patched"][0] / rows["pure DTensor Shard(0)*Shard(0), unpatched"][0]
    plain_ratio = rows["plain x*x, patched"][0] / rows["plain x*x, unpatched"][0]
    mixed = rows["mixed Shard(0)*plain, patched"][0] / rows["mixed, torch implicit_replication()"][0]
    print(f"ratio pure patched/unpatched {pure:.3f}; plain patched/unpatched {plain_ratio:.3f}; "
          f"mixed patched/implicit_replication {mixed:.2f}")
    print(f"patch() {patch_ms:.1f} ms, unpatch() {unpatch_ms:.1f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

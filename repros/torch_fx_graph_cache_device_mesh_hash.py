"""torch limitation: inductor's on-disk FX graph cache never hits, launch to launch, for a graph that takes a
DeviceMesh.

A compiled function that makes a DTensor inside the graph (``DTensor.from_local(x, mesh, ...)``, as DTensor's own
code and Keras steps on sharded weights do) has the ``DeviceMesh`` as a graph input, an opaque object. Inductor's
FX graph cache key pickles it whole, including the hash ``DeviceMesh`` caches in ``_hash``, which differs from
process to process (even with one ``PYTHONHASHSEED``). So each launch computes another key for the same graph and
compiles it again: a second launch of a job on the same machine does not reuse the first's compiled graphs (tiny
keras_hub Gemma, 2 ranks: every block graph missed, BENCHMARKS.md "warm starts").

Seen on torch 2.12.1, 2.13.0, 2.14.1 and 2.15.0; on 2.11.0 the second launch reuses the graph. No
keras_dtensor_mixfix involved (it is turned off in the launches). The package's workaround, inside compiled Keras
steps only: the cache key's pickler is given a reduction of ``DeviceMesh`` by its device type, ranks, dim names and
process-group names (``_torch/api.py device_meshes_keyed_by_groups``).

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_fx_graph_cache_device_mesh_hash.py`` (exits 1
while the limitation is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure.
"""

import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

LAUNCH = r'''
import json, torch, torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
weight = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
# a matmul: inductor calls ATen's kernel, so the launches spend no time compiling C++
step = torch.compile(lambda w, x: torch.mm(w, DTensor.from_local(x, mesh, [Replicate()], run_check=False)))
step(weight, torch.ones(4, 4))
print(json.dumps({key: n for key, n in counters["inductor"].items() if key.startswith("fxgraph_cache")}))
dist.destroy_process_group()
'''


def launched_twice(program: str) -> list:
    """Each launch's FX graph cache counts: ``program`` run in two fresh processes on one new inductor cache."""
    cache = tempfile.mkdtemp(prefix="repro-fx-graph-cache-")
    environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "KERAS_DTENSOR_MIXFIX": "0"}
    counts = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", program], env=environment, capture_output=True, text=True,
                              timeout=300, check=True)
        counts.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return counts


def repro() -> None:
    """Launches the same compiled function twice on one inductor cache (on rank 0); raises AssertionError while the
    second launch does not hit the cache; returns once it does."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    counts = launched_twice(LAUNCH)
    assert counts[1].get("fxgraph_cache_hit") == 1, f"the second launch did not reuse the first's graph: {counts}"

if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

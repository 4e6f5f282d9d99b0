"""torch limitation: AOTAutograd's on-disk cache never keeps a graph in which TorchDynamo traced an operator on a NumPy
value, so that graph is compiled again at every launch.

A layer that scales by ``1 / np.sqrt(head_dim)`` inside its call (keras_hub's Gemma attention does) gets a node
calling TorchDynamo's ``numpy_operator_wrapper(operator.truediv)``, named ``wrapped_truediv``. AOTAutograd's cache
check does not know it to be safe ("Unsupported call_function target <Wrapped operator <original
wrapped_truediv>>") and bypasses the cache. Marked safe through
``torch._inductor.config.unsafe_marked_cacheable_functions``, the key's pickling then fails on it on torch 2.13 ("was
not found as torch._dynamo.utils.wrapped_truediv"): the key imports each global of the graph by name, and from 2.13
knows NumPy *functions* (``numpy_to_tensor_wrapper``) by their NumPy name, not operators. Inductor's own cache still
serves the compiled kernels; what a second launch pays again is AOTAutograd's tracing and partitioning of that graph
(tiny keras_hub Gemma, 2 ranks: its decoder block, BENCHMARKS.md "warm starts").

Seen on torch 2.11.0, 2.12.1, 2.13.0, 2.14.1 and 2.15.0. No keras_dtensor_mixfix involved (it is turned off in the
launch). The package does not work around it.

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_aot_autograd_cache_numpy_operator.py``
(exits 1 while the limitation is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure.
"""

import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

LAUNCH = r'''
import json, numpy as np, torch
from torch._dynamo.utils import counters
head_dim = 16
step = torch.compile(lambda x: (x * (1 / np.sqrt(head_dim))).relu().sum())
step(torch.randn(8, requires_grad=True)).backward()
print(json.dumps({key: n for key, n in counters["aot_autograd"].items() if key.startswith("autograd_cache")}))
'''


def repro() -> None:
    """Compiles the function in a fresh process (on rank 0); raises AssertionError while AOTAutograd's cache bypasses
    its graph; returns once the graph is saved."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="repro-aot-numpy-"),
                   "KERAS_DTENSOR_MIXFIX": "0"}
    done = subprocess.run([sys.executable, "-c", LAUNCH], env=environment, capture_output=True, text=True,
                          timeout=300, check=True)
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts.get("autograd_cache_saved") == 1, f"AOTAutograd's cache did not keep the graph: {counts}"


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

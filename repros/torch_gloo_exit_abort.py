"""torch bug: a 2-process gloo program that finished correctly sometimes aborts at exit.

After ``destroy_process_group()`` and the last line of output, one rank dies with
``terminate called without an active exception`` (SIGABRT, torchrun reports exit code -6): a C++ thread
still joinable when the process tears down. Seen on torch 2.12.1 (4 of 10 runs), 2.13.0 and 2.15.0 (about 1
in 8) on a loaded 2-core machine; no keras_dtensor_mixfix involved (run with ``KERAS_DTENSOR_MIXFIX=0``).
The documentation's tests, which run programs under torchrun, run one again when it ends this way
(``tests/project/test_readme.py``: ``EXIT_ABORT``).

Run: ``python repros/torch_gloo_exit_abort.py [runs]`` (default 10): starts the program below that many times
under torchrun on 2 CPU processes and exits 1 if any of them aborted at exit. Only likely to fail: a single run
usually passes.
"""

import os
import subprocess
import sys

PROGRAM = """
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
product = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]) * distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
print(f"rank {dist.get_rank()}: {product.full_tensor().sum():.4f}", flush=True)
dist.destroy_process_group()
"""  # noqa: E501 - the program's source, as it runs


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(runs: int) -> int:
    import tempfile

    env = dict(os.environ, KERAS_DTENSOR_MIXFIX="0", TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1")
    aborted = 0
    with tempfile.TemporaryDirectory() as work:
        script = os.path.join(work, "program.py")
        with open(script, "w") as file:
            file.write(PROGRAM)
        for _ in range(runs):
            result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                                     "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), script],
                                    env=env, capture_output=True, text=True, timeout=300)
            if result.returncode != 0 and "terminate called without an active exception" in result.stderr:
                aborted += 1
            elif result.returncode != 0:
                sys.stderr.write(result.stderr)
                return 2
    print(f"{aborted} of {runs} runs aborted at exit after finishing correctly")
    return 1 if aborted else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 10))

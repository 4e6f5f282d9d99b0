"""torch bug: after torchrun restarts its workers, gloo connects to a dead worker's address and the restart fails.

torchrun's workers build their process group on the agent's own TCP store (``TORCHELASTIC_USE_AGENT_STORE=True``,
static and c10d rendezvous alike), which outlives a restart, and ``init_process_group`` puts its keys there under the
same names at every attempt (torch's comment in ``rendezvous._create_c10d_store``: "We create a new TCPStore for every
retry so no need to add prefix for each attempt" -- the agent's store is not new). Gloo's full-mesh connection reads
each peer's address from those keys (``default_pg/0//cpu//0/1``: rank 1's, left by the worker that died): a worker of
the new attempt that reads a peer's key before the peer's new incarnation has written it gets the dead worker's
address, and ``init_process_group`` fails with ``Gloo connectFullMesh failed ... Connection refused``. Whether it
does is a race (a Keras job on 2 ranks: 2 restarts of 6 worked, torch 2.13.0, BENCHMARKS.md); this program makes it
certain by starting the new rank 1 three seconds late, as a slow import or a slow node does.

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` with ``--rdzv-backend c10d`` gives every attempt a new store (rank 0 of the
attempt serves it on a new port), and the restart works; the package's ``keras.distribution.initialize()`` (Keras
3.12 to 3.15) puts its group's keys under a prefix of the attempt (``_keras/backend/distribution_lib.py``).

Run: ``python repros/torch_elastic_restart_stale_gloo_address.py`` (the restart, connecting: exits 1 when it fails,
as it does in most runs while the bug is there; ``--shared-store off`` runs the same restart with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which works). No keras_dtensor_mixfix
involved. ``tests/patterns/test_torch_repros.py`` runs it from the upstream-defect table.
"""

import os
import subprocess
import sys
import tempfile

PROGRAM = r"""
import os, time
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
if attempt == 1:
    left = []
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # the agent's store, which attempt 0 used
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        left = sorted(store.list_keys())
    print(f"attempt 1 rank {rank}: {len(left)} keys left by attempt 0 {left}", flush=True)
    if os.environ.get("REPRO_CONNECT") != "1":
        raise SystemExit(0)  # what the new attempt meets is shown; connecting to it fails, or hangs, by chance
if attempt == 1 and rank == 1:
    time.sleep(3)  # the new incarnation of rank 1 starts late
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("batch", "model"))  # a group per mesh dim, as Keras makes
total = torch.ones(1)
dist.all_reduce(total, group=mesh.get_group("model"))
if attempt == 0:
    if rank == 1:
        os._exit(9)  # a worker lost (killed, out of memory)
    dist.all_reduce(total)  # fails: the peer is gone; torchrun restarts both
print(f"attempt {attempt} rank {rank}: all_reduce {total.item():.0f}", flush=True)
dist.destroy_process_group()
"""


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def restarted(share_store: bool = True, timeout: float = 120.0, program: str = PROGRAM, env: dict = None,
              connect: bool = True) -> tuple:
    """Run ``program`` under torchrun (c10d rendezvous, one restart; ``connect``: the new attempt builds its group and
    all-reduces, else it stops once it has looked at the store); returns (restart worked, output)."""
    env = {**os.environ, "KERAS_DTENSOR_MIXFIX": "0", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "OMP_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "lo", "REPRO_CONNECT": "1" if connect else "0", **(env or {})}
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    with tempfile.TemporaryDirectory() as work:
        script = os.path.join(work, "program.py")
        with open(script, "w") as file:
            file.write(program)
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "repro",
                   "--monitor-interval", "0.5", script]
        try:
            result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            return False, f"no end within {timeout:.0f} s\n{expired.stdout or ''}{expired.stderr or ''}"
    output = result.stdout + result.stderr
    worked = result.returncode == 0 and (not connect or all(f"attempt 1 rank {rank}: all_reduce 2" in output
                                                            for rank in (0, 1)))
    return worked, output


def repro() -> None:
    """On one rank: the restarted workers must find no key of the dead attempt where they build their group. The
    keys are always there while the bug is; the failure to connect they cause is a race (4 of 6 runs on torch
    2.13.0; ``python repros/torch_elastic_restart_stale_gloo_address.py`` runs it), so the new attempt stops once it
    has looked."""
    worked, output = restarted(connect=False)
    left = [line for line in output.splitlines() if "keys left by attempt 0" in line and ": 0 keys" not in line]
    assert not left, f"torchrun's restarted workers meet what the dead ones left in the store: {left[0][:300]}"
    assert worked, output[-2000:]


if __name__ == "__main__":
    shared = "--shared-store" not in sys.argv or sys.argv[sys.argv.index("--shared-store") + 1] != "off"
    ok, text = restarted(share_store=shared)
    print(text[-2000:])
    print("\n".join(line for line in text.splitlines() if "keys left by attempt 0" in line))
    print("the restart worked" if ok else "the restart failed")
    sys.exit(0 if ok else 1)

"""How often torchrun's restart after a lost rank works, by rendezvous, on this machine (gloo on 127.0.0.1).

Each Keras trial runs ``examples/keras_restart.py`` on 2 ranks with ``KILL_RANK_AT_EPOCH=2`` (rank 1 dies after
epoch 2 of the first attempt) and ``--max-restarts 1``, then reads whether the second attempt resumed from the backup
(it prints ``attempt 1: ran epochs [3, 4]``); its group comes from ``keras.distribution.initialize()`` (the package's,
Keras 3.12 to 3.15). Each torch trial runs the program of ``repros/torch_elastic_restart_stale_gloo_address.py``
(``init_process_group`` and a DeviceMesh, rank 1 killed, its new incarnation 3 s late) and reads whether the restart
all-reduced. Recipes:

- ``keras-static``: ``--master-addr 127.0.0.1 --master-port P`` (torchrun's static rendezvous, the README's line);
- ``keras-c10d``: ``--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:P --rdzv-id ...``;
- ``torch-c10d``: the torch program, c10d (workers on the agent's store, shared by every attempt);
- ``torch-c10d-own-store``: the same with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a store per attempt).

    python benchmarks/restart_reliability.py --trials 8

prints one row per recipe: trials, restarts that resumed, failures with their first error line, seconds per trial.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _port() -> int:
    from keras_dtensor_mixfix._loopback_ports import free_port as _free_port

    return _free_port()


def _command(recipe: str, port: int, backup: str) -> list:
    common = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1"]
    if recipe == "keras-static":
        launch = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    else:
        launch = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"trial-{port}"]
    return common + launch + [str(ROOT / "examples" / "keras_restart.py"), backup]


RECIPES = ("keras-static", "keras-c10d", "torch-c10d", "torch-c10d-own-store")


def trial(recipe: str, timeout: float) -> tuple:
    if recipe.startswith("torch-"):
        sys.path.insert(0, str(ROOT / "repros"))
        import torch_elastic_restart_stale_gloo_address as repro

        started = time.monotonic()
        resumed, output = repro.restarted(share_store=recipe == "torch-c10d", timeout=timeout)
        lines = [line for line in output.splitlines() if re.search(r"connectFullMesh|no end within", line)]
        return resumed, time.monotonic() - started, "" if resumed else (lines or ["no all_reduce"])[0][:160]
    backup = tempfile.mkdtemp(prefix="restart-trial-")
    env = dict(os.environ, KERAS_BACKEND="torch", GLOO_SOCKET_IFNAME="lo", KILL_RANK_AT_EPOCH="2",
               OMP_NUM_THREADS="1")
    started = time.monotonic()
    try:
        done = subprocess.run(_command(recipe, _port(), backup), env=env, capture_output=True, text=True,
                              timeout=timeout)
        output = done.stdout + done.stderr
        resumed = done.returncode == 0 and "attempt 1: ran epochs [3, 4]" in output
    except subprocess.TimeoutExpired as expired:
        output = f"hung: no end within {timeout:.0f} s\n{expired.stdout or ''}{expired.stderr or ''}"
        resumed = False
    seconds = time.monotonic() - started
    why = ""
    if not resumed:
        lines = [line for line in output.splitlines()
                 if re.search(r"connectFullMesh|Connection refused|hung|Timeout|timed out", line)]
        why = (lines[0] if lines else output.strip().splitlines()[-1] if output.strip() else "no output")[:160]
        log = os.path.join(backup, "torchrun.log")
        with open(log, "w") as file:
            file.write(output)
        why += f" (log: {log})"
    return resumed, seconds, why


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--timeout", type=float, default=180.0)
    args = parser.parse_args()
    import torch

    print(f"torch {torch.__version__}, {args.trials} trials per recipe, 2 gloo ranks on 127.0.0.1")
    print("| recipe | trials | resumed | seconds per trial (median) | failures |")
    print("|---|---|---|---|---|")
    for recipe in args.recipes.split(","):
        results = [trial(recipe, args.timeout) for _ in range(args.trials)]
        resumed = sum(result[0] for result in results)
        seconds = sorted(result[1] for result in results)[len(results) // 2]
        failures = "; ".join(sorted({result[2] for result in results if not result[0]})) or "none"
        print(f"| {recipe} | {args.trials} | {resumed} | {seconds:.1f} | {failures} |", flush=True)


if __name__ == "__main__":
    main()

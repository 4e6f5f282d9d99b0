"""Memory of a sharded Keras model, phase by phase: one process beside each rank of 2, 4 and 8, and beside JAX.

    python benchmarks/memory_phases.py --size small --ranks 1,2          # a quick run (~25 s on 2 cores)
    python benchmarks/memory_phases.py                                   # medium Gemma, 1, 2, 4 and 8 ranks
    python benchmarks/memory_phases.py --phases build,train,predict --json memory.json
    python benchmarks/memory_phases.py --jax --jax-python /path/to/venv-with-jax/bin/python
    python benchmarks/memory_phases.py --mmap-threshold 65536            # glibc returns every large block on free

Every row runs in fresh processes: torch in one process (plain Keras, no distribution: the reference),
torch on N gloo ranks on 127.0.0.1 (``torch.distributed.run``) under ``keras.distribution.ModelParallel`` on a
("batch", "model") mesh of shape (1, N), sharded by ``GemmaBackbone.get_layout_map`` with this package installed
explicitly (``KERAS_DTENSOR_MIXFIX=0``, ``keras_integration.install()``, which patches too), and with ``--jax``
JAX in one process with N virtual CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N``, the same
mesh and layout map, ``jit_compile=True`` as JAX runs; ``--jax-python`` picks an interpreter that has jax).
Every torch process runs one intra-op thread.

Model: keras_hub ``GemmaCausalLM`` on a random ``GemmaBackbone`` (no download; keras_hub: ``pip install --no-deps
keras-hub==0.32.0 tokenizers sentencepiece`` and ``pip install regex kagglehub``), ``preprocessor=None``, Adam,
sparse categorical cross-entropy from logits, ``jit_compile=False``; 8 fixed random sequences of 64 tokens.
``--size medium`` (default): vocabulary 32000, 8 layers, hidden 1024, 8 heads of 128 (8 key/value heads),
``intermediate_dim`` 8192 (Gemma halves it: two 4096-wide gating kernels), about 670 MB of float32 weights;
``--size small``: vocabulary 8000, 4 layers, hidden 512, 8 heads of 64, ``intermediate_dim`` 2048.

Phases, in this order, each measured in every process (``--phases``; ``build`` always runs): ``build`` (the model
and its weights, compiled), ``optimizer+train`` (``optimizer.build`` and 2 ``train_on_batch``), ``save_weights``
and ``load_weights`` (one ``.weights.h5`` in a directory the ranks share), ``save`` (``.keras``), ``predict`` (its
result held until the phase is measured), and ``checkpoint_save`` / ``checkpoint_load`` (torch only, when
``keras_dtensor_mixfix.checkpoint`` has ``save(model, directory)`` and ``load(model, directory)``).

Per process and phase: glibc's bytes in use (``mallinfo2()``: ``uordblks + hblkhd``, exact to the byte and the
same run after run, unlike RSS) after the phase and a ``gc.collect()``, minus before: what the phase *adds*; its
*peak adds*: the highest in-use value sampled every ``--interval-ms`` (2 ms) by a thread during the phase, minus
before (a sampled peak: a lower bound, and the thread needs the GIL, which Python hands over every 5 ms at worst);
RSS after the phase and VmHWM, the phase's peak RSS (reset before each phase through ``/proc/self/clear_refs``);
the phase's seconds. Python's small-object arenas are mmapped by Python itself: RSS sees them, ``mallinfo2``
does not. A ratio is this rank's figure ÷ the one-process figure (n/a where that is under 10 MB); a JAX row's is
its whole process's figure ÷ N (its N devices share one process) ÷ JAX's on 1 device. Sharding N ways makes 1/N
the ideal; the target is 1/N + 0.05 (predict excepted), and the slowest rank's build seconds at N = 4 at most
0.4 of one process's. glibc's ``MALLOC_MMAP_THRESHOLD_`` is unset in the workers unless ``--mmap-threshold`` sets
it for all of them: below it, freed blocks may stay in RSS; above it, each is unmapped on free.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

SIZES: Dict[str, Dict[str, int]] = {
    "medium": dict(vocabulary_size=32000, num_layers=8, num_query_heads=8, num_key_value_heads=8, hidden_dim=1024,
                   intermediate_dim=8192, head_dim=128),
    "small": dict(vocabulary_size=8000, num_layers=4, num_query_heads=8, num_key_value_heads=8, hidden_dim=512,
                  intermediate_dim=2048, head_dim=64),
}
BATCH, LENGTH = 8, 64
SELECTABLE = ("build", "train", "save_weights", "load_weights", "save", "predict", "checkpoint")
"""``--phases`` names; ``train`` is the phase ``optimizer+train``, ``checkpoint`` both checkpoint phases."""
TARGET_MARGIN = 0.05  # the target: what a rank adds ÷ what one process adds ≤ 1/N + 0.05 (predict excepted)
BUILD_TIME_TARGET = {4: 0.4}  # a rank's build seconds ÷ one process's, by world size
MB = 1e6
RATIO_FLOOR = 10 * MB  # a one-process figure under this (HDF5's and Keras' caches, say) is noise to divide by


# ----------------------------------------------------------------------------- measuring (worker side)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_mallinfo2: Optional[Callable[[], _Mallinfo2]] = None


def in_use() -> int:
    """Bytes glibc has handed out and not taken back, in every arena and in mmapped blocks."""
    global _mallinfo2
    if _mallinfo2 is None:
        function = ctypes.CDLL("libc.so.6").mallinfo2  # glibc 2.33+; mallinfo's int fields wrap past 2 GiB
        function.restype = _Mallinfo2
        _mallinfo2 = function
    info = _mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _proc_status(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field_name)


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # 5: reset VmHWM to the current RSS


class PeakSampler:
    """A thread that samples :func:`in_use` and keeps the highest value of the current phase and of the run."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._lock = threading.Lock()  # a sample taken before a phase's reset must not land after it
        self.phase_peak = self.run_peak = in_use()
        threading.Thread(target=self._loop, name="in-use sampler", daemon=True).start()

    def _loop(self) -> None:
        while True:
            time.sleep(self._interval_s)
            self.sample()

    def sample(self) -> int:
        with self._lock:
            value = in_use()
            self.phase_peak = max(self.phase_peak, value)
            self.run_peak = max(self.run_peak, value)
        return value

    def start_phase(self) -> int:
        """The in-use value now, which becomes the phase's peak so far."""
        with self._lock:
            value = in_use()
            self.phase_peak = value
            self.run_peak = max(self.run_peak, value)
        return value


# ----------------------------------------------------------------------------- the workload (worker side)


@dataclass
class Workload:
    backend: str  # "torch" or "jax"
    world: int  # torch: ranks; JAX: devices of the one process
    size: str
    directory: str  # shared by the ranks of one run: the files are written once, by rank 0
    checkpoint: Any = None  # keras_dtensor_mixfix.checkpoint, when it has save and load
    checkpoint_missing: str = ""  # else why the checkpoint phases are skipped
    model: Any = None
    x: Dict[str, Any] = field(default_factory=dict)
    y: Any = None


def _build(w: Workload) -> None:
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(**SIZES[w.size])
    w.model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    w.model.compile(optimizer=keras.optimizers.Adam(1e-3),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    jit_compile=w.backend == "jax")


def _train(w: Workload) -> None:
    w.model.optimizer.build(w.model.trainable_variables)
    for _ in range(2):
        w.model.train_on_batch(w.x, w.y)


def _save_weights(w: Workload) -> None:
    w.model.save_weights(os.path.join(w.directory, "m.weights.h5"))


def _load_weights(w: Workload) -> None:
    w.model.load_weights(os.path.join(w.directory, "m.weights.h5"))


def _save(w: Workload) -> None:
    w.model.save(os.path.join(w.directory, "m.keras"))


def _predict(w: Workload) -> Any:
    return w.model.predict(w.x, batch_size=BATCH, verbose=0)  # returned: held until the phase is measured


def _checkpoint_save(w: Workload) -> None:
    w.checkpoint.save(w.model, os.path.join(w.directory, "checkpoint"))


def _checkpoint_load(w: Workload) -> None:
    w.checkpoint.load(w.model, os.path.join(w.directory, "checkpoint"))


PHASES: Dict[str, Callable[[Workload], Any]] = {
    "build": _build,
    "optimizer+train": _train,
    "save_weights": _save_weights,
    "load_weights": _load_weights,
    "save": _save,
    "predict": _predict,
    "checkpoint_save": _checkpoint_save,
    "checkpoint_load": _checkpoint_load,
}
CHECKPOINT_PHASES = ("checkpoint_save", "checkpoint_load")


def _checkpoint_api(backend: str) -> Tuple[Any, str]:
    """``(module, "")``, or ``(None, why the checkpoint phases are skipped)``."""
    if backend != "torch":
        return None, "keras_dtensor_mixfix.checkpoint is for the torch backend"
    try:
        module = importlib.import_module("keras_dtensor_mixfix.checkpoint")
    except ImportError as exc:
        return None, f"keras_dtensor_mixfix.checkpoint is not importable ({exc})"
    missing = [name for name in ("save", "load") if not callable(getattr(module, name, None))]
    if missing:
        return None, f"keras_dtensor_mixfix.checkpoint has no {' and no '.join(missing)}"
    return module, ""


def _alone() -> None:
    """The barrier of a single process: nothing to wait for."""


def _start(w: Workload) -> Tuple[Callable[[], None], Dict[str, str]]:
    """Imports, process group, distribution and data, all before the baseline: ``(barrier, versions)``."""
    import numpy as np

    barrier: Callable[[], None] = _alone
    versions: Dict[str, str] = {}
    if w.backend == "torch":
        import torch

        torch.set_num_threads(1)  # several ranks share the cores; the one process matches them
        versions["torch"] = torch.__version__
    else:
        import jax

        jax.devices()  # start the CPU client and its N devices now, not in the first phase
        versions["jax"] = jax.__version__
    import keras
    import keras_hub

    versions.update(keras=keras.__version__, keras_hub=keras_hub.__version__)
    if w.backend == "torch" and w.world > 1:
        import torch.distributed as dist

        from keras_dtensor_mixfix import keras_integration

        keras_integration.install()
        keras.distribution.initialize()  # the process group from torch.distributed.run's environment
        barrier = dist.barrier
    if w.backend == "jax" or w.world > 1:
        devices = keras.distribution.list_devices()
        mesh = keras.distribution.DeviceMesh((1, w.world), ["batch", "model"], devices)
        layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
    w.checkpoint, w.checkpoint_missing = _checkpoint_api(w.backend)
    ids = np.random.default_rng(0).integers(1, SIZES[w.size]["vocabulary_size"], size=(BATCH, LENGTH)).astype("int32")
    w.x = {"token_ids": ids, "padding_mask": np.ones(ids.shape, bool)}
    w.y = ids
    return barrier, versions


def _weight_bytes(model: Any) -> Tuple[int, int]:
    """``(global, this process's)`` bytes of the model's weights (optimizer state excluded)."""
    import numpy as np

    total = local = 0
    for variable in model.weights:
        size = int(np.prod(variable.shape)) * np.dtype(variable.dtype).itemsize
        total += size
        value = variable.value
        if hasattr(value, "to_local"):  # a DTensor: this rank's shard
            local += value.to_local().numel() * value.element_size()
        elif hasattr(value, "addressable_shards"):  # a jax.Array: every device of this process
            local += sum(shard.data.nbytes for shard in value.addressable_shards)
        else:
            local += size
    return total, local


def _settle(w: Workload) -> None:
    """JAX dispatches asynchronously: a phase ends when the computations it started have (torch's CPU ops are
    synchronous)."""
    if w.backend == "jax" and w.model is not None:
        import jax

        jax.block_until_ready([v.value for v in w.model.variables + w.model.optimizer.variables])


def _measure(phase: Callable[[Workload], Any], w: Workload, sampler: PeakSampler,
             barrier: Callable[[], None]) -> Dict[str, float]:
    gc.collect()
    barrier()  # the ranks start each phase together
    before = sampler.start_phase()
    rss_before = _proc_status("VmRSS")
    _reset_peak_rss()
    start, cpu_start = time.perf_counter(), time.process_time()
    kept = phase(w)
    _settle(w)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    sampler.sample()  # the phase's end state, its result and garbage still held
    peak = sampler.phase_peak
    gc.collect()
    after = in_use()
    figures = {"in_use_before": before, "in_use_after": after, "adds": after - before, "peak": peak,
               "peak_adds": peak - before, "rss_before": rss_before, "rss_after": _proc_status("VmRSS"),
               "hwm": _proc_status("VmHWM"), "seconds": seconds,  # VmHWM last: it covers the collection too
               "cpu_seconds": cpu_seconds}
    del kept
    return figures


def _write(path: str, result: Dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as out:
        json.dump(result, out)
    os.replace(path + ".tmp", path)  # the driver never reads half a file


def worker(backend: str, world: int, size: str, phases: List[str], run_dir: str, interval_s: float) -> None:
    """One process's measurement; writes ``run_dir/rank<R>.json`` after every phase (a crash keeps what ran)."""
    rank = int(os.environ.get("RANK", "0"))
    path = os.path.join(run_dir, f"rank{rank}.json")
    w = Workload(backend=backend, world=world, size=size, directory=run_dir)
    result: Dict[str, Any] = {"backend": backend, "world": world, "rank": rank, "phases": {}, "skipped": {}}
    current = "start"
    try:
        barrier, result["versions"] = _start(w)
        gc.collect()
        result["baseline"] = {"in_use": in_use(), "rss": _proc_status("VmRSS")}
        sampler = PeakSampler(interval_s)
        for current in phases:
            if current in CHECKPOINT_PHASES and w.checkpoint is None:
                result["skipped"][current] = w.checkpoint_missing
            else:
                result["phases"][current] = _measure(PHASES[current], w, sampler, barrier)
                if current == "build":
                    result["weights"], result["local_weights"] = _weight_bytes(w.model)
                result["run_peak_adds"] = sampler.run_peak - result["baseline"]["in_use"]
            _write(path, result)
    except BaseException:
        result["error"] = {"phase": current, "traceback": traceback.format_exc()}
        _write(path, result)
        raise


# ----------------------------------------------------------------------------- driver


@dataclass
class Run:
    backend: str
    world: int
    wall_s: float
    returncode: int
    ranks: List[Dict[str, Any]]
    output_tail: str

    @property
    def label(self) -> str:
        if self.backend == "jax":
            return f"JAX, {self.world} device{'s' if self.world > 1 else ''} in 1 process"
        return "torch, 1 process" if self.world == 1 else f"torch, {self.world} ranks"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(backend: str, world: int, args: argparse.Namespace, root: str) -> Run:
    run_dir = os.path.join(root, f"{backend}-{world}")
    os.makedirs(run_dir)
    script = os.path.abspath(__file__)
    worker_args = [script, "--worker", backend, "--world", str(world), "--size", args.size,
                   "--run-dir", run_dir, "--interval-ms", str(args.interval_ms), "--phases", args.phases]
    if backend == "jax":
        command = [args.jax_python, *worker_args]
    elif world == 1:
        command = [sys.executable, *worker_args]
    else:  # a static rendezvous on 127.0.0.1 (--standalone would publish the host's name to the ranks)
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
                   "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *worker_args]
    env = dict(os.environ, KERAS_BACKEND=backend, KERAS_DTENSOR_MIXFIX="0", GLOO_SOCKET_IFNAME="lo")
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if args.mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    if backend == "torch":
        env["OMP_NUM_THREADS"] = "1"  # else torch.distributed.run says on stderr that it sets it
    else:
        env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={world}", JAX_PLATFORMS="cpu")
    start = time.perf_counter()
    # a session of its own: a run past --timeout is killed with its ranks, not just torch.distributed.run
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        output += f"\n(killed after --timeout {args.timeout:.0f} s)"
    wall = time.perf_counter() - start
    ranks = []
    for rank in range(world if backend == "torch" else 1):
        path = os.path.join(run_dir, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as saved:
                ranks.append(json.load(saved))
        else:  # died before its first result: the run's output tells why
            ranks.append({"rank": rank, "phases": {}, "skipped": {}, "error": {"phase": "start", "traceback": ""}})
    return Run(backend, world, wall, process.returncode, ranks, output[-6000:])


def _source_state() -> str:
    """The commit of the package's source tree, and whether src/ differs from it (others may be editing it)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "src"], capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "source commit unknown"
    return f"source at {head}{' with uncommitted changes in src/' if dirty else ''}"


def _jax_missing(python: str) -> Optional[str]:
    """Why the JAX rows cannot run with ``python``, or None."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('jax') is None)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0
    except OSError as exc:
        return f"cannot run {python} ({exc})"
    return None if found else f"jax is not importable by {python} (--jax-python picks another interpreter)"


def _mb(value: Optional[float]) -> str:
    return "" if value is None else f"{value / MB:.1f}"


def _ratio(value: float, reference: Optional[float]) -> Optional[float]:
    if reference is None or reference < RATIO_FLOOR:  # a phase that frees memory has no share to compare
        return None
    return value / reference


def _fmt_ratio(ratio: Optional[float]) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}"


def _rows(runs: List[Run]) -> List[Tuple[str, Run, Dict[str, Any]]]:
    rows = []
    for run in runs:
        for result in run.ranks:
            ranked = run.backend == "torch" and run.world > 1
            rows.append((f"torch, rank {result['rank']} of {run.world}" if ranked else run.label, run, result))
    return rows


def _reference(runs: List[Run], backend: str) -> Optional[Dict[str, Any]]:
    for run in runs:
        if run.backend == backend and run.world == 1:
            return run.ranks[0]
    return None


def _per_device(run: Run, value: float) -> float:
    return value / run.world if run.backend == "jax" else value  # JAX's N devices share the one process


def report(runs: List[Run], phases: List[str]) -> None:
    rows = _rows(runs)
    worlds = sorted({run.world for run in runs if run.backend == "torch" and run.world > 1})
    print(f"\nRatios: a torch rank's figure ÷ torch's in 1 process; a JAX row's whole process ÷ its N devices ÷ "
          f"JAX's on 1 device; n/a where that reference is under {RATIO_FLOOR / MB:.0f} MB. \"RSS after / peak\": "
          f"VmRSS after the phase / VmHWM during it.")
    for phase in phases:
        print(f"\n### `{phase}`\n")
        print("| process | adds MB | adds ÷ 1 process | peak adds MB | peak ÷ 1 process | RSS after / peak MB | s |")
        print("|---|---|---|---|---|---|---|")
        ratios: Dict[int, List[Tuple[Optional[float], Optional[float]]]] = {}  # torch world: (adds, peak) per rank
        for label, run, result in rows:
            figures = result["phases"].get(phase)
            if figures is None:
                why = result["skipped"].get(phase) or (
                    f"failed in `{result['error']['phase']}`" if "error" in result else "not run")
                print(f"| {label} | {why} | | | | | |")
                continue
            reference = (_reference(runs, run.backend) or {}).get("phases", {}).get(phase, {})
            adds = _ratio(_per_device(run, figures["adds"]), reference.get("adds"))
            peak = _ratio(_per_device(run, figures["peak_adds"]), reference.get("peak_adds"))
            print(f"| {label} | {_mb(figures['adds'])} | {_fmt_ratio(adds)} | {_mb(figures['peak_adds'])} | "
                  f"{_fmt_ratio(peak)} | {_mb(figures['rss_after'])} / {_mb(figures['hwm'])} | "
                  f"{figures['seconds']:.2f} |")
            if run.backend == "torch" and run.world > 1:
                ratios.setdefault(run.world, []).append((adds, peak))
        print()
        for n in worlds:
            bound = 1 / n + TARGET_MARGIN
            verdicts = []
            for what, column in (("adds", 0), ("peak adds", 1)):
                known = [pair[column] for pair in ratios.get(n, []) if pair[column] is not None]
                worst = max(known) if known else None
                verdicts.append(f"{what} n/a" if worst is None else
                                f"{what} {worst:.2f} {'PASS' if worst <= bound else 'MISS'}")
            print(f"- {n} ranks: ideal {1 / n:.2f}, target ≤ {bound:.2f}; worst rank: {', '.join(verdicts)}")
            if phase == "build":
                print(f"- {n} ranks: {_build_time_verdict(runs, n)}")
    print("\n### the whole run\n")
    print("| process | in use after imports MB | RSS after imports MB | run's peak adds MB | ÷ 1 process | "
          "weights: whole / here MB | wall s (launch to exit) |")
    print("|---|---|---|---|---|---|---|")
    for label, run, result in rows:
        if "baseline" not in result:
            print(f"| {label} | failed at start | | | | | {run.wall_s:.0f} |")
            continue
        reference = _reference(runs, run.backend) or {}
        ratio = _ratio(_per_device(run, result.get("run_peak_adds", 0)), reference.get("run_peak_adds"))
        print(f"| {label} | {_mb(result['baseline']['in_use'])} | {_mb(result['baseline']['rss'])} | "
              f"{_mb(result.get('run_peak_adds'))} | {_fmt_ratio(ratio)} | "
              f"{_mb(result.get('weights'))} / {_mb(result.get('local_weights'))} | {run.wall_s:.0f} |")
    skipped: Dict[str, Dict[str, None]] = {}  # why: the runs (ordered, once each)
    for run in runs:
        for result in run.ranks:
            for phase, why in result["skipped"].items():
                skipped.setdefault(f"`{phase}` skipped: {why}", {})[run.label] = None
    for what, labels in skipped.items():
        print(f"\n- {what} ({'; '.join(labels)})")
    for run in runs:
        failed = [result for result in run.ranks if "error" in result]
        if failed or run.returncode != 0:
            print(f"\n- {run.label} FAILED (exit {run.returncode})"
                  + "".join(f"; rank {r['rank']} in `{r['error']['phase']}`" for r in failed))
            tracebacks = {r["error"]["traceback"] for r in failed if r["error"]["traceback"]}
            print("\n```text\n" + ("\n".join(tracebacks) or run.output_tail).strip()[-5000:] + "\n```")


def _build_time_verdict(runs: List[Run], n: int) -> str:
    """The slowest rank's build time ÷ one process's, in wall seconds and in CPU seconds (what a rank's build costs
    its core: on a machine with fewer cores than ranks the wall time also holds the other ranks' turns), against
    ``BUILD_TIME_TARGET`` where it names ``n``."""
    reference = (_reference(runs, "torch") or {}).get("phases", {}).get("build", {})
    builds = [result["phases"]["build"] for run in runs if run.backend == "torch" and run.world == n
              for result in run.ranks if "build" in result["phases"]]
    if not reference.get("seconds") or not builds:
        return "build time n/a"
    wall = max(build["seconds"] for build in builds) / reference["seconds"]
    cpu = max(build.get("cpu_seconds", 0.0) for build in builds) / max(reference.get("cpu_seconds", 0.0), 1e-9)
    target = BUILD_TIME_TARGET.get(n)
    verdict = "" if target is None else f"; target ≤ {target:.2f}: {'PASS' if cpu <= target else 'MISS'} (CPU)"
    return (f"build time, slowest rank ÷ one process: {wall:.2f} wall, {cpu:.2f} CPU "
            f"({os.cpu_count()} cores for {n} ranks){verdict}")


def _phases(requested: str) -> List[str]:
    chosen = {name.strip() for name in requested.split(",") if name.strip()}
    unknown = chosen - set(SELECTABLE)
    if unknown:
        raise SystemExit(f"--phases: unknown {', '.join(sorted(unknown))} (of {','.join(SELECTABLE)})")
    if "load_weights" in chosen and "save_weights" not in chosen:
        raise SystemExit("--phases: load_weights loads the file save_weights writes: select both")
    chosen.add("build")  # every other phase needs the model
    expanded = {"train": ["optimizer+train"], "checkpoint": list(CHECKPOINT_PHASES)}
    return [phase for name in SELECTABLE if name in chosen for phase in expanded.get(name, [name])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="medium", help="the Gemma size (see above)")
    parser.add_argument("--ranks", default="1,2,4,8", help="torch world sizes; 1, the reference, always runs")
    parser.add_argument("--phases", default=",".join(SELECTABLE), help=f"of {','.join(SELECTABLE)}")
    parser.add_argument("--jax", action="store_true", help="add JAX rows: one process, N virtual devices")
    parser.add_argument("--jax-python", default=sys.executable, help="the interpreter of the JAX rows")
    parser.add_argument("--mmap-threshold", type=int, default=None, metavar="BYTES",
                        help="set glibc's MALLOC_MMAP_THRESHOLD_ in every worker (default: unset)")
    parser.add_argument("--interval-ms", type=float, default=2.0, help="in-use sampling period during a phase")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every raw figure here too")
    parser.add_argument("--worker", choices=("torch", "jax"), help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    phases = _phases(args.phases)
    if args.worker:
        worker(args.worker, args.world, args.size, phases, args.run_dir, args.interval_ms / 1e3)
        sys.stdout.flush()
        sys.stderr.flush()
        # the results are on disk: skip interpreter teardown, where torch's gloo sometimes aborts a rank
        # that finished (repros/torch_gloo_exit_abort.py)
        os._exit(0)
    worlds = sorted({1, *(int(n) for n in args.ranks.split(","))})
    print(f"Gemma {args.size} ({', '.join(f'{k} {v}' for k, v in SIZES[args.size].items())}), {BATCH}×{LENGTH} "
          f"tokens; torch ranks {worlds}; MALLOC_MMAP_THRESHOLD_ "
          f"{'unset' if args.mmap_threshold is None else args.mmap_threshold}; {_source_state()}; "
          f"load average at start {os.getloadavg()[0]:.1f}", flush=True)
    jobs = [("torch", n) for n in worlds]
    if args.jax:
        missing = _jax_missing(args.jax_python)
        if missing:
            print(f"JAX rows skipped: {missing}")
        else:
            jobs += [("jax", n) for n in worlds]
    runs: List[Run] = []
    with tempfile.TemporaryDirectory(prefix="mixfix-memory-") as root:
        for backend, world in jobs:
            run = _launch(backend, world, args, root)
            runs.append(run)
            print(f"{run.label}: {run.wall_s:.0f} s, exit {run.returncode}", flush=True)
    versions = {name: version for run in runs for result in run.ranks
                for name, version in result.get("versions", {}).items()}
    print(f"\n{', '.join(f'{name} {version}' for name, version in versions.items())}; "
          f"load average at end {os.getloadavg()[0]:.1f}")
    report(runs, phases)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"size": args.size, "config": SIZES[args.size], "batch": BATCH, "length": LENGTH,
                       "mmap_threshold": args.mmap_threshold, "phases": phases,
                       "runs": [vars(run) for run in runs]}, out, indent=1)
    return 1 if any(run.returncode != 0 for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmarks of keras_dtensor_mixfix: every figure in BENCHMARKS.md comes from this one command.

    python benchmarks/run.py                 # full run (a few minutes on 2 cores)
    python benchmarks/run.py --quick         # fewer rounds, no inductor, fewer subprocesses
    python benchmarks/run.py --json out.json # also write the raw figures

CPU, float32. The per-op cases (P1-P4) run twice: in this process on world size 1, and in two
rank workers (gloo on 127.0.0.1) where ``Shard(0)`` really slices. They are timed in rounds: each round
measures the unpatched cases, then patches and measures the patched ones (the order of the two
halves alternates), so every ratio compares figures taken side by side in one process. Each
figure is microseconds per call over a batch of calls, with the garbage collector off during
the batch; min and median are over the rounds. A per-op ratio's verdict uses the median of the
per-round ratios (each pairs two figures taken seconds apart, so load that drifts during the run
cancels out); the ratio of the minima and the ratio of the medians are shown beside it, and a
verdict says when the ratio of the minima would miss.

Import-time figures run fresh Python subprocesses, interleaved, several times each. P6 runs
benchmarks/keras_step.py's measurement in the same two rank workers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

# The in-process benchmark patches and unpatches explicitly: keep auto-activation out of it,
# and keep torch.compile's on-disk caches cold so first-call compile times are real.
os.environ["KERAS_DTENSOR_MIXFIX"] = "0"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("KERAS_BACKEND", "torch")  # for P6's rank workers
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="mixfix-bench-inductor-")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SHAPE = (64, 64)
TARGETS = {
    "P1": ("mixed patched / mixed under implicit_replication()", 0.25),
    "P2": ("mixed patched / pure DTensor op (both Shard(0))", 2.0),
    "P3": ("pure DTensor op, patched / unpatched", 1.05),
    "P3b": ("pure in-place DTensor op (copy_), patched / unpatched", 1.05),
    "P4": ("plain-tensor op, patched / unpatched", 1.02),
}


# ----------------------------------------------------------------------------- timing helpers


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def timed(fn: Callable[[], Any], calls: int) -> float:
    """Microseconds per call of ``fn`` over ``calls`` calls, GC off (as timeit does)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
    finally:
        if enabled:
            gc.enable()
    return elapsed / calls * 1e6


def summary(values: List[float]) -> Dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "n": len(values)}


class Rounds:
    """Collects per-round figures for named cases."""

    def __init__(self) -> None:
        self.samples: Dict[str, List[float]] = {}

    def add(self, name: str, value: float) -> None:
        self.samples.setdefault(name, []).append(value)

    def stat(self, name: str) -> Dict[str, float]:
        return summary(self.samples[name])


# ----------------------------------------------------------------------------- per-op cases


def per_op(rounds: int, calls: int, plain_calls: int) -> Tuple[Rounds, Dict[str, Any]]:
    """P1-P4 on a 1-D mesh over every rank of the current process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    import keras_dtensor_mixfix as mf

    torch.manual_seed(0)  # every rank builds the same global tensors
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    a = distribute_tensor(torch.randn(SHAPE), mesh, [Shard(0)])
    b = distribute_tensor(torch.randn(SHAPE), mesh, [Shard(0)])
    c = distribute_tensor(torch.randn(SHAPE), mesh, [Shard(0)])
    plain = torch.randn(SHAPE)
    plain2 = torch.randn(SHAPE)

    def pure() -> Any:
        return a * b

    def pure_inplace() -> Any:
        return c.copy_(b)  # an op that writes into an argument: those get a different rule

    def plain_op() -> Any:
        return plain * plain2

    def mixed() -> Any:
        return a * plain

    def implicit() -> float:
        with implicit_replication():
            return timed(mixed, calls)

    extra: Dict[str, Any] = {}
    start = time.perf_counter()
    mf.patch()
    extra["first_patch_ms"] = (time.perf_counter() - start) * 1e3
    # Sanity: the patched mixed op is right.
    torch.testing.assert_close((a * plain).full_tensor(), a.full_tensor() * plain)
    start = time.perf_counter()
    mf.unpatch()
    extra["first_unpatch_ms"] = (time.perf_counter() - start) * 1e3

    # Warm every path once (sharding-propagation caches, our caches).
    for fn in (pure, pure_inplace, plain_op):
        timed(fn, 200)
    with implicit_replication():
        timed(mixed, 200)

    data = Rounds()
    for index in range(rounds):
        halves = ("unpatched", "patched") if index % 2 == 0 else ("patched", "unpatched")
        for half in halves:
            gc.collect()
            dist.barrier()  # on 2 ranks: both time the same half at the same time
            if half == "patched":
                start = time.perf_counter()
                mf.patch()
                data.add("patch() ms", (time.perf_counter() - start) * 1e3)
                timed(mixed, 100)  # refill caches that unpatch() cleared
                data.add("pure patched", timed(pure, calls))
                data.add("pure in-place patched", timed(pure_inplace, calls))
                data.add("plain patched", timed(plain_op, plain_calls))
                data.add("mixed patched", timed(mixed, calls))
                start = time.perf_counter()
                mf.unpatch()
                data.add("unpatch() ms", (time.perf_counter() - start) * 1e3)
            else:
                data.add("pure unpatched", timed(pure, calls))
                data.add("pure in-place unpatched", timed(pure_inplace, calls))
                data.add("plain unpatched", timed(plain_op, plain_calls))
                data.add("mixed implicit_replication", implicit())
    return data, extra


def per_op_on_rank(rounds: int, calls: int, plain_calls: int) -> Tuple[Dict[str, List[float]], Dict[str, Any]]:
    """``per_op`` in a run_on_ranks worker (the figures come back as plain data)."""
    torch.set_num_threads(1)  # two ranks share the two cores
    data, extra = per_op(rounds, calls, plain_calls)
    return data.samples, extra


def per_op_two_ranks(rounds: int, calls: int, plain_calls: int) -> Rounds:
    """The P1-P4 cases on 2 ranks (gloo): ``Shard(0)`` really slices, each rank times its own half.

    Both ranks time at once on the 2 cores; rank 0's figures are reported.
    """
    from keras_dtensor_mixfix.testing import run_on_ranks

    samples, _ = run_on_ranks(per_op_on_rank, rounds, calls, plain_calls, world_size=2, timeout=1800)[0]
    data = Rounds()
    data.samples = samples
    return data


def keras_step(rounds: int, steps: int) -> Rounds:
    """P6 (benchmarks/keras_step.py): a Keras ModelParallel step on 2 ranks, plain ÷ DTensor batches."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import keras_step as ks

    from keras_dtensor_mixfix.testing import run_on_ranks

    plain, dtensor = run_on_ranks(ks.measure, rounds, steps, world_size=2, timeout=1800)[0]
    data = Rounds()
    data.samples = {"keras: ModelParallel step, plain batches ms": plain,
                    "keras: ModelParallel step, DTensor batches by hand ms": dtensor}
    return data


# ----------------------------------------------------------------------------- no-target cases


def grad_cases(rounds: int, calls: int) -> Rounds:
    """Forward + backward of a mixed op whose plain operand requires grad."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    import keras_dtensor_mixfix as mf

    mesh = init_device_mesh("cpu", (1,))
    w = distribute_tensor(torch.randn(SHAPE), mesh, [Shard(0)]).requires_grad_()
    w2 = distribute_tensor(torch.randn(SHAPE), mesh, [Shard(0)]).requires_grad_()
    x = torch.randn(SHAPE, requires_grad=True)

    def mixed() -> None:
        w.grad = None
        x.grad = None
        (w * x).sum().backward()

    def pure() -> None:
        w.grad = None
        w2.grad = None
        (w * w2).sum().backward()

    data = Rounds()
    for index in range(rounds):
        halves = ("unpatched", "patched") if index % 2 == 0 else ("patched", "unpatched")
        for half in halves:
            gc.collect()
            if half == "patched":
                with mf.patched():
                    timed(mixed, 20)
                    data.add("grad: mixed fwd+bwd, patched", timed(mixed, calls))
                    data.add("grad: pure DTensor fwd+bwd, patched", timed(pure, calls))
                    assert type(x.grad) is torch.Tensor
            else:
                with implicit_replication():
                    timed(mixed, 20)
                    data.add("grad: mixed fwd+bwd, implicit_replication", timed(mixed, calls))
                data.add("grad: pure DTensor fwd+bwd, unpatched", timed(pure, calls))
    return data


def foreach_cases(rounds: int, steps: int, params: int = 100) -> Rounds:
    """``_foreach_*`` over 100 parameters: a mixed ``_foreach_add_`` and Adam(foreach=True) steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import keras_dtensor_mixfix as mf

    mesh = init_device_mesh("cpu", (1,))
    shape = (32, 32)
    dt_params = [distribute_tensor(torch.randn(shape), mesh, [Shard(0)]) for _ in range(params)]
    dt_updates = [distribute_tensor(torch.randn(shape), mesh, [Shard(0)]) for _ in range(params)]
    plain_updates = [torch.randn(shape) for _ in range(params)]

    def add_mixed() -> None:
        torch._foreach_add_(dt_params, plain_updates, alpha=1e-6)

    def add_pure() -> None:
        torch._foreach_add_(dt_params, dt_updates, alpha=1e-6)

    def make_adam(kind: str) -> Callable[[], None]:
        if kind == "pure":
            ps = [torch.nn.Parameter(distribute_tensor(torch.randn(shape), mesh, [Shard(0)])) for _ in range(params)]
        else:  # half DTensor, half plain parameters in one foreach list
            ps = [torch.nn.Parameter(distribute_tensor(torch.randn(shape), mesh, [Shard(0)])) if i % 2 == 0
                  else torch.nn.Parameter(torch.randn(shape)) for i in range(params)]
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = torch.optim.Adam(ps, lr=1e-3, foreach=True)

        def step() -> None:
            opt.step()

        return step

    data = Rounds()
    with mf.patched():
        adam_mixed = make_adam("mixed")
    # One optimizer for both halves: patched / unpatched compares the same parameters and state.
    adam_pure = make_adam("pure")
    for index in range(rounds):
        halves = ("unpatched", "patched") if index % 2 == 0 else ("patched", "unpatched")
        for half in halves:
            gc.collect()
            if half == "patched":
                with mf.patched():
                    add_mixed()
                    adam_mixed()
                    data.add("foreach: _foreach_add_ 100 DTensor + 100 plain, patched (us/call)", timed(add_mixed, steps))
                    data.add("foreach: _foreach_add_ 100 DTensor + 100 DTensor, patched (us/call)", timed(add_pure, steps))
                    data.add("foreach: Adam step, 50 DTensor + 50 plain params, patched (us/step)", timed(adam_mixed, steps))
                    data.add("foreach: Adam step, 100 DTensor params, patched (us/step)", timed(adam_pure, steps))
            else:
                add_pure()
                adam_pure()
                data.add("foreach: _foreach_add_ 100 DTensor + 100 DTensor, unpatched (us/call)", timed(add_pure, steps))
                data.add("foreach: Adam step, 100 DTensor params, unpatched (us/step)", timed(adam_pure, steps))
    return data


def compile_cases(backends: List[str], steady_calls: int, rounds: int) -> Dict[str, Any]:
    """torch.compile of a function with a mixed op: first-call time and steady-state per call (patched)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import keras_dtensor_mixfix as mf

    mesh = init_device_mesh("cpu", (1,))
    w = distribute_tensor(torch.randn(SHAPE), mesh, [Shard(0)])
    x = torch.randn(SHAPE)

    def f(w: Any, x: Any) -> Any:
        return torch.relu(w * x + 1.0) * x

    results: Dict[str, Any] = {}
    with mf.patched():
        eager = [timed(lambda: f(w, x), steady_calls) for _ in range(rounds)]
        results["eager (patched)"] = {"steady_us": summary(eager)}
        for backend in backends:
            torch._dynamo.reset()
            compiled = torch.compile(f, backend=backend, fullgraph=True)
            start = time.perf_counter()
            out = compiled(w, x)
            first = time.perf_counter() - start
            torch.testing.assert_close(out.full_tensor(), f(w, x).full_tensor())
            timed(lambda: compiled(w, x), 20)
            steady = [timed(lambda: compiled(w, x), steady_calls) for _ in range(rounds)]
            results[backend] = {"first_call_s": first, "steady_us": summary(steady)}
        torch._dynamo.reset()
    return results


# ----------------------------------------------------------------------------- subprocesses


_ACTIVATE = (
    "import time, torch; t = time.perf_counter(); "
    "from keras_dtensor_mixfix._autoload import activate; activate(); "
    "print((time.perf_counter() - t) * 1e3)"
)
_IMPORT_TORCH = "import time; t = time.perf_counter(); import torch; print((time.perf_counter() - t) * 1e3)"
_FIRST_PATCH = (
    "import time, torch, torch.distributed.tensor; t = time.perf_counter(); import keras_dtensor_mixfix as mf; "
    "mf.patch(); print((time.perf_counter() - t) * 1e3)"
)
_IMPORT_DTENSOR = (
    "import time, torch; t = time.perf_counter(); import torch.distributed.tensor; "
    "print((time.perf_counter() - t) * 1e3)"
)


def _child(code: str, **env: str) -> float:
    # PYTHONDONTWRITEBYTECODE is dropped: a user's install has its bytecode cached (pip compiles
    # it), and a benchmark that recompiled our modules from source each run would time that.
    dropped = ("KERAS_DTENSOR_MIXFIX", "TORCHINDUCTOR_CACHE_DIR", "PYTHONDONTWRITEBYTECODE")
    environ = {k: v for k, v in os.environ.items() if k not in dropped}
    environ.update(env)
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def import_cases(runs: int) -> Rounds:
    variants = [
        ("first patch() in a fresh process, package import included (KERAS_DTENSOR_MIXFIX=0) ms", _FIRST_PATCH,
         {"KERAS_DTENSOR_MIXFIX": "0"}),
        ("activate(): import + run of the entry point (TORCH_DEVICE_BACKEND_AUTOLOAD=0, called by hand) ms",
         _ACTIVATE, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}),
        ("import torch, auto-activation on ms", _IMPORT_TORCH, {}),
        ("import torch, KERAS_DTENSOR_MIXFIX=0 ms", _IMPORT_TORCH, {"KERAS_DTENSOR_MIXFIX": "0"}),
        ("import torch, TORCH_DEVICE_BACKEND_AUTOLOAD=0 ms", _IMPORT_TORCH, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}),
        ("import torch.distributed.tensor after torch, auto-activation on (patches) ms", _IMPORT_DTENSOR, {}),
        ("import torch.distributed.tensor after torch, KERAS_DTENSOR_MIXFIX=0 ms", _IMPORT_DTENSOR,
         {"KERAS_DTENSOR_MIXFIX": "0"}),
    ]
    for _, code, env in variants:
        _child(code, **env)  # unmeasured: writes the bytecode caches
    data = Rounds()
    for _ in range(runs):
        for name, code, env in variants:
            data.add(name, _child(code, **env))
    return data


# ----------------------------------------------------------------------------- report


def _fmt(value: float) -> str:
    return f"{value:.3g}" if value < 10 else f"{value:.1f}"


def _verdict(ratio: float, target: float) -> str:
    return "PASS" if ratio <= target else "MISS"


def report(per: Rounds, extra: Dict[str, Any], others: List[Rounds], compiled: Dict[str, Any],
           imports: Optional[Rounds], args: argparse.Namespace, per2: Optional[Rounds] = None,
           keras: Optional[Rounds] = None) -> Dict[str, Any]:
    lines: List[str] = []
    out: Dict[str, Any] = {"cases": {}, "targets": {}}
    lines.append(f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} cores, "
                 f"{SHAPE[0]}x{SHAPE[1]} float32; per-op cases on world size 1 (in process) and 2 (gloo, 127.0.0.1)")
    try:
        lines.append(f"load average before the run: {args.load_before}")
    except AttributeError:
        pass
    lines.append(f"command: {' '.join(['python'] + sys.argv)}")
    lines.append("")
    lines.append("| case | min | median | rounds |")
    lines.append("|---|---|---|---|")
    tables = [("", per)] + ([("2 ranks: ", per2)] if per2 is not None else [])
    tables += [("", data) for data in others]
    tables += [("", data) for data in (keras, imports) if data is not None]
    for prefix, data in tables:
        for name in data.samples:
            s = data.stat(name)
            out["cases"][prefix + name] = s
            unit = "" if ("ms" in name or "us/" in name) else " us"
            lines.append(f"| {prefix}{name}{unit} | {_fmt(s['min'])} | {_fmt(s['median'])} | {s['n']} |")
    for backend, res in compiled.items():
        s = res["steady_us"]
        out["cases"][f"compile {backend}"] = res
        first = f", first call {res['first_call_s']:.2f} s" if "first_call_s" in res else ""
        lines.append(f"| compiled f: {backend}{first}: steady us/call | {_fmt(s['min'])} | {_fmt(s['median'])} | {s['n']} |")
    lines.append("")

    def ratio(data: Rounds, num: str, den: str) -> Tuple[float, float, float]:
        a, b = data.stat(num), data.stat(den)
        # Per-round ratios pair figures taken seconds apart, so load that drifts over the run cancels.
        paired = statistics.median(x / y for x, y in zip(data.samples[num], data.samples[den]))
        return a["min"] / b["min"], a["median"] / b["median"], paired

    def target_rows(data: Rounds, suffix: str) -> None:
        rows = {
            "P1": ratio(data, "mixed patched", "mixed implicit_replication"),
            "P2": ratio(data, "mixed patched", "pure patched"),
            "P3": ratio(data, "pure patched", "pure unpatched"),
            "P3b": ratio(data, "pure in-place patched", "pure in-place unpatched"),
            "P4": ratio(data, "plain patched", "plain unpatched"),
        }
        for key, (lo, mid, paired) in rows.items():
            text, target = TARGETS[key]
            verdict = _verdict(paired, target)
            if verdict == "PASS" and lo > target:
                verdict += " (ratio of minima misses)"
            out["targets"][key + suffix] = {"what": text, "ratio_min": lo, "ratio_median": mid,
                                            "paired_median": paired, "target": target, "verdict": verdict}
            lines.append(f"| {key}{suffix} {text} | {paired:.3f} | {lo:.3f} | {mid:.3f} | <= {target} | {verdict} |")

    lines.append("| target | median of per-round ratios | ratio of minima | ratio of medians | target | verdict |")
    lines.append("|---|---|---|---|---|---|")
    target_rows(per, "")
    if per2 is not None:
        target_rows(per2, " (2 ranks)")
    p = per.stat("patch() ms")
    if imports is not None:
        first = imports.stat(next(n for n in imports.samples if n.startswith("first patch()")))
        lines.append(f"| P5a first patch() in a fresh process (package import included) | | {first['min']:.1f} ms | "
                     f"{first['median']:.1f} ms | <= 100 ms | {_verdict(first['median'], 100)} |")
        out["targets"]["P5a"] = {"first_patch_ms": first}
    lines.append(f"| P5a' patch() again after unpatch() (in this process; its first patch() "
                 f"{extra['first_patch_ms']:.0f} ms) | | {p['min']:.1f} ms | {p['median']:.1f} ms | <= 100 ms | "
                 f"{_verdict(p['median'], 100)} |")
    out["targets"]["P5a'"] = {"patch_ms": p, "first_patch_ms_in_process": extra["first_patch_ms"]}
    if imports is not None:
        act = imports.stat(next(n for n in imports.samples if n.startswith("activate()")))
        on = imports.stat("import torch, auto-activation on ms")
        off = imports.stat("import torch, TORCH_DEVICE_BACKEND_AUTOLOAD=0 ms")
        lines.append(f"| P5b time added to import torch: activate() measured directly | | {act['min']:.1f} ms | "
                     f"{act['median']:.1f} ms | <= 20 ms | {_verdict(act['median'], 20)} |")
        lines.append(f"| P5b cross-check (information: import torch varies by tens of ms run to run): "
                     f"import torch, auto-activation on - TORCH_DEVICE_BACKEND_AUTOLOAD=0 | | "
                     f"{on['min'] - off['min']:.1f} ms | {on['median'] - off['median']:.1f} ms | | |")
        out["targets"]["P5b"] = {"activate_ms": act, "import_on_ms": on, "import_autoload_off_ms": off}
    if keras is not None:
        names = list(keras.samples)
        lo, mid, paired = ratio(keras, names[0], names[1])
        verdict = _verdict(paired, 1.10)
        if verdict == "PASS" and lo > 1.10:
            verdict += " (ratio of minima misses)"
        out["targets"]["P6"] = {"ratio_min": lo, "ratio_median": mid, "paired_median": paired, "target": 1.10,
                                "verdict": verdict}
        lines.append(f"| P6 Keras ModelParallel train step (2 ranks), plain batches / DTensor batches by hand | "
                     f"{paired:.3f} | {lo:.3f} | {mid:.3f} | <= 1.1 | {verdict} |")
    text = "\n".join(lines)
    print(text)
    out["text"] = text
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds; no inductor; fewer subprocess runs")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of the per-op cases (default 21, quick 5)")
    parser.add_argument("--no-imports", action="store_true", help="skip the subprocess import-time figures")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile figures")
    parser.add_argument("--no-ranks", action="store_true", help="skip the 2-rank cases (per-op and P6 Keras step)")
    parser.add_argument("--json", default=None, help="write the figures to this file too")
    args = parser.parse_args()
    try:
        args.load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        pass
    rounds = args.rounds or (5 if args.quick else 21)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        per, extra = per_op(rounds, calls=2000, plain_calls=10000)
        others = [grad_cases(max(3, rounds // 3), calls=300),
                  foreach_cases(max(3, rounds // 3), steps=20)]
        compiled: Dict[str, Any] = {}
        if not args.no_compile:
            backends = ["aot_eager"] if args.quick else ["aot_eager", "inductor"]
            compiled = compile_cases(backends, steady_calls=1000, rounds=max(3, rounds // 3))
    finally:
        dist.destroy_process_group()
    per2 = keras = None
    if not args.no_ranks:
        from keras_dtensor_mixfix.testing import shutdown_workers

        try:
            per2 = per_op_two_ranks(rounds, calls=2000, plain_calls=10000)
            keras = keras_step(3 if args.quick else 7, steps=20)
        finally:
            shutdown_workers()
    imports = None if args.no_imports else import_cases(3 if args.quick else 9)
    result = report(per, extra, others, compiled, imports, args, per2, keras)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2, default=str)


if __name__ == "__main__":
    main()

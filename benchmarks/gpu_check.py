"""One command that checks the package on one device: correctness against the same program without a mesh, speed,
and host-device syncs (issue 43; docs/gpu.md says how to run it and what each row means).

    python benchmarks/gpu_check.py [--device cuda|cpu] [--size small|compute] [--out FILE] [--only 1,2,...]

Contract: it prints ONE table, a row per check (row, what was compared, result, verdict), and exits 1 when any row
is FAIL (a wrong number, or an error where a number was expected), else 0. Verdicts: ``pass``; ``FAIL``; ``n/a:
<reason>`` (the check cannot run there: a collective the backend refuses, syncs on cpu); ``skipped: <reason>``
(Keras, keras_hub or JAX not installed); for speed and syncs ``target met`` / ``target missed``, which never fail
the exit code. Every correctness row compares the same program on the same device without a mesh (plain tensors,
one process). Row families, each in processes of its own (so that one family's process group, CUDA context or
Keras backend never meets another's):

1. the package's self-checks and ``python -m keras_dtensor_mixfix doctor``;
2. mixed-operand patterns on a one-device mesh (NCCL on cuda, gloo on cpu): values and gradients
   (``gpu_check_patterns.py``); on cuda also with plain operands on the CPU (a matrix must raise the package's
   error naming ``.to(``, a 0-dim scalar must work);
3. the same patterns on two ranks sharing the device (gloo on 127.0.0.1), weights ``Shard(0)`` and ``Shard(1)``;
4. a tiny keras_hub Gemma under ``ModelParallel`` on a one-device mesh vs no distribution: fit, evaluate, predict,
   generate, eager and ``jit_compile=True`` (``gpu_check_keras.py``);
5. speed at ``--size``: the eager step with the mesh ÷ without a distribution (target <= 1.3), the compiled step
   with the mesh ÷ Keras on JAX, compiled, on the same device (target <= 1.2);
6. host-device syncs per training step that the package adds (cuda only; target 0).

``--device`` defaults to cuda when torch sees a GPU. ``--size small`` (the default on cpu) times the tiny Gemma in
float32; ``compute`` (the default on cuda) a Gemma of hidden 1024, sequence 512, in float32 and bfloat16.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
EAGER_TARGET, COMPILED_TARGET, SYNCS_TARGET = 1.3, 1.2, 0
KERAS_TOLERANCE = dict(rtol=1e-4, atol=1e-5)
"""float32 on one device: the mesh run's kernels are the plain run's, but for the package's own ops (the local
einsum, the vocabulary-parallel loss) and a compiled step's fusions."""
PASS, FAIL, MET, MISSED = "pass", "FAIL", "target met", "target missed"


class Row(dict):
    """One line of the table: ``id``, ``what``, ``result``, ``verdict``."""

    def __init__(self, id: str, what: str, result: str, verdict: str) -> None:
        super().__init__(id=id, what=what, result=result, verdict=verdict)


def _subprocess(command: List[str], env: Optional[Dict[str, str]] = None, timeout: float = 600) -> Any:
    """Run ``command`` (a Python script or module) and read the JSON its last stdout line holds."""
    environment = {**os.environ, "KERAS_DTENSOR_MIXFIX": "0", **(env or {})}
    done = subprocess.run([sys.executable, *command], env=environment, capture_output=True, text=True,
                          timeout=timeout, cwd=HERE)
    if done.returncode != 0:
        tail = " ".join(done.stderr.strip().splitlines()[-1:]) or f"exit {done.returncode}"
        raise RuntimeError(tail[:300])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _in_family_process(family: str, device: str) -> Any:
    """This script again, running one family's body (``--body``) in a fresh process."""
    return _subprocess([os.path.join(HERE, "gpu_check.py"), "--body", family, "--device", device])


def _error_row(id: str, what: str, exc: BaseException) -> Row:
    return Row(id, what, " ".join(f"error: {type(exc).__name__}: {exc}".split())[:300], FAIL)


# ----------------------------------------------------------------------------- 1. self-checks and doctor


def doctor_rows(device: str) -> List[Row]:
    """Row 1: ``doctor``'s exit status, and the summary lines of the torch and Keras self-checks it prints."""
    environment = {**os.environ, "KERAS_BACKEND": "torch"}
    done = subprocess.run([sys.executable, "-m", "keras_dtensor_mixfix", "doctor"], env=environment,
                          capture_output=True, text=True, timeout=600)
    lines = [line.strip() for line in done.stdout.splitlines()]
    rows = []
    for id, subject, needle in (("1.1", "torch", "self-check "), ("1.2", "Keras", "Keras self-check ")):
        found = [line for line in lines if line.startswith(needle) and " passed" in line or
                 line.startswith(needle) and " failed" in line]
        if subject == "Keras" and not found and not _installed("keras"):
            rows.append(Row(id, "Keras self-check", "", "skipped: keras not installed"))
            continue
        summary = found[-1] if found else "no summary line in doctor's output"
        rows.append(Row(id, f"{subject} self-check (the internals the package relies on)", summary,
                        PASS if " passed" in summary else FAIL))
    tail = (done.stderr.strip().splitlines() or [""])[-1][:200]
    rows.append(Row("1.3", "python -m keras_dtensor_mixfix doctor", f"exit {done.returncode}" +
                    (f": {tail}" if done.returncode else ""), PASS if done.returncode == 0 else FAIL))
    return rows


# ----------------------------------------------------------------------------- 2, 3. patterns


def _pattern_row(id: str, name: str, variants: Dict[str, Dict[str, str]], suffix: str) -> Row:
    verdicts = [v["verdict"] for v in variants.values()]
    result = "; ".join(f"{variant}: {v['detail']}" for variant, v in variants.items())
    if "FAIL" in verdicts:
        verdict = FAIL
    elif "ok" in verdicts:
        verdict = PASS
    else:
        verdict = "n/a: " + "; ".join(v["detail"] for v in variants.values())[:200]
    return Row(id, f"{name} {suffix}", result, verdict)


def _pattern_rows(family: str, title: str, suffix: str, device: str) -> List[Row]:
    """Row ``family``'s patterns, each run in the family's own process, one row a pattern."""
    try:
        results = _in_family_process(family, device)
    except Exception as exc:  # noqa: BLE001
        return [_error_row(family, title, exc)]
    return [_pattern_row(f"{family}.{n}", name, variants, suffix)
            for n, (name, variants) in enumerate(results.items(), 1)]


def one_device_rows(device: str) -> List[Row]:
    """Row 2: each pattern on a one-device mesh, values and gradients vs the plain program."""
    return _pattern_rows("2", "mixed-operand patterns, one-device mesh", "(1-device mesh vs plain)", device)


def two_rank_rows(device: str) -> List[Row]:
    """Row 3: each pattern on two ranks sharing the device, Shard(0) and Shard(1), vs one process."""
    return _pattern_rows("3", "mixed-operand patterns, 2 ranks", "(2 ranks, gloo, vs 1 process)", device)


def _family_body(family: str, device: str) -> Any:
    """What ``--body`` runs in its fresh process."""
    import gpu_check_patterns as patterns

    if family == "2":
        return patterns.one_device_mesh(device)
    if family == "3":
        from keras_dtensor_mixfix.testing import run_on_ranks, shutdown_workers

        try:
            per_rank = run_on_ranks(patterns.two_ranks_worker, device, world_size=2, timeout=180)
        finally:
            shutdown_workers()
        merged = per_rank[0]  # a variant fails if it fails on either rank
        for name, variants in per_rank[1].items():
            for variant, outcome in variants.items():
                if outcome["verdict"] == "FAIL" and merged[name][variant]["verdict"] != "FAIL":
                    merged[name][variant] = dict(outcome, detail=f"rank 1: {outcome['detail']}")
        return merged
    if family == "6":
        return patterns.sync_counts()
    raise ValueError(family)


# ----------------------------------------------------------------------------- 4, 5. keras_hub Gemma


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _keras_worker(device: str, backend: str, mesh: bool, jit: bool, correctness: bool, size: Optional[str],
                  dtypes: List[str]) -> Dict[str, Any]:
    spec = dict(backend=backend, device=device, mesh=mesh, jit=jit, correctness=correctness, timing=size,
                dtypes=dtypes)
    env = {"KERAS_BACKEND": backend}
    if mesh:  # the DTensor path on one device (by default a one-device mesh holds Keras' own plain tensors)
        env["KERAS_DTENSOR_MIXFIX_DTENSORS_ON_ONE_DEVICE"] = "1"
    if device == "cpu":
        env.update(CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu")
    if backend == "jax":  # float32 matmuls in full float32, as torch's (JAX's default on GPUs is TF32)
        env.update(JAX_DEFAULT_MATMUL_PRECISION="highest", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    return _subprocess([os.path.join(HERE, "gpu_check_keras.py"), json.dumps(spec)], env=env, timeout=900)


def _compare_keras(got: Dict[str, Any], want: Dict[str, Any]) -> Dict[str, str]:
    """Per method (fit, evaluate, predict, generate, the trained weights): "=" or what differs."""
    import numpy as np

    out = {}
    for key in ("fit", "evaluate", "predict", "generate", "weights"):
        a, b = got[key], want[key]
        if key == "weights":
            a, b = np.concatenate([np.asarray(w) for w in a]), np.concatenate([np.asarray(w) for w in b])
        a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
        if a.shape != b.shape:
            out[key] = f"shapes {a.shape} vs {b.shape}"
        elif key == "generate":
            out[key] = "=" if np.array_equal(a, b) else f"{int((a != b).sum())} tokens differ"
        else:
            worst = float(np.abs(a - b).max()) if a.size else 0.0
            same = np.allclose(a, b, **KERAS_TOLERANCE)
            out[key] = f"{'=' if same else 'DIFFER'} (max diff {worst:.1e})"
    return out


def keras_rows(device: str, size: str) -> List[Row]:
    """Rows 4 and 5: three torch workers (no distribution eager; mesh eager; mesh jit_compile), each with the tiny
    Gemma's values and the step times at ``size``, and a JAX worker for the compiled step's reference."""
    if not (_installed("keras") and _installed("keras_hub")):
        reason = "skipped: keras/keras_hub not installed"
        return [Row("4", "keras_hub Gemma, ModelParallel on a 1-device mesh vs no distribution", "", reason),
                Row("5", "speed: eager and compiled steps", "", reason)]
    dtypes = ["float32", "bfloat16"] if size == "compute" else ["float32"]
    workers = {"plain": (False, False), "mesh eager": (True, False), "mesh jit": (True, True)}
    results: Dict[str, Any] = {}
    for name, (mesh, jit) in workers.items():
        try:
            results[name] = _keras_worker(device, "torch", mesh, jit, True, size, dtypes)
        except Exception as exc:  # noqa: BLE001
            results[name] = exc
    if _installed("jax"):
        try:
            results["jax"] = _keras_worker(device, "jax", False, True, False, size, dtypes)
        except Exception as exc:  # noqa: BLE001
            results["jax"] = exc
    return _correctness_rows(results) + _speed_rows(results, size, dtypes)


def _correctness_rows(results: Dict[str, Any]) -> List[Row]:
    rows = []
    for n, (name, label) in enumerate((("mesh eager", "eager"), ("mesh jit", "jit_compile=True")), 1):
        what = (f"Gemma {label}, ModelParallel (1, 1) mesh vs no distribution eager: "
                "fit/evaluate/predict/generate/weights")
        for worker in ("plain", name):
            if isinstance(results[worker], Exception):
                rows.append(_error_row(f"4.{n}", what, results[worker]))
                break
        else:
            compared = _compare_keras(results[name]["correctness"], results["plain"]["correctness"])
            ok = all(value.startswith("=") for value in compared.values())
            rows.append(Row(f"4.{n}", what, ", ".join(f"{k} {v}" for k, v in compared.items()), PASS if ok else FAIL))
    return rows


def _speed_rows(results: Dict[str, Any], size: str, dtypes: List[str]) -> List[Row]:
    rows = []
    pairs = (("eager step, mesh ÷ no distribution", "mesh eager", "plain", EAGER_TARGET),
             ("compiled step, mesh ÷ Keras on JAX (jit)", "mesh jit", "jax", COMPILED_TARGET))
    n = 0
    for what, mine, reference, target in pairs:
        for dtype in dtypes:
            n += 1
            label = f"{what}, Gemma {size}, {dtype}"
            if reference not in results:
                rows.append(Row(f"5.{n}", label, "", "skipped: jax not installed"))
                continue
            failed = [r for r in (mine, reference) if isinstance(results[r], Exception)]
            if failed:
                rows.append(_error_row(f"5.{n}", label, results[failed[0]]))
                continue
            a, b = results[mine]["timing"][dtype], results[reference]["timing"][dtype]
            ratio = a["step_ms"] / b["step_ms"]
            rows.append(Row(f"5.{n}", f"{label} (target <= {target})",
                            f"{ratio:.2f} ({a['step_ms']:.1f} / {b['step_ms']:.1f} ms; first steps "
                            f"{a['first_ms'] / 1e3:.1f} / {b['first_ms'] / 1e3:.1f} s)",
                            MET if ratio <= target else MISSED))
    return rows


# ----------------------------------------------------------------------------- 6. syncs


def sync_rows(device: str) -> List[Row]:
    """Row 6: synchronizing CUDA calls in one training step, patched mixed program minus the same program with every
    operand a DTensor by hand (or, where that fails, minus the plain program)."""
    what = f"host-device syncs per training step added by the package (target {SYNCS_TARGET})"
    if device != "cuda":
        return [Row("6", what, "", "n/a on cpu")]
    try:
        counts = _in_family_process("6", device)
    except Exception as exc:  # noqa: BLE001
        return [_error_row("6", what, exc)]
    baseline = counts["by_hand"] if counts["by_hand"] is not None else counts["plain"]
    added = counts["mixed"] - baseline
    detail = (f"{added} (mixed, patched: {counts['mixed']}; DTensors by hand: {counts['by_hand']}; plain: "
              f"{counts['plain']})"
              + (f"; by hand failed: {counts['by_hand_error']}" if "by_hand_error" in counts else ""))
    return [Row("6", what, detail, MET if added <= SYNCS_TARGET else MISSED)]


# ----------------------------------------------------------------------------- the table


FAMILIES: Dict[str, Callable[[argparse.Namespace], List[Row]]] = {
    "1": lambda a: doctor_rows(a.device),
    "2": lambda a: one_device_rows(a.device),
    "3": lambda a: two_rank_rows(a.device),
    "4": lambda a: keras_rows(a.device, a.size),  # rows 4 and 5 come from the same workers
    "6": lambda a: sync_rows(a.device),
}


def table(rows: List[Row], header: str) -> str:
    lines = [header, "", "| row | what was compared | result | verdict |", "|---|---|---|---|"]
    lines += [f"| {r['id']} | {r['what']} | {r['result']} | {r['verdict']} |".replace("\n", " ") for r in rows]
    return "\n".join(lines)


def _versions(device: str) -> str:
    import torch

    found = [f"torch {torch.__version__}"]
    for name in ("keras", "keras_hub", "jax"):
        try:
            from importlib.metadata import version

            found.append(f"{name} {version(name.replace('_', '-'))}")
        except Exception:  # noqa: BLE001 - not installed
            found.append(f"{name} not installed")
    where = torch.cuda.get_device_name(0) if device == "cuda" else f"cpu, {os.cpu_count()} cores"
    return f"{where}; python {sys.version.split()[0]}; " + ", ".join(found)


def _families(only: str) -> List[str]:
    """The row families ``--only`` names, in the order given, each once: 5 is run by 4 (one set of Keras workers
    gives both), so "4,5" runs them once."""
    return list(dict.fromkeys(family.strip().replace("5", "4") for family in only.split(",") if family.strip()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"))
    parser.add_argument("--size", choices=("small", "compute"))
    parser.add_argument("--out", help="also write the table (Markdown) to this file")
    parser.add_argument("--only", default="1,2,3,4,6", help="row families to run (4 runs 4 and 5)")
    parser.add_argument("--body", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.body:
        print(json.dumps(_family_body(args.body, args.device)))
        return 0
    args.size = args.size or ("compute" if args.device == "cuda" else "small")
    started = time.perf_counter()
    rows: List[Row] = []
    for family in _families(args.only):
        family_started = time.perf_counter()
        rows += FAMILIES[family](args)
        print(f"(row family {family}: {time.perf_counter() - family_started:.0f} s)", file=sys.stderr, flush=True)
    failed = [r["id"] for r in rows if r["verdict"] == FAIL]
    header = (f"gpu_check --device {args.device} --size {args.size}: {_versions(args.device)}; "
              f"{time.perf_counter() - started:.0f} s; "
              f"{'FAILED: rows ' + ', '.join(failed) if failed else 'no failures'}")
    text = table(rows, header)
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

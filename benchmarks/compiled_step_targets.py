"""Every target of the compiled step (issue 45) from one run: the figures, their targets and the verdicts.

    python benchmarks/compiled_step_targets.py                                   # ~15 min on 2 cores
    python benchmarks/compiled_step_targets.py --keras316-python /path/to/3.16/venv/bin/python   # adds P7

Runs, each in its own processes, ``keras_model_step.py`` (this interpreter's Keras, 3.15.1 for the figures in
BENCHMARKS.md) on the default (1, 2) mesh:

1. tiny Gemma and the 2-block model (``blocks``): eager, ``jit`` (the default: each repeated block compiled once
   and the optimizer's update), ``jit-step`` (the whole step) and JAX: P8 and P9;
2. tiny Gemma launched twice on one on-disk compile cache, beside JAX's persistent compilation cache: the warm start;
3. compute-size Gemma and Llama3, ``jit`` and JAX, 6 steps: the first and the later compiled steps;

and, given ``--keras316-python`` (a Python with keras-nightly 3.16 and this package), ``keras316_step.py --jit``:
P7. Each part prints its own tables as it goes, and saves its figures (``--saved``); the summary at the end is the
targets' table (``--summarize --saved DIR`` prints it again from a run's saved figures).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from keras_model_step import JAX, JAX_WARM, JIT_ROWS, JIT_WARM, RANKED  # noqa: E402  (the rows' labels, on 1x2)

PARTS = (
    ("tiny", ["--models", "gemma,blocks", "--variants", "eager,jit,jit-step,jax", "--no-breakdown"]),
    ("warm", ["--models", "gemma", "--variants", "jit,jit-warm,jax-warm", "--no-breakdown"]),
    ("compute", ["--size", "compute", "--models", "gemma,llama3", "--variants", "jit,jax", "--steps", "6",
                 "--no-breakdown"]),
)


def _run(python: str, script: str, arguments: List[str], saved: str) -> Dict[str, Any]:
    """Runs ``script`` with ``--json saved``; its own output goes through to ours. Returns what it wrote."""
    subprocess.run([python, os.path.join(HERE, script), *arguments, "--json", saved], check=True)
    with open(saved) as out:
        return json.load(out)


def _row(models: Dict[str, Any], model: str, label: str) -> Optional[Dict[str, Any]]:
    """The row ``label`` of ``model``, unless it failed or was not run."""
    row = models.get(model, {}).get(label)
    return row if row is not None and "error" not in row else None


def _targets(measured: Dict[str, Dict[str, Any]], p7: Optional[Dict[str, Any]]) -> List[Tuple[str, str, str]]:
    table: List[Tuple[str, str, str]] = []

    def ratio(name: str, got: Optional[float], against: Optional[float], target: float, how: str) -> None:
        if got is None or against is None:
            table.append((name, f"not measured ({how})", "n/a"))
            return
        value = got / against
        table.append((name, f"{how}: {got:.2f} ÷ {against:.2f} = {value:.2f} (≤ {target})",
                      "PASS" if value <= target else "MISS"))

    compute = measured["compute"]["models"]
    for model, label in (("gemma", "Gemma"), ("llama3", "Llama3")):
        jit, jax = _row(compute, model, f"{RANKED}, jit_compile"), _row(compute, model, JAX)
        ratio(f"compute-size {label}, first compiled step ÷ JAX's", jit and jit["first_s"], jax and jax["first_s"], 3,
              "s")
        ratio(f"compute-size {label}, later steps ÷ JAX's", jit and jit["median_ms"], jax and jax["median_ms"], 0.9,
              "ms")
    tiny = measured["tiny"]["models"]
    jit, jax = _row(tiny, "gemma", f"{RANKED}, jit_compile"), _row(tiny, "gemma", JAX)
    ratio("P8 tiny Gemma compiled ÷ JAX", jit and jit["median_ms"], jax and jax["median_ms"], 2, "ms")
    step = _row(tiny, "gemma", JIT_ROWS["jit-step"][1])
    ratio("(P8 with the whole step compiled)", step and step["median_ms"], jax and jax["median_ms"], 2, "ms")
    jit, eager = _row(tiny, "blocks", f"{RANKED}, jit_compile"), _row(tiny, "blocks", f"{RANKED}, eager")
    ratio("P9 2-block model compiled ÷ eager", jit and jit["median_ms"], eager and eager["median_ms"], 0.4, "ms")
    if p7 is None:
        table.append(("P7 Keras 3.16, compiled with the package ÷ Keras 3.16 alone", "not measured (--keras316-python)",
                      "n/a"))
    else:
        wall = p7["wall time per step"]
        ratio(f"P7 Keras {p7['keras']}, compiled with the package ÷ Keras alone", wall["ours_median_ms"],
              wall["alone_median_ms"], 0.2, "ms")
    warm = measured["warm"]["models"]
    jit, jax = _row(warm, "gemma", JIT_WARM), _row(warm, "gemma", JAX_WARM)
    ratio("warm start, tiny Gemma's first step ÷ JAX's warm first step", jit and jit["first_s"], jax and jax["first_s"],
          1.5, "s")
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keras316-python", help="a Python with keras-nightly 3.16 and this package: adds P7")
    parser.add_argument("--saved", help="the folder for each part's figures (JSON; default: a new temporary one)")
    parser.add_argument("--summarize", action="store_true",
                        help="measure nothing: the targets' table from the figures an earlier run saved in --saved")
    args = parser.parse_args()
    saved = args.saved or tempfile.mkdtemp(prefix="mixfix-compiled-step-targets-")
    os.makedirs(saved, exist_ok=True)
    print(f"each part's figures are saved in {saved}", flush=True)

    def part(name: str, python: str, script: str, arguments: List[str]) -> Dict[str, Any]:
        path = os.path.join(saved, f"{name}.json")
        if args.summarize:
            with open(path) as out:
                return json.load(out)
        return _run(python, script, arguments, path)

    measured = {name: part(name, sys.executable, "keras_model_step.py", arguments) for name, arguments in PARTS}
    p7 = None
    if args.keras316_python or (args.summarize and os.path.exists(os.path.join(saved, "p7.json"))):
        p7 = part("p7", args.keras316_python, "keras316_step.py", ["--jit", "--rounds", "3"])
    print("\n## The compiled step's targets (issue 45)\n")
    print("| target | figure | verdict |")
    print("|---|---|---|")
    for name, figure, verdict in _targets(measured, p7):
        print(f"| {name} | {figure} | {verdict} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""benchmarks/gpu_check.py on CPU, as docs/gpu.md runs it: exit 0 and every row family in its one table.

Runs where keras_hub is importable (CONTRIBUTING's keras_hub environment, which CI runs), where every row family
must have run. About 3 to 5 minutes on 2 cores.
"""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _has(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # keras_hub does not import on some Kerases
        return False


@pytest.mark.skipif(not (_has("keras") and _has("keras_hub")),
                    reason="runs where keras_hub is installed (CONTRIBUTING's keras_hub environment, in CI), where "
                           "every row family runs; without it the Keras rows would only say skipped, and rows 1 to 3 "
                           "repeat the engine's own tests")
def test_gpu_check_on_cpu():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--device", "cpu",
                           "--size", "small"], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "KERAS_BACKEND": "torch"})
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    rows = re.findall(r"^\| ([0-9][0-9.]*) \| (.*?) \| (.*?) \| (.*?) \|$", done.stdout, re.MULTILINE)
    families = {row[0].split(".")[0]: [] for row in rows}
    for row in rows:
        families[row[0].split(".")[0]].append(row)
    assert set(families) == {"1", "2", "3", "4", "5", "6"}, done.stdout
    assert all(verdict != "FAIL" for *_, verdict in rows), done.stdout
    assert families["6"][0][3] == "n/a on cpu"
    keras_rows = families["4"] + families["5"]
    if _has("keras") and _has("keras_hub"):
        assert all(verdict == "pass" for *_, verdict in families["4"]), done.stdout
        expected = 2 if _has("jax") else 1  # the JAX row says skipped without JAX
        assert sum(not verdict.startswith("skipped") for *_, verdict in families["5"]) == expected, done.stdout
    else:
        assert all(verdict.startswith("skipped") for *_, verdict in keras_rows), done.stdout


def test_only_runs_each_row_family_once():
    """``--only 4,5`` (docs/gpu.md's families) runs the Keras workers once: family 5's rows come from family 4's."""
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "benchmarks", "gpu_check.py"))
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check._families("4,5") == ["4"]
    assert gpu_check._families("5") == ["4"]
    assert gpu_check._families("1, 2,3,4,5,6") == ["1", "2", "3", "4", "6"]
    assert set(gpu_check._families("1,2,3,4,6")) == set(gpu_check.FAMILIES)

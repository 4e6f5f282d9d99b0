"""keras_dtensor_mixfix.testing: the mistakes a first script makes get an answer at once."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

UNGUARDED = textwrap.dedent(
    """
    from keras_dtensor_mixfix.testing import run_on_ranks, mesh

    def step(scale):
        m = mesh()
        return scale * 2

    per_rank = run_on_ranks(step, 2.0, world_size=2)   # no `if __name__ == "__main__":`
    print(per_rank)
    """
)


def test_a_script_without_a_main_guard_fails_at_once_and_says_why(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=110)
    took = time.monotonic() - started
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    # a WorkerStartError: a RuntimeError, and a MixfixError like every error the package raises
    assert last.startswith("keras_dtensor_mixfix.testing.WorkerStartError: rank ") and (
        "before joining the process group" in last), result.stderr
    assert 'under `if __name__ == "__main__":`' in last
    assert took < 60, took  # it used to wait for the 120 s start timeout

"""The Keras self-check: every Keras private name or behaviour the integration relies on, on the running Keras.

One named check per name or behaviour (:data:`.checks.CHECKS`). The checks run in a fresh subprocess
(Keras on the torch backend, the package off there): they build a variable and a one-layer model, which
would advance Keras' automatic names and random state in the user's process (and which a Keras still
half-imported, as it is when auto-activation installs the integration, could not build).
``python -m keras_dtensor_mixfix doctor`` prints each check; the Keras gate (:mod:`.keras_gate`) runs it
before installing into a Keras newer than the newest tested one, when the user opted in.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import ClassVar, List, Tuple

from ..._torch.selfcheck import CheckResult, ReportCache, SelfCheckReport, results_from_subprocess, run_check
from ..boundary import keras_modules
from .checks import CHECKS


@dataclasses.dataclass(frozen=True)
class KerasSelfCheckReport(SelfCheckReport):
    """The results of one run of the Keras self-check (``version``: Keras')."""

    TITLE: ClassVar[str] = "Keras self-check"
    SUBJECT: ClassVar[str] = "Keras"


def _run_here() -> Tuple[CheckResult, ...]:
    return tuple(run_check(check) for check in CHECKS.values())


def _run_in_subprocess() -> Tuple[CheckResult, ...]:
    env = dict(os.environ, KERAS_DTENSOR_MIXFIX="0", KERAS_BACKEND="torch")  # the child checks Keras as it is
    return results_from_subprocess(__name__, CHECKS, env)


def run_self_check() -> KerasSelfCheckReport:
    """Run every check now, in a fresh subprocess."""
    return KerasSelfCheckReport(keras_modules.running_keras_version(), _run_in_subprocess(), "in a subprocess")


_cache = ReportCache(lambda: run_self_check())  # looked up at each run: tests replace run_self_check


def self_check() -> SelfCheckReport:
    """The Keras self-check's report, run once per process (Keras does not change under a running process)."""
    return _cache.get()


def clear_cache() -> None:
    """Forget the cached report (tests that simulate a failing check)."""
    _cache.clear()


def _main(argv: List[str]) -> int:
    import keras  # noqa: F401 - the checks need Keras imported (KERAS_BACKEND=torch)

    report = KerasSelfCheckReport(keras_modules.running_keras_version(), _run_here(), "here")
    if "--json" in argv:
        sys.stdout.write(json.dumps([dataclasses.asdict(result) for result in report.results]) + "\n")
    else:
        for result in report.results:
            sys.stdout.write(f"{'ok  ' if result.ok else 'FAIL'} {result.name}: {result.detail}\n")
        sys.stdout.write(report.summary() + "\n")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

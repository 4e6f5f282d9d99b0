"""The self-check: every torch internal that ``api`` relies on, checked on the torch this process runs.

One named check per private name or behaviour (``CHECKS``, in the order of ``api``). It runs in one
process without torchrun: on a world of one (a gloo process group over an in-memory ``HashStore``,
created for the check and destroyed after it). Where this process already has a default process
group, the check runs in a fresh subprocess instead, so the user's group is never touched; so it does
while torch is still being imported here (auto-activation's import hooks).

Nothing it does outlives it: the probe operator it defines (``keras_dtensor_mixfix_selfcheck::probe``)
and every rule it registers are removed, and it never touches the package's patch (it promotes nothing
through it and reads none of its state). ``python -m keras_dtensor_mixfix doctor`` prints each check;
the version gate runs it before activating on a torch newer than the newest tested one, when the user
opted in (see ``_lifecycle.torch_gate``). The checks themselves are in ``checks``, their probe in ``probe``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
from typing import Any, Callable, ClassVar, Dict, Iterator, List, Optional, Tuple

from .checks import CHECKS
from .probe import PROBE_QUALNAME, Probe  # noqa: F401 - PROBE_QUALNAME: for tests

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """One check's outcome: what it checks (``relies_on``) and what it saw (``detail``)."""

    name: str
    relies_on: str
    ok: bool
    detail: str


@dataclasses.dataclass(frozen=True)
class SelfCheckReport:
    """The results of one self-check run (of torch's internals; the Keras self-check's report derives from it)."""

    TITLE: ClassVar[str] = "self-check"
    SUBJECT: ClassVar[str] = "torch"

    version: str
    """The release checked (torch's, or Keras' for the Keras self-check)."""
    results: Tuple[CheckResult, ...]
    where: str
    """How it ran: in this process (a world of one), or in a subprocess (this process has a process group)."""

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(result.ok for result in self.results)

    @property
    def failed(self) -> Tuple[CheckResult, ...]:
        return tuple(result for result in self.results if not result.ok)

    def summary(self) -> str:
        """One line: all passed, or the failing checks with what they saw."""
        release = f"{self.SUBJECT} {self.version}"
        if self.ok:
            return f"{self.TITLE} passed ({len(self.results)} checks of {self.SUBJECT} internals, {release})"
        failed = self.failed
        if not failed:
            return f"{self.TITLE} failed on {release}: no check ran"
        first = failed[0]
        more = f" (and {len(failed) - 1} more: {', '.join(r.name for r in failed[1:])})" if len(failed) > 1 else ""
        return f"{self.TITLE} failed on {release}: check {first.name!r} ({first.relies_on}): {first.detail}{more}"


def run_check(check: Any, *args: Any) -> CheckResult:
    """``check.run(*args)``'s result: what it saw, or, where it raises, the failure it reports."""
    try:
        return CheckResult(check.name, check.relies_on, True, check.run(*args))
    except Exception as exc:  # noqa: BLE001 - a failing check is a result, not a crash
        return CheckResult(check.name, check.relies_on, False, " ".join(f"{type(exc).__name__}: {exc}".split()))


def results_from_subprocess(module: str, checks: Dict[str, Any], env: Dict[str, str]) -> Tuple[CheckResult, ...]:
    """Run ``python -m module --json`` with ``env`` and read its results; a child that did not report makes
    every one of ``checks`` (name -> object with ``name`` and ``relies_on``) a failure saying why."""
    stderr = ""
    try:
        done = subprocess.run([sys.executable, "-m", module, "--json"], capture_output=True, text=True, env=env,
                              timeout=300)
        stderr = done.stderr
        rows = json.loads(done.stdout.strip().splitlines()[-1])
        return tuple(CheckResult(**row) for row in rows)
    except Exception as exc:  # noqa: BLE001 - a child that did not report: every check failed, with why
        last = (stderr.strip().splitlines() or [""])[-1]
        text = " ".join(f"the self-check subprocess failed: {type(exc).__name__}: {exc} {last}".split())
        return tuple(CheckResult(check.name, check.relies_on, False, text) for check in checks.values())


# --------------------------------------------------------------------------- running them


@contextlib.contextmanager
def _world_of_one() -> Iterator[None]:
    """A gloo process group of one rank over an in-memory store, destroyed on exit."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _torch_version() -> str:
    from .versions import running_torch_version

    return running_torch_version()


def _run_here() -> Tuple[CheckResult, ...]:
    results: List[CheckResult] = []
    try:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_gloo_available():
            raise RuntimeError("this torch has no torch.distributed with gloo")
        with _world_of_one():
            probe = Probe()
            try:
                results.extend(run_check(check, probe) for check in CHECKS.values())
            finally:
                probe.close()
    except Exception as exc:  # noqa: BLE001 - no world of one: every check not run is a failure
        text = " ".join(f"could not set up a world of one: {type(exc).__name__}: {exc}".split())
        done = {result.name for result in results}
        results.extend(CheckResult(check.name, check.relies_on, False, text)
                       for check in CHECKS.values() if check.name not in done)
    return tuple(results)


def _run_in_subprocess() -> Tuple[CheckResult, ...]:
    env = dict(os.environ)
    env["KERAS_DTENSOR_MIXFIX"] = "0"  # the child checks torch; it has nothing to patch
    return results_from_subprocess(__name__, CHECKS, env)


def _torch_still_importing() -> bool:
    """Whether some torch module is still executing its import here (Python marks it initializing).

    Auto-activation asks for the self-check from import hooks: when Keras' modules load, torch._dynamo
    can be half imported, and building a mesh or a DTensor then fails for that reason alone.
    ``torch.distributed.tensor`` does not count: auto-activation's hook on it runs once it has executed,
    while Python still marks it initializing.
    """
    for name, module in list(sys.modules.items()):
        if (name == "torch" or name.startswith("torch.")) and name != "torch.distributed.tensor" \
                and getattr(getattr(module, "__spec__", None), "_initializing", False):
            return True
    return False


def run_self_check() -> SelfCheckReport:
    """Run every check now: in this process on a world of one, or in a fresh subprocess where this process
    already has a default process group (its own world is left alone) or is still importing torch."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return SelfCheckReport(_torch_version(), _run_in_subprocess(),
                               "in a subprocess (this process already has a process group)")
    if _torch_still_importing():
        return SelfCheckReport(_torch_version(), _run_in_subprocess(),
                               "in a subprocess (this process was still importing torch)")
    return SelfCheckReport(_torch_version(), _run_here(), "in this process, on a gloo world of one")


class ReportCache:
    """A self-check report made once per process (torch and Keras do not change under a running process), and
    forgotten on demand (tests that simulate a failing check). ``make`` is called under the cache's lock."""

    def __init__(self, make: Callable[[], SelfCheckReport]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._report: Optional[SelfCheckReport] = None

    def get(self) -> SelfCheckReport:
        with self._lock:
            if self._report is None:
                self._report = self._make()
                log.debug("keras_dtensor_mixfix: %s", self._report.summary())
            return self._report

    def clear(self) -> None:
        with self._lock:
            self._report = None


_cache = ReportCache(lambda: run_self_check())  # looked up at each run: tests replace run_self_check


def self_check() -> SelfCheckReport:
    """The self-check's report, run once per process (torch does not change under a running process)."""
    # Imported before the lock: this first import of DTensor may run auto-activation's hook, which asks
    # for this report itself (and runs the check then); the check must not import it under the lock.
    import torch.distributed.tensor  # noqa: F401

    return _cache.get()


def clear_cache() -> None:
    """Forget the cached report (tests that simulate a failing check)."""
    _cache.clear()


def _main(argv: List[str]) -> int:
    report = SelfCheckReport(_torch_version(), _run_here(), "in this process, on a gloo world of one")
    if "--json" in argv:
        print(json.dumps([dataclasses.asdict(result) for result in report.results]))
    else:
        for result in report.results:
            print(f"{'ok  ' if result.ok else 'FAIL'} {result.name}: {result.detail}")
        print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

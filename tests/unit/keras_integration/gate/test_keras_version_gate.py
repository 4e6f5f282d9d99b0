"""The Keras gate: which Keras releases the integration installs into, and what it says about the others.

Another Keras is simulated by the version string the gate reads (``keras_modules.running_keras_version``);
a Keras whose internals changed, by a self-check report that fails. No Keras is imported here.
"""

from __future__ import annotations

import logging

import pytest

from keras_dtensor_mixfix._keras.boundary import keras_modules
from keras_dtensor_mixfix._keras.gate import keras_gate, selfcheck
from keras_dtensor_mixfix._rules import env
from keras_dtensor_mixfix._torch.selfcheck import CheckResult

OLDEST, NEWEST = keras_modules.OLDEST_KERAS, keras_modules.NEWEST_KERAS
NEWER = f"{NEWEST[0]}.{NEWEST[1] + 1}.0"
OLDER = f"{OLDEST[0]}.{OLDEST[1] - 1}.3"


@pytest.fixture(autouse=True)
def _fresh_gate(monkeypatch):
    monkeypatch.delenv("KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_KERAS", raising=False)
    monkeypatch.setattr(env, "_warned", set())
    selfcheck.clear_cache()
    yield
    selfcheck.clear_cache()


def _running(monkeypatch, version: str) -> None:
    monkeypatch.setattr(keras_modules, "running_keras_version", lambda: version)


def _report(monkeypatch, ok: bool) -> list:
    """Replace the self-check's run (a subprocess) by a report that passes or fails; returns the calls."""
    calls = []

    def run() -> selfcheck.KerasSelfCheckReport:
        calls.append(1)
        result = CheckResult("trainer_steps", "the torch trainer's make_*_function(force)", ok,
                             "seen" if ok else "AttributeError: simulated: this Keras changed it")
        return selfcheck.KerasSelfCheckReport(NEWER, (result,), "in a subprocess")

    monkeypatch.setattr(selfcheck, "run_self_check", run)
    return calls


@pytest.mark.parametrize("version, kind", [
    ("3.12.4", keras_gate.SUPPORTED), ("3.13.2", keras_gate.SUPPORTED), ("3.14.1", keras_gate.SUPPORTED),
    ("3.15.1", keras_gate.SUPPORTED), ("3.16.0.dev2026102704", keras_gate.SUPPORTED), ("3.11.3", keras_gate.OLDER),
    ("3.0.5", keras_gate.OLDER), ("2.15.0", keras_gate.OLDER), ("3.17.0", keras_gate.NEWER),
    ("4.0.0", keras_gate.NEWER), ("nightly", keras_gate.UNREADABLE)])
def test_each_release_is_classified(version, kind):
    assert keras_gate.classify(version) == kind


def test_the_checked_releases_are_the_supported_range_and_its_ends():
    kinds = {keras_gate.classify(version) for version in keras_modules.CHECKED_RELEASES}
    assert kinds == {keras_gate.SUPPORTED}
    releases = sorted(tuple(int(part) for part in version.split(".")[:2]) for version in keras_modules.CHECKED_RELEASES)
    assert (releases[0], releases[-1]) == (OLDEST, NEWEST)
    assert keras_gate.supported_releases() == f"Keras {OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}.x"


def test_an_older_keras_is_refused_with_the_supported_releases_and_the_install_command(monkeypatch):
    _running(monkeypatch, OLDER)
    calls = _report(monkeypatch, True)
    for opted in (None, True):  # never opted in to: the integration uses internals those releases lack
        reason = keras_gate.refusal(opted)
        assert reason is not None and reason.startswith(f"Keras {OLDER} is older than the supported releases")
        assert keras_gate.supported_releases() in reason and keras_gate.install_command() in reason
        assert "Keras runs as it is" in reason and "torch promotion is unaffected" in reason
    assert calls == []
    assert keras_gate.install_command() == f"pip install 'keras>={OLDEST[0]}.{OLDEST[1]},<{NEWEST[0]}.{NEWEST[1] + 1}'"


def test_a_newer_keras_is_refused_until_opted_in_and_says_how(monkeypatch):
    _running(monkeypatch, NEWER)
    calls = _report(monkeypatch, True)
    reason = keras_gate.refusal()
    assert reason is not None and f"Keras {NEWER} is newer than the newest tested release" in reason
    assert "KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_KERAS=1" in reason and "allow_newer_keras=True" in reason
    assert calls == []  # no self-check without the opt-in


@pytest.mark.parametrize("how", ["environment", "argument"])
def test_a_newer_keras_opted_in_installs_once_its_self_check_passes_with_one_warning(monkeypatch, caplog, how):
    _running(monkeypatch, NEWER)
    calls = _report(monkeypatch, True)
    if how == "environment":
        monkeypatch.setenv("KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_KERAS", "1")
    allow = None if how == "environment" else True
    with caplog.at_level(logging.WARNING, logger="keras_dtensor_mixfix"):
        assert keras_gate.refusal(allow) is None
        assert keras_gate.refusal(allow) is None
    assert calls == [1]  # run once per process
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1, warnings
    assert f"Keras {NEWER} is newer" in warnings[0] and "Keras self-check passed" in warnings[0]
    assert ("KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_KERAS=1" if how == "environment" else "allow_newer_keras=True") \
        in warnings[0]


def test_a_newer_keras_whose_self_check_fails_is_refused_naming_the_check(monkeypatch):
    _running(monkeypatch, NEWER)
    _report(monkeypatch, False)
    reason = keras_gate.refusal(True)
    assert reason is not None
    assert "check 'trainer_steps'" in reason and "simulated: this Keras changed it" in reason
    assert "doctor" in reason and keras_gate.install_command() in reason


def test_an_explicit_false_beats_the_environment(monkeypatch):
    _running(monkeypatch, NEWER)
    _report(monkeypatch, True)
    monkeypatch.setenv("KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_KERAS", "1")
    assert keras_gate.refusal(False) is not None

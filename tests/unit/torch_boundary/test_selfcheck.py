"""The self-check of torch internals and the version gate it opens for a newer torch (single process).

A newer torch is simulated by the version string the gate reads (``versions.running_torch_version``);
a torch where an internal changed, by replacing one check with one that fails.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging

import pytest
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import keras_dtensor_mixfix as mf
from keras_dtensor_mixfix._rules import env
from keras_dtensor_mixfix._torch import api, operators, selfcheck, versions

# Derived from the range, so that these tests hold wherever it moves (tools/newest_torch.sh moves it).
NEWER = f"{versions.NEWEST_TORCH[0]}.{versions.NEWEST_TORCH[1] + 1}.0"
OLDER = f"{versions.OLDEST_TORCH[0]}.{versions.OLDEST_TORCH[1] - 1}.0"
RANGE = versions.supported_range()


def _dtensor_rules() -> dict:
    from torch._library import simple_registry

    return {qualname: entry.torch_dispatch_rules.find(DTensor)
            for qualname, entry in simple_registry.singleton._data.items()
            if entry.torch_dispatch_rules.find(DTensor) is not None}


@pytest.fixture(autouse=True)
def _fresh_gate_and_self_check(monkeypatch):
    # tests/conftest.py sees to the patch state; this resets what the version gate and the self-check remember
    monkeypatch.delenv("KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH", raising=False)
    monkeypatch.setattr(env, "_warned", set())
    selfcheck.clear_cache()
    yield
    selfcheck.clear_cache()


def _fail_check(monkeypatch, name: str) -> None:
    def fails(probe):
        raise AssertionError("simulated: this torch changed it")

    monkeypatch.setitem(selfcheck.CHECKS, name, dataclasses.replace(selfcheck.CHECKS[name], run=fails))


# --------------------------------------------------------------------------- the self-check


def test_every_check_passes_on_this_torch_and_each_is_named():
    report = selfcheck.run_self_check()
    assert report.ok, [f"{r.name}: {r.detail}" for r in report.failed]
    assert [r.name for r in report.results] == list(selfcheck.CHECKS)
    assert len(report.results) >= 20 and all(r.detail and r.relies_on for r in report.results)
    assert report.where == "in this process, on a gloo world of one"
    assert report.summary().startswith(f"self-check passed ({len(report.results)} checks")


def test_every_name_of_the_torch_boundary_is_exercised_by_a_check():
    sources = "\n".join(inspect.getsource(check.run) for check in selfcheck.CHECKS.values())
    missing = [name for name in api.__all__ if name not in sources]
    assert not missing, f"_torch/api.py names no self-check exercises: {missing}"


def test_the_check_leaves_no_trace_patched_or_not():
    before = _dtensor_rules()
    assert selfcheck.run_self_check().ok
    assert not dist.is_initialized()  # its world of one is gone
    assert selfcheck.PROBE_QUALNAME not in set(operators.all_op_names())  # and its probe op
    assert _dtensor_rules() == before
    mf.patch()
    hooked = _dtensor_rules()
    options = mf.current_options()
    assert selfcheck.run_self_check().ok  # while patched: it promotes nothing through the patch
    assert mf.is_patched() and mf.current_options() is options and _dtensor_rules() == hooked
    assert mf.stats() == {}
    mf.unpatch()
    assert _dtensor_rules() == before


def test_a_failing_check_is_named_and_the_others_still_run(monkeypatch):
    _fail_check(monkeypatch, "implicit_replication")
    report = selfcheck.run_self_check()
    assert not report.ok and [r.name for r in report.failed] == ["implicit_replication"]
    assert len(report.results) == len(selfcheck.CHECKS)
    summary = report.summary()
    assert "check 'implicit_replication'" in summary and "simulated: this torch changed it" in summary
    assert "\n" not in summary


def test_the_report_is_run_once_per_process(monkeypatch):
    runs = []
    report = selfcheck.SelfCheckReport("2.13.0", (), "nowhere")
    monkeypatch.setattr(selfcheck, "run_self_check", lambda: runs.append(1) or report)
    assert selfcheck.self_check() is report and selfcheck.self_check() is report and runs == [1]


# --------------------------------------------------------------------------- the gate


@pytest.fixture
def newer_torch(monkeypatch):
    monkeypatch.setattr(versions, "running_torch_version", lambda: NEWER)


def test_a_newer_torch_is_refused_without_the_opt_in(newer_torch):
    with pytest.raises(mf.UnsupportedTorchError) as raised:
        mf.patch()
    text = str(raised.value)
    assert f"torch {NEWER} is outside the supported range ({RANGE})" in text
    assert "KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH=1" in text and "patch(allow_newer_torch=True)" in text
    assert not mf.is_patched()
    with pytest.raises(mf.UnsupportedTorchError):
        mf.patch(allow_newer_torch=False)


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_a_newer_torch_with_the_opt_in_patches_after_the_self_check_with_one_warning(newer_torch, monkeypatch, caplog,
                                                                                     how):
    caplog.set_level(logging.WARNING, logger="keras_dtensor_mixfix")
    if how == "argument":
        mf.patch(allow_newer_torch=True)
    else:
        monkeypatch.setenv("KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH", "1")
        mf.patch()
    assert mf.is_patched()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and f"torch {NEWER} is newer than the newest tested release ({RANGE})" in warnings[0]
    assert "self-check passed" in warnings[0] and "so promotion is on" in warnings[0]
    mf.unpatch()
    mf.patch(allow_newer_torch=True)  # once per process
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


def test_a_newer_torch_whose_self_check_fails_is_refused_naming_the_check(newer_torch, monkeypatch):
    _fail_check(monkeypatch, "rule_before_fast_path")
    with pytest.raises(mf.UnsupportedTorchError) as raised:
        mf.patch(allow_newer_torch=True)
    text = str(raised.value)
    assert f"torch {NEWER} is newer than the newest tested release" in text
    assert "opted in with patch(allow_newer_torch=True)" in text
    assert "self-check failed" in text and "check 'rule_before_fast_path'" in text and "doctor" in text
    assert not mf.is_patched()


def test_an_older_torch_is_never_allowed(monkeypatch):
    monkeypatch.setattr(versions, "running_torch_version", lambda: OLDER)
    monkeypatch.setenv("KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH", "1")
    with pytest.raises(mf.UnsupportedTorchError) as raised:
        mf.patch(allow_newer_torch=True)
    assert "releases before %d.%d are never supported" % versions.OLDEST_TORCH in str(raised.value)
    assert not mf.is_patched()


def test_a_patched_block_that_ends_by_patching_again_keeps_the_opt_in(newer_torch):
    mf.patch(allow_newer_torch=True)
    with mf.patched(default="local"):
        mf.unpatch()
    assert mf.is_patched() and mf.current_options().default == "replicate"


def test_the_opt_in_changes_nothing_on_a_supported_torch(caplog):
    caplog.set_level(logging.WARNING, logger="keras_dtensor_mixfix")
    runs = []
    original = selfcheck.run_self_check
    selfcheck.run_self_check = lambda: runs.append(1) or original()
    try:
        mf.patch(allow_newer_torch=True)
    finally:
        selfcheck.run_self_check = original
    assert mf.is_patched() and runs == [] and not caplog.records


def test_the_environment_variable_is_known_and_validated(monkeypatch, caplog):
    from keras_dtensor_mixfix._rules import env

    caplog.set_level(logging.WARNING, logger="keras_dtensor_mixfix")
    assert env.allow_newer_torch({"KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH": "yes"}) is True
    assert env.allow_newer_torch({}) is False
    assert env.allow_newer_torch({"KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH": "perhaps-x"}) is False
    env.options_from_env({"KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH": "1"})  # not a patch() option, not unknown
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH='perhaps-x'" in messages[0]


def test_versions_classify_releases():
    oldest, newest = "%d.%d.1+cu130" % versions.OLDEST_TORCH, "%d.%d.0" % versions.NEWEST_TORCH
    assert versions.classify(oldest) == versions.SUPPORTED == versions.classify(newest)
    assert versions.classify(NEWER + ".dev20261201") == versions.NEWER == versions.classify("9.0.0")
    assert versions.classify(OLDER) == versions.OLDER and versions.classify("garbage") == versions.UNREADABLE
    assert versions.unsupported_reason(newest) is None

"""The collective timeout of the group ``keras.distribution.initialize()`` creates, and its store under torchrun.

Which timeout is in force (``set_collective_timeout``, else ``KERAS_DTENSOR_MIXFIX_COLLECTIVE_TIMEOUT``, else 600 s),
what a malformed value does (the variable warns once and is ignored; the function refuses it), that
``init_process_group`` receives it, and that a torchrun worker on its agent's shared store builds its group under a
prefix of its attempt while any other launch keeps torch's own ``env://``. The timeout at work, a stalled rank ending
the job, is in tests/keras_integration/test_keras_faults.py.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, List

import pytest
import torch.distributed as dist

import keras_dtensor_mixfix as mf
from keras_dtensor_mixfix import keras_integration
from keras_dtensor_mixfix._keras.backend import cuda_devices, distribution_lib
from keras_dtensor_mixfix._rules import env


@pytest.fixture(autouse=True)
def _no_override():
    keras_integration.set_collective_timeout(None)
    yield
    keras_integration.set_collective_timeout(None)


def test_the_default_is_ten_minutes(monkeypatch):
    monkeypatch.delenv(env.COLLECTIVE_TIMEOUT, raising=False)
    assert distribution_lib.collective_timeout() == datetime.timedelta(seconds=600)


def test_the_variable_sets_it_and_the_function_wins_over_the_variable(monkeypatch):
    monkeypatch.setenv(env.COLLECTIVE_TIMEOUT, "90")
    assert distribution_lib.collective_timeout() == datetime.timedelta(seconds=90)
    keras_integration.set_collective_timeout(datetime.timedelta(minutes=2))
    assert distribution_lib.collective_timeout() == datetime.timedelta(seconds=120)
    keras_integration.set_collective_timeout(7.5)
    assert distribution_lib.collective_timeout() == datetime.timedelta(seconds=7.5)
    keras_integration.set_collective_timeout(None)
    assert distribution_lib.collective_timeout() == datetime.timedelta(seconds=90)


@pytest.mark.parametrize("raw", ["ten", "0", "-5", "inf", "nan"])
def test_a_malformed_variable_warns_and_the_default_stays(monkeypatch, caplog, raw):
    monkeypatch.setenv(env.COLLECTIVE_TIMEOUT, raw)
    with caplog.at_level(logging.WARNING, logger="keras_dtensor_mixfix"):
        assert distribution_lib.collective_timeout() == datetime.timedelta(seconds=600)
    assert env.COLLECTIVE_TIMEOUT in caplog.text or (env.COLLECTIVE_TIMEOUT, raw) in env._warned


def test_the_variable_is_not_taken_for_a_patch_option(monkeypatch, caplog):
    monkeypatch.setenv(env.COLLECTIVE_TIMEOUT, "30")
    with caplog.at_level(logging.WARNING, logger="keras_dtensor_mixfix"):
        env.options_from_env()
    assert "unknown variable" not in caplog.text


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "60", True])
def test_set_collective_timeout_refuses_what_is_not_a_positive_duration(bad):
    with pytest.raises(mf.InvalidArgumentError, match="expected a number of seconds above 0"):
        keras_integration.set_collective_timeout(bad)


def _fake_initialize(monkeypatch) -> List[Any]:
    calls: List[Any] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: calls.append((backend, kwargs)))
    monkeypatch.setattr(cuda_devices, "select_device", lambda: None)
    monkeypatch.setattr(cuda_devices, "check_one_rank_per_device", lambda: None)
    monkeypatch.setattr(distribution_lib, "_agree_on_seed", lambda: None)
    monkeypatch.setattr(distribution_lib.torch.cuda, "is_available", lambda: False)
    return calls


def test_initialize_gives_the_group_the_timeout(monkeypatch):
    calls = _fake_initialize(monkeypatch)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    keras_integration.set_collective_timeout(42)
    distribution_lib.initialize()
    assert calls == [("gloo", {"timeout": datetime.timedelta(seconds=42)})]  # torch's own env://, no store of ours
    distribution_lib.initialize("127.0.0.1:29500", 2, 1)
    assert calls[1] == ("gloo", {"init_method": "tcp://127.0.0.1:29500", "world_size": 2, "rank": 1,
                                 "timeout": datetime.timedelta(seconds=42)})


def test_a_torchrun_worker_on_the_agents_store_builds_its_group_under_its_attempt(monkeypatch):
    calls = _fake_initialize(monkeypatch)
    made: List[Any] = []

    class FakeTCPStore:
        def __init__(self, *args, **kwargs):
            made.append((args, kwargs))

    monkeypatch.setattr(dist, "TCPStore", FakeTCPStore)
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: ("prefixed", prefix, store))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29511")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    distribution_lib.initialize()
    (backend, kwargs), = calls
    assert made == [(("127.0.0.1", 29511, 2), {"is_master": False, "timeout": datetime.timedelta(seconds=600)})]
    assert kwargs["store"][:2] == ("prefixed", "keras_dtensor_mixfix/attempt-3")  # no key of attempt 2 is read
    assert (kwargs["rank"], kwargs["world_size"], backend) == (1, 2, "gloo")

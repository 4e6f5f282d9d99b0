"""The engine's one admission (opstate.admit): may an op's calls take a cached path (fast.py, foreach.py's
direct path), under the options and rules in force. Computed once per op and remembered until either changes."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch

from keras_dtensor_mixfix._engine import context
from keras_dtensor_mixfix._engine.opstate import OpState, admission, admit
from keras_dtensor_mixfix._rules.options import Options
from keras_dtensor_mixfix._rules.registry import registry

MUL = torch.ops.aten.mul.Tensor


@contextlib.contextmanager
def options_in_force(options: Options) -> Iterator[None]:
    previous = context.update_options(options)
    try:
        yield
    finally:
        context.update_options(previous.options)


@pytest.mark.parametrize("options, admitted, direct", [
    (Options(), True, True),
    (Options(direct=False), True, False),  # admitted; direct plans off
    (Options(plain_grads=False), True, True),
    (Options(check="warn"), False, None),  # a check adds per-operand work
    (Options(default="local"), False, None),
    (Options(default=lambda call: "replicate"), False, None),  # a callable may answer anything
])
def test_admission_is_the_replicate_rule_by_name_and_no_per_operand_option(options, admitted, direct):
    with options_in_force(options):
        flags = admission(OpState(MUL), MUL)
    assert (flags is not None) == admitted
    if admitted:
        assert flags.direct == direct and flags.options is options


def test_admission_is_remembered_until_the_options_change():
    info = OpState(MUL)
    with options_in_force(Options()):
        assert admission(info, MUL) is not None
        remembered = info.admission
        admission(info, MUL)
        assert info.admission is remembered  # not worked out again
    with options_in_force(Options(check="warn")):
        assert admission(info, MUL) is None
        assert info.admission is not remembered


def test_admission_follows_a_rule_registered_for_the_op():
    info = OpState(MUL)
    with options_in_force(Options()):
        assert admit(info, MUL) is not None
        handle = registry.register(MUL, "local", source="test")
        try:
            assert admission(info, MUL) is None  # the registry's version moved: worked out again
        finally:
            handle.remove()
        assert admission(info, MUL) is not None
        handle = registry.register(MUL, "replicate", source="test")
        try:
            assert admission(info, MUL) is not None  # "replicate" by name, registered for the op
        finally:
            handle.remove()

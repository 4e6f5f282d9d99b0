"""The dispatch rules (engine entry) act on a call exactly where operands.needs_promotion finds an operand.

``needs_promotion`` is the one definition of "a plain multi-element tensor"; the rule spells it out in its
loops over positional arguments and list items (a call per argument would cost every pure call), so these
tests hold every place the rule looks to the predicate's answer. No DTensor is needed: a value is judged
where it stands, and a call without one reaches the end of the scan.
"""

from __future__ import annotations

from typing import Any, List

import pytest
import torch

from keras_dtensor_mixfix._engine.entry import make_dispatch_rule, make_write_rule
from keras_dtensor_mixfix._engine.operands import needs_promotion

VALUES = {
    "plain, several elements": torch.ones(3),
    "plain, one element": torch.ones(1),
    "plain, zero-dim": torch.tensor(2.0),
    "plain, empty": torch.ones(0),
    "parameter, several elements": torch.nn.Parameter(torch.ones(2, 2)),
    "parameter, one element": torch.nn.Parameter(torch.ones(())),
    "int": 3,
    "float": 0.5,
    "None": None,
}


def _acts(args: tuple, kwargs: dict) -> bool:
    calls: List[Any] = []
    rule = make_dispatch_rule(lambda func, a, k: calls.append(a) or "handled")
    answer = rule(None, None, (), args, kwargs)
    assert (answer == "handled") == bool(calls)
    assert answer in ("handled", NotImplemented)
    return bool(calls)


def test_the_predicate_is_a_plain_tensor_of_other_than_one_element():
    assert [name for name, value in VALUES.items() if needs_promotion(value)] == [
        "plain, several elements", "plain, empty", "parameter, several elements"]


@pytest.mark.parametrize("name", sorted(VALUES))
def test_the_rule_acts_where_the_predicate_says(name):
    value = VALUES[name]
    expected = needs_promotion(value)
    where = {
        "the only argument": ((value,), {}),
        "the second of two": ((1, value), {}),
        "the third of three": ((1, 2, value), {}),
        "in a list": (([1, value],), {}),
        "in a tuple": (((value, 1),), {}),
        "a keyword argument": ((1,), {"other": value}),
        "in a keyword list": ((1,), {"others": [1, value]}),
    }
    assert ({place: _acts(args, kwargs) for place, (args, kwargs) in where.items()}
            == {place: expected for place in where})


def test_the_write_rule_also_acts_on_a_written_plain_one_element_tensor():
    calls: List[Any] = []
    rule = make_write_rule(make_dispatch_rule(lambda func, a, k: calls.append(a) or "handled"),
                           lambda func, a, k: calls.append(a) or "written")
    assert rule(None, None, (), (torch.ones(1), 2.0), {}) == "written"
    assert rule(None, None, (), (1.0, torch.ones(1)), {}) is NotImplemented

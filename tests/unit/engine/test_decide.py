"""Rule resolution (the engine's decide step) without a process group: one meaning per answer."""

from __future__ import annotations

import pytest
import torch

from keras_dtensor_mixfix import Decision, MixedCall, Operand, Options
from keras_dtensor_mixfix._engine import context
from keras_dtensor_mixfix._engine.decide import decide
from keras_dtensor_mixfix._rules.errors import MixedOperandError
from keras_dtensor_mixfix._rules.ops import op_traits

OP = torch.ops.aten.mul.Tensor


def _call(n_plain: int = 2) -> MixedCall:
    plain = tuple(Operand((i,), torch.ones(3), True, False) for i in range(n_plain))
    return MixedCall(OP, (), {}, plain, plain, (), None, ())


@pytest.fixture
def default_rule():
    def use(rule):
        context.set_state(True, Options(default=rule))

    yield use
    context.set_state(False, Options())


def _kinds(decisions):
    return {position: d.kind for position, d in decisions.items()}


def test_a_callable_default_may_answer_a_mapping(default_rule):
    # Used to be replaced by "replicate" silently: only str/Decision were accepted from a callable default.
    default_rule(lambda call: {operand.position: "local" for operand in call.plain})
    assert _kinds(decide(_call(), None, op_traits(OP))) == {(0,): "local", (1,): "local"}


def test_a_callable_default_may_answer_a_sequence_with_gaps(default_rule):
    default_rule(lambda call: ["local", None])
    assert _kinds(decide(_call(), None, op_traits(OP))) == {(0,): "local", (1,): "replicate"}


def test_none_in_a_registered_rules_mapping_means_the_default_rule(default_rule):
    default_rule(lambda call: {(0,): "error", (1,): "local"})
    rule = lambda call: {(0,): None, (1,): "replicate"}  # noqa: E731
    assert _kinds(decide(_call(), rule, op_traits(OP))) == {(0,): "error", (1,): "replicate"}


def test_the_default_callable_is_asked_once_per_call(default_rule):
    asked = []
    default_rule(lambda call: asked.append(1) or "local")
    decide(_call(), lambda call: [None, None], op_traits(OP))
    assert asked == [1]


def test_a_decision_object_is_kept_as_given(default_rule):
    default_rule("replicate")
    decision = Decision("local", shape=(6,))
    assert decide(_call(1), decision, op_traits(OP)) == {(0,): decision}


@pytest.mark.parametrize("answer, error", [(["local"], MixedOperandError), ({(0,): "local"}, MixedOperandError),
                                          (3.5, TypeError), ("Local", ValueError)])
def test_malformed_answers_are_refused_with_the_op_named(default_rule, answer, error):
    default_rule("replicate")
    with pytest.raises(error, match="aten::mul.Tensor|rule for"):
        decide(_call(), lambda call: answer, op_traits(OP))

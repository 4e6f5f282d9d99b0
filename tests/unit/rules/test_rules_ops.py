"""Operator naming and per-op facts (``_rules/ops.py``): pure schema inspection, no process group."""

from __future__ import annotations

import pytest
import torch

import keras_dtensor_mixfix as mf
from keras_dtensor_mixfix._rules import ops
from keras_dtensor_mixfix._torch import operators

aten = torch.ops.aten


@pytest.mark.parametrize("name, expected", [
    ("aten::mm.default", aten.mm.default),
    ("aten.mm.default", aten.mm.default),
    ("aten::mul.Tensor", aten.mul.Tensor),
    ("aten::mm", aten.mm),
    ("aten.mm", aten.mm),
    ("  aten::mm  ", aten.mm),
])
def test_resolve_op_reads_every_spelling(name, expected):
    assert ops.resolve_op(name) is expected


def test_resolve_op_returns_operator_objects_as_they_are():
    assert ops.resolve_op(aten.mm.default) is aten.mm.default and ops.resolve_op(aten.mm) is aten.mm


@pytest.mark.parametrize("name, match", [
    ("aten::mull", r"does not exist .*did you mean 'aten::mul'"),
    ("aten::mm.nope", r"has no overload 'nope' \(known overloads: default, .*out\)"),
    ("mm", "cannot parse operator name 'mm'"),
    ("a.b.c.d", "cannot parse operator name"),
    ("::mm", "cannot parse operator name"),
])
def test_resolve_op_refuses_names_that_do_not_parse_or_exist(name, match):
    with pytest.raises(mf.UnknownOperatorError, match=match):
        ops.resolve_op(name)


def test_resolve_op_refuses_objects_that_are_not_operators():
    with pytest.raises(mf.ArgumentTypeError, match="got builtin_function_or_method"):
        ops.resolve_op(torch.mm)


def test_op_key_and_packet_name():
    assert ops.op_key(aten.mm.default) == "aten::mm.default"
    assert ops.op_key(aten.mul.Tensor) == "aten::mul.Tensor"
    assert ops.op_key(aten.mm) == "aten::mm"
    assert ops.packet_name(aten.mul.Tensor) == "aten::mul"


def test_namespace_ops_lists_a_namespace_without_overloads():
    names = ops.namespace_ops("aten")
    assert "aten::mul" in names and "aten::mm" in names and names == sorted(set(names))
    assert all("." not in name.partition("::")[2] for name in names)
    assert ops.namespace_ops("mixfix_unit_no_such_namespace") == []


def test_namespace_ops_treats_every_namespace_as_unknown_without_torchs_listing(monkeypatch):
    monkeypatch.setattr(operators, "_all_op_names", None)
    assert operators.all_op_names() == [] and ops.namespace_ops("aten") == []


def test_pending_key_holds_only_names_in_a_namespace_with_no_operator_yet():
    assert ops.pending_key("flash_attn_unit::fwd") == "flash_attn_unit::fwd"
    assert ops.pending_key("flash_attn_unit.fwd.default") == "flash_attn_unit::fwd.default"
    assert ops.pending_key("aten::mull") is None  # aten is loaded: a typo
    assert ops.pending_key(aten.mm) is None


@pytest.mark.parametrize("op, expected", [
    (aten.mul.Tensor, True),
    (aten.add_.Tensor, True),
    (aten.cat.default, True),  # a Tensor[] argument
    (aten.relu.default, False),
    (aten.linear.default, True),  # input, weight (and an optional bias)
    (aten.sum.default, False),
])
def test_has_two_tensor_inputs(op, expected):
    schema = operators.schema_of(op)
    assert ops.has_two_tensor_inputs(schema) is expected
    assert ops.has_two_tensor_inputs(schema, schema.arguments) is expected


def test_op_traits_of_a_pointwise_op():
    traits = ops.op_traits(aten.mul.Tensor)
    assert traits.name == "aten::mul.Tensor" and traits.elementwise and not traits.foreach
    assert traits.written == frozenset() and traits.lists == () and traits.tensor_lists == ()


def test_op_traits_of_an_in_place_op_take_elementwise_from_its_functional_twin():
    traits = ops.op_traits(aten.add_.Tensor)
    assert traits.elementwise and traits.written == frozenset({0})
    assert not ops.op_traits(aten.mm.default).elementwise


def test_op_traits_of_out_and_list_arguments():
    assert ops.op_traits(aten.mul.out).written == frozenset({"out"})  # a keyword-only written argument
    traits = ops.op_traits(aten._foreach_add_.List)
    assert traits.foreach and traits.elementwise and traits.written == frozenset({0})
    assert traits.lists == (0, 1) and traits.tensor_lists == (0, 1)
    scalars = ops.op_traits(aten._foreach_add_.ScalarList)
    assert scalars.lists == (0, 1) and scalars.tensor_lists == (0,)
    assert ops.op_traits(aten.copy_.default).elementwise  # not tagged pointwise, listed as elementwise


def test_op_traits_are_cached_per_overload():
    assert ops.op_traits(aten.mul.Tensor) is ops.op_traits(aten.mul.Tensor)
    assert "aten::mul.Tensor" in repr(ops.op_traits(aten.mul.Tensor))

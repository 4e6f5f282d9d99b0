"""The per-op rule registry (``_rules/registry.py``) on a registry of its own: stacking, handles, pending rules.

Nothing here patches torch or touches the process-wide registry.
"""

from __future__ import annotations

import logging

import pytest
import torch

import keras_dtensor_mixfix as mf
from keras_dtensor_mixfix._rules.registry import RuleRegistry, registry as process_registry

MUL = torch.ops.aten.mul.Tensor
MUL_SCALAR = torch.ops.aten.mul.Scalar
LOGGER = "keras_dtensor_mixfix._rules.registry"


@pytest.fixture
def reg():
    return RuleRegistry()


def test_a_lookup_finds_the_rule_for_the_overload_or_its_packet_and_none_otherwise(reg):
    assert reg.lookup(MUL) is None
    reg.register("aten::mul", "local")
    assert reg.lookup(MUL) == "local" and reg.lookup(MUL_SCALAR) == "local"
    reg.register(MUL, "error")
    assert reg.lookup(MUL) == "error" and reg.lookup(MUL_SCALAR) == "local"
    assert reg.lookup(torch.ops.aten.add.Tensor) is None


def test_every_spelling_of_an_op_names_the_same_registration(reg):
    for spelling in ("aten::mul.Tensor", "aten.mul.Tensor", " aten::mul.Tensor ", MUL):
        handle = reg.register(spelling, "local")
        assert handle.op == "aten::mul.Tensor" and reg.lookup(MUL) == "local"
        handle.remove()
    assert reg.register(torch.ops.aten.mul, "local").op == "aten::mul"
    assert reg.register("aten::mul", "local").op == "aten::mul"


def test_the_newest_registration_wins_and_removing_it_restores_the_one_below(reg):
    first = reg.register(MUL, "replicate", source="pack a")
    second = reg.register(MUL, "local", source="pack b")
    third = reg.register("aten::mul", "error", source="test")  # a packet competes by age too
    assert reg.lookup(MUL) == "error"
    third.remove()
    assert reg.lookup(MUL) == "local"
    first.remove()  # removing one below the top changes nothing visible
    assert reg.lookup(MUL) == "local" and not first.active and second.active
    second.remove()
    assert reg.lookup(MUL) is None
    second.remove()  # a second remove is harmless
    assert reg.entries() == []


def test_a_second_rule_for_the_same_op_logs_which_earlier_rule_and_source_it_hides(reg, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    reg.register(MUL, "replicate", source="pack a")
    caplog.clear()
    reg.register("aten::mul.Tensor", "local", source="my test")
    hides = [record.getMessage() for record in caplog.records if "wins over" in record.getMessage()]
    assert len(hides) == 1, caplog.text
    assert "'local' for aten::mul.Tensor (from my test)" in hides[0]
    assert "rule 'replicate' for aten::mul.Tensor (from pack a)" in hides[0]
    assert all(record.levelno == logging.DEBUG for record in caplog.records)


def test_overlapping_packet_and_overload_registrations_are_named_too_and_unrelated_ones_are_not(reg, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    reg.register("aten::add.Tensor", "local", source="elsewhere")
    reg.register(MUL_SCALAR, "local", source="pack a")
    caplog.clear()
    reg.register("aten::mul", "error", source="packet")  # hides the mul.Scalar rule, not add's
    reg.register("aten::mul.Scalar", "replicate", source="overload")  # hides the packet rule (and the older one)
    messages = [record.getMessage() for record in caplog.records if "wins over" in record.getMessage()]
    assert len(messages) == 2, caplog.text
    assert "(from pack a)" in messages[0] and "elsewhere" not in messages[0]
    assert "(from packet)" in messages[1] and "(from pack a)" in messages[1]


def test_a_first_registration_logs_no_override(reg, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    reg.register(MUL, "local")
    assert "wins over" not in caplog.text and "registered rule 'local' for aten::mul.Tensor" in caplog.text


def test_a_handle_is_a_context_manager_and_says_what_it_is(reg):
    with reg.register(MUL, "local", source="block") as handle:
        assert handle.active and reg.lookup(MUL) == "local"
        assert repr(handle) == "<RuleHandle aten::mul.Tensor -> 'local' from block (active)>"
    assert not handle.active and reg.lookup(MUL) is None
    assert repr(handle).endswith("(removed)>")


def test_bad_rules_and_typos_are_refused_at_registration(reg):
    with pytest.raises(mf.InvalidArgumentError, match="unknown rule 'copy'"):
        reg.register(MUL, "copy")
    with pytest.raises(mf.ArgumentTypeError):
        reg.register(MUL, 3)
    with pytest.raises(mf.UnknownOperatorError, match="did you mean 'aten::mul'"):
        reg.register("aten::mull.Tensor", "local")  # aten has operators: a typo, not a pending rule
    assert reg.entries() == []


def test_each_change_bumps_the_version_and_clears_the_lookup_cache(reg):
    start = reg.version
    assert reg.lookup(MUL) is None  # cached as "no rule"
    handle = reg.register(MUL, "local")
    assert reg.version == start + 1 and reg.lookup(MUL) == "local"
    handle.remove()
    assert reg.version == start + 2 and reg.lookup(MUL) is None
    reg.clear_cache()
    assert reg.version == start + 3


def test_listeners_hear_the_op_on_registration_and_none_on_removal(reg):
    heard = []
    reg.add_listener(heard.append)
    handle = reg.register(MUL, "local")
    handle.remove()
    assert heard == [MUL, None]


def test_a_rule_for_an_op_not_defined_yet_is_pending_until_its_library_defines_it(reg):
    heard = []
    reg.add_listener(heard.append)
    handle = reg.register("mixfix_unit_registry::later", "local", source="pending test")
    assert handle.pending and heard == [None]
    assert reg.pending_qualnames() == ["mixfix_unit_registry::later"]
    assert reg.resolve_pending() == []
    library = torch.library.Library("mixfix_unit_registry", "DEF")
    try:
        library.define("later(Tensor a, Tensor b) -> Tensor")
        assert reg.resolve_pending() == [handle]
        assert not handle.pending and heard[-1] is torch.ops.mixfix_unit_registry.later
        assert reg.lookup(torch.ops.mixfix_unit_registry.later.default) == "local"
        assert reg.pending_qualnames() == []
    finally:
        library._destroy()


def test_a_pending_rule_found_by_a_lookup_tells_the_listeners_only_at_the_next_resolve(reg):
    heard = []
    handle = reg.register("mixfix_unit_registry2::later.default", "replicate")
    reg.add_listener(heard.append)
    library = torch.library.Library("mixfix_unit_registry2", "DEF")
    try:
        library.define("later(Tensor a) -> Tensor")
        assert reg.lookup(torch.ops.mixfix_unit_registry2.later.default) == "replicate"
        assert not handle.pending and heard == []  # a lookup runs inside an op: no listener there
        assert reg.resolve_pending() == [handle] and len(heard) == 1
    finally:
        library._destroy()


def test_register_rule_uses_the_process_wide_registry():
    handle = mf.register_rule("aten::mul.Tensor", "local", source="unit test")
    try:
        assert any(entry is handle for entry in process_registry.entries())
        assert handle.source == "unit test"
    finally:
        handle.remove()
    assert not any(entry is handle for entry in process_registry.entries())

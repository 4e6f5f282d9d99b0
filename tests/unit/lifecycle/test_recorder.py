"""The one patch recorder (``_lifecycle.recorder``): exact restore, only where still ours."""

from __future__ import annotations

import logging
import sys
import types

import pytest

import keras_dtensor_mixfix as mf
from keras_dtensor_mixfix._lifecycle.recorder import MISSING, MissingAttributeError, PatchRecorder, current_value


class Base:
    def method(self) -> str:
        return "base"

    @staticmethod
    def helper() -> str:
        return "helper"


class Child(Base):
    pass


def test_the_keras_integration_records_through_the_one_recorder():
    pytest.importorskip("keras")
    from keras_dtensor_mixfix import keras_integration

    was_installed = keras_integration.is_installed()
    keras_integration.install()
    try:
        recorder = keras_integration._STATE.recorder
        assert isinstance(recorder, PatchRecorder) and len(recorder) > 0
    finally:
        if not was_installed:
            keras_integration.uninstall()


def test_an_attribute_only_inherited_is_deleted_not_set():
    recorder = PatchRecorder()
    assert current_value(Child, "method") is MISSING
    recorder.set(Child, "method", lambda self: "ours")
    assert Child().method() == "ours"
    recorder.restore()
    assert "method" not in vars(Child)  # deleted: the inherited one shows again
    assert Child().method() == "base"


def test_an_instance_attribute_shadowing_a_method_is_deleted():
    holder = Base()
    recorder = PatchRecorder()
    recorder.set(holder, "method", lambda: "ours")
    assert holder.method() == "ours"
    recorder.restore()
    assert "method" not in vars(holder) and holder.method() == "base"


def test_a_staticmethod_comes_back_as_the_same_descriptor():
    original = vars(Base)["helper"]
    recorder = PatchRecorder()
    recorder.set(Base, "helper", staticmethod(lambda: "ours"))
    assert Base.helper() == "ours"
    recorder.restore()
    assert vars(Base)["helper"] is original


def test_undo_runs_in_reverse_order():
    module = types.ModuleType("recorder_target")
    module.value = "first"
    recorder = PatchRecorder()
    recorder.set(module, "value", "second")
    recorder.set(module, "value", "third")  # on top of our own: restored through "second"
    assert len(recorder) == 2
    assert recorder.restore() == []
    assert module.value == "first"


def test_a_second_restore_does_nothing():
    module = types.ModuleType("recorder_target")
    module.value = "first"
    recorder = PatchRecorder()
    recorder.set(module, "value", "second")
    recorder.restore()
    module.value = "changed later by the user"
    assert recorder.restore() == [] and len(recorder) == 0
    assert module.value == "changed later by the user"


def test_someone_patched_on_top_warns_names_it_and_leaves_it(caplog):
    caplog.set_level(logging.WARNING, logger="keras_dtensor_mixfix")
    module = types.ModuleType("recorder_target")
    module.value = "original"
    module.other = "original other"
    recorder = PatchRecorder()
    recorder.set(module, "value", "ours")
    recorder.set(module, "other", "ours", label="the other thing")
    module.value = "theirs"
    assert recorder.restore() == ["recorder_target.value"]
    assert module.value == "theirs"  # left in place
    assert module.other == "original other"  # the rest is restored
    assert "recorder_target.value was replaced by someone else; left as it is" in caplog.text
    assert "the other thing" not in caplog.text


def test_dict_entries_are_recorded_too():
    name = "keras_dtensor_mixfix_recorder_test_module"
    recorder = PatchRecorder()
    recorder.set(sys.modules, name, types.ModuleType(name), create=True)
    assert name in sys.modules
    recorder.restore()
    assert name not in sys.modules


def test_a_missing_attribute_is_refused_naming_owner_and_attribute():
    module = types.ModuleType("recorder_target")
    recorder = PatchRecorder()
    with pytest.raises(MissingAttributeError, match=r"recorder_target has no attribute 'renamed_in_this_release'"):
        recorder.set(module, "renamed_in_this_release", "ours")
    with pytest.raises(MissingAttributeError, match=r"'absent' in a dict: the dict has no such key"):
        recorder.set({}, "absent", "ours")
    assert not hasattr(module, "renamed_in_this_release") and len(recorder) == 0  # nothing set, nothing recorded
    # A MixfixError, and still the AttributeError a missing attribute is
    assert issubclass(MissingAttributeError, mf.MixfixError) and issubclass(MissingAttributeError, AttributeError)


def test_create_adds_a_missing_attribute_and_restore_deletes_it():
    module = types.ModuleType("recorder_target")
    recorder = PatchRecorder()
    recorder.set(module, "added", "ours", create=True)
    assert module.added == "ours"
    assert recorder.restore() == []
    assert not hasattr(module, "added")


def test_an_inherited_attribute_exists_for_the_refusal():
    recorder = PatchRecorder()
    recorder.set(Child, "helper", staticmethod(lambda: "ours"))  # Base's, only inherited: replaced, no create
    assert Child.helper() == "ours"
    recorder.restore()
    assert "helper" not in vars(Child) and Child.helper() == "helper"


def test_records_lists_each_replacement_with_what_it_replaced_oldest_first():
    module = types.ModuleType("recorder_target")
    module.value = "first"
    recorder = PatchRecorder()
    assert recorder.records() == []
    recorder.set(module, "value", "second", label="the module's value")
    recorder.set(Child, "method", lambda self: "ours")  # only inherited: nothing of Child's own replaced
    records = recorder.records()
    assert [(r.owner, r.name, r.previous, r.label) for r in records] == [
        (module, "value", "first", "the module's value"), (Child, "method", MISSING, "Child.method")]
    recorder.restore()
    assert recorder.records() == [] and len(records) == 2  # a copy: the earlier list is left as it was

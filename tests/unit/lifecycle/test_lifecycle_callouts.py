"""The lifecycle never calls out under its lock: pack hooks, state listeners and a deferred
auto-activation run with it released, so one that waits on another thread's lifecycle call finishes."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

import keras_dtensor_mixfix as mf
from keras_dtensor_mixfix import hookimpl, register_rule
from keras_dtensor_mixfix._lifecycle import patching
from keras_dtensor_mixfix._rules import packs

JOIN_TIMEOUT_S = 10.0


def _in_another_thread(work) -> bool:
    """Run ``work`` in a new thread and wait for it; whether it finished (False: it hung on a lock held here)."""
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(JOIN_TIMEOUT_S)
    return not thread.is_alive()


def _lifecycle_call_for(patched: bool) -> None:
    """A lifecycle call that takes the lock and changes nothing in the state just heard."""
    if patched:
        mf.patch()  # already patched: nothing to do
    else:
        mf.unpatch()  # not patched: nothing to undo


def test_a_listener_waiting_on_another_threads_lifecycle_call_does_not_hang():
    heard = []

    def listener(patched):
        heard.append((patched, _in_another_thread(lambda: _lifecycle_call_for(patched))))

    patching.add_state_listener(listener)
    try:
        mf.patch()
        mf.unpatch()
        with mf.patched():  # enters by patching
            with mf.patched(default="local"):
                mf.unpatch()  # the inner block's exit patches again, as the outer block had it
            assert mf.is_patched() and mf.current_options().default == "replicate"
    finally:
        patching.remove_state_listener(listener)
    assert heard == [(True, True), (False, True), (True, True), (False, True), (True, True), (False, True)]


def test_a_deferred_auto_activation_runs_after_the_lock_is_released():
    resumed = []

    def resume():  # what auto-activation's deferred patch() stands for: it patches, from here
        resumed.append(_in_another_thread(mf.patch))

    with mf.patched():
        patching.defer_auto_activation(resume)
    assert resumed == [True]
    assert mf.is_patched()  # the state auto-activation would have had
    mf.unpatch()


def test_an_explicit_unpatch_forgets_the_deferred_auto_activation():
    resumed = []
    with mf.patched():
        patching.defer_auto_activation(lambda: resumed.append(True))
        mf.unpatch()
    mf.patch()
    with mf.patched():
        pass
    assert resumed == [] and mf.is_patched()


class _EntryPoint:
    """Stands in for an installed pack's entry point."""

    dist = None

    def __init__(self, name: str, plugin: object) -> None:
        self.name = name
        self.value = f"{name}_module"
        self._plugin = plugin

    def load(self) -> object:
        return self._plugin


@pytest.fixture
def one_pack(monkeypatch):
    """Install one pack whose hook is the test's ``hook(register)``; unload every pack afterwards."""

    def install(hook):
        plugin = types.SimpleNamespace(register_rules=hookimpl(hook))
        monkeypatch.setattr(packs, "_entry_points", lambda: [_EntryPoint("callout_pack", plugin)])
        packs._reset_for_tests()

    yield install
    mf.unpatch()
    packs._reset_for_tests()


def test_a_pack_hook_waiting_on_another_threads_lifecycle_call_does_not_hang(one_pack):
    seen = {}

    def register_rules(register):
        seen["in_progress"] = patching.patch_in_progress()
        seen["patch_here_returns"] = mf.patch() is None and not mf.is_patched()  # this thread's patch() finishes

        def elsewhere():
            handle = register_rule(torch.ops.aten.mm.default, "replicate")  # the registry tells the lifecycle
            handle.remove()
            mf.unpatch()  # not patched yet: takes the lock, changes nothing

        seen["finished"] = _in_another_thread(elsewhere)
        _in_another_thread(lambda: seen.update(in_progress_elsewhere=patching.patch_in_progress()))
        register("aten::mm.default", "local")

    one_pack(register_rules)
    mf.patch()
    assert seen == {"in_progress": True, "patch_here_returns": True, "finished": True, "in_progress_elsewhere": True}
    assert mf.is_patched() and not patching.patch_in_progress()
    record = next(r for r in packs.pack_records() if r.name == "callout_pack")
    assert record.status == "loaded" and len(record.rules) == 1


def test_a_second_thread_loading_packs_waits_until_every_hook_has_run(one_pack):
    statuses = []
    started = threading.Event()

    def load_elsewhere():
        started.set()
        statuses.extend(r.status for r in packs.load_packs() if r.name == "callout_pack")

    def register_rules(register):
        thread = threading.Thread(target=load_elsewhere, daemon=True)
        thread.start()
        started.wait(JOIN_TIMEOUT_S)
        time.sleep(0.2)  # it asks while this hook still runs
        register("aten::mm.default", "local")
        threads.append(thread)

    threads = []
    one_pack(register_rules)
    packs.load_packs()
    threads[0].join(JOIN_TIMEOUT_S)
    assert statuses == ["loaded"]  # not "pending": it returned only once the pack had run


def test_a_patch_from_another_thread_while_packs_load_applies_its_options(one_pack):
    threads = []

    def register_rules(register):
        thread = threading.Thread(target=lambda: mf.patch(default="local"), daemon=True)
        thread.start()  # it waits for the packs, then patches or changes the options of this patch
        time.sleep(0.2)
        threads.append(thread)

    one_pack(register_rules)
    mf.patch()
    threads[0].join(JOIN_TIMEOUT_S)
    assert not threads[0].is_alive()
    assert mf.is_patched() and mf.current_options().default == "local"


def test_the_lifecycle_lock_is_plain_and_a_re_entry_is_an_error_not_a_hang():
    assert isinstance(patching._lock, type(threading.Lock()))
    with patching._locked():
        with pytest.raises(AssertionError, match="re-entered"):
            with patching._locked():
                pass
    with patching._locked():  # released after the refused re-entry
        pass

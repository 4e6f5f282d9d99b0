"""Lifecycle, registry and option validation: single process, no process group needed."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch.distributed.tensor import DTensor

import keras_dtensor_mixfix as mf
from keras_dtensor_mixfix import Decision, register_rule
from keras_dtensor_mixfix._rules.registry import registry


def _dtensor_rules() -> dict:
    """Every (op qualname -> rule) torch currently has registered for the DTensor class."""
    from torch._library import simple_registry

    found = {}
    for qualname, entry in simple_registry.singleton._data.items():
        rule = entry.torch_dispatch_rules.find(DTensor)
        if rule is not None:
            found[qualname] = rule
    return found


def test_patch_unpatch_lifecycle_including_repeats(caplog):
    caplog.set_level(logging.INFO, logger="keras_dtensor_mixfix")
    before = _dtensor_rules()
    swapped_before = _swapped_attributes()
    mf.unpatch()  # unpatch before patch: harmless, logged
    assert "not patched" in caplog.text
    mf.patch()
    assert mf.is_patched()
    hooked = _dtensor_rules()
    assert len(hooked) > len(before) + 1000  # every op with two tensor inputs
    assert "aten::mul.Tensor" in hooked and "aten::mm" in hooked and "aten::_foreach_add_.List" in hooked
    assert "aten::relu" not in hooked  # one tensor input: cannot mix, never pays
    swapped = _swapped_attributes()
    assert swapped["save"] is not swapped_before["save"] and len(swapped["register"]) >= len(hooked) - len(before)
    mf.patch()  # twice: harmless, logged
    assert "already patched" in caplog.text
    assert _dtensor_rules() == hooked
    assert _swapped_attributes() == swapped  # nothing swapped twice
    mf.unpatch()
    mf.unpatch()
    assert not mf.is_patched()
    assert _dtensor_rules() == before
    assert _swapped_attributes() == swapped_before  # every recorded swap undone, exactly once


def _swapped_attributes() -> dict:
    """What the patch swaps in torch besides the rules: the holders' ``register``, ``AOTAutogradCache.save``."""
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    from torch._library import simple_registry

    holders = {qualname: vars(entry.torch_dispatch_rules).get("register")
               for qualname, entry in simple_registry.singleton._data.items()}
    return {"register": {k: v for k, v in holders.items() if v is not None}, "save": vars(AOTAutogradCache)["save"]}


def test_patched_nests_and_restores_outer_state_even_on_error():
    with mf.patched(default="local"):
        assert mf.current_options().default == "local"
        with pytest.raises(ZeroDivisionError):
            with mf.patched(default="error"):
                assert mf.current_options().default == "error"
                1 / 0
        assert mf.is_patched() and mf.current_options().default == "local"
        with mf.patched():
            assert mf.current_options().default == "local"  # options not given are inherited
        assert mf.is_patched()
    assert not mf.is_patched()
    assert mf.current_options().default == "replicate"


def test_patched_inside_patch_leaves_patch_in_place():
    mf.patch()
    with mf.patched(default="local"):
        pass
    assert mf.is_patched() and mf.current_options().default == "replicate"


def test_inner_unpatch_is_undone_by_outer_block_exit():
    with mf.patched(default="local"):
        mf.unpatch()
        assert not mf.is_patched()
    # the block was entered unpatched, so it leaves torch unpatched
    assert not mf.is_patched()
    mf.patch()
    with mf.patched():
        mf.unpatch()
    assert mf.is_patched()  # the outer state (patched) is restored


def test_unknown_or_bad_options_raise_and_leave_nothing_patched():
    before = _dtensor_rules()
    with pytest.raises(TypeError, match="unexpected keyword argument 'defualt'"):
        mf.patch(defualt="local")
    with pytest.raises(TypeError, match="unexpected keyword argument 'defualt'"):
        with mf.patched(defualt="local"):
            pass  # pragma: no cover - never entered
    with pytest.raises(ValueError, match="unknown rule"):
        mf.patch(default="replicated")
    with pytest.raises(TypeError, match="rule must be"):
        mf.patch(default=42)
    with pytest.raises(TypeError, match="plain_grads"):
        mf.patch(plain_grads="yes")
    with pytest.raises(TypeError, match="direct"):
        mf.patch(direct=1)
    assert not mf.is_patched()
    assert _dtensor_rules() == before


def test_register_rule_accepts_every_op_spelling_and_newest_wins():
    mm = torch.ops.aten.mm.default
    assert registry.lookup(mm) is None
    h1 = register_rule(mm, "local")
    h2 = register_rule("aten::mm.default", "error")
    h3 = register_rule("aten.mm.default", "replicate")
    h4 = register_rule(torch.ops.aten.mm, Decision("local"))
    h5 = register_rule("aten::mm", "error")
    try:
        assert registry.lookup(mm) == "error"
        h5.remove()
        assert registry.lookup(mm) == Decision("local")
        h4.remove()
        assert registry.lookup(mm) == "replicate"
        h2.remove()  # removing one in the middle leaves the newest in force
        assert registry.lookup(mm) == "replicate"
        h3.remove()
        assert registry.lookup(mm) == "local"
        h3.remove()  # twice: harmless
        assert registry.lookup(mm) == "local"
    finally:
        for handle in (h1, h2, h3, h4, h5):
            handle.remove()
    assert registry.lookup(mm) is None
    assert not h1.active


def test_packet_registration_covers_every_overload():
    with register_rule(torch.ops.aten.add, "local"):
        assert registry.lookup(torch.ops.aten.add.Tensor) == "local"
        assert registry.lookup(torch.ops.aten.add.Scalar) == "local"
    assert registry.lookup(torch.ops.aten.add.Tensor) is None


@pytest.mark.parametrize(
    "op, error",
    [
        ("aten::no_such_op", ValueError),
        ("aten::mm.no_such_overload", ValueError),
        ("nonsense", ValueError),
        (3, TypeError),
        (torch.mm, TypeError),
    ],
)
def test_register_rule_rejects_ops_that_do_not_exist(op, error):
    with pytest.raises(error):
        register_rule(op, "replicate")


@pytest.mark.parametrize("rule", ["Replicate", "", 1.5, None, ["local"]])
def test_register_rule_rejects_bad_rules(rule):
    with pytest.raises((TypeError, ValueError)):
        register_rule("aten::mm.default", rule)
    assert registry.lookup(torch.ops.aten.mm.default) is None


def test_rules_survive_unpatch_and_apply_after_repatch():
    handle = register_rule("aten::mul.Tensor", "local")
    try:
        mf.patch()
        mf.unpatch()
        assert registry.lookup(torch.ops.aten.mul.Tensor) == "local"
    finally:
        handle.remove()


def test_unpatch_leaves_a_rule_someone_else_put_on_top():
    from torch._library import simple_registry

    holder = simple_registry.singleton.find("aten::mul.Tensor").torch_dispatch_rules
    mf.patch()
    assert holder.find(DTensor) is not None
    # another library replaces our rule for one op
    holder._data[DTensor] = lambda *a: NotImplemented
    theirs = holder._data[DTensor]
    try:
        mf.unpatch()
        assert holder.find(DTensor) is theirs
    finally:
        holder._data.pop(DTensor, None)


def test_a_foreign_rule_present_before_patch_is_left_alone():
    lib = torch.library.Library("aten", "FRAGMENT")
    theirs = lambda cls, func, types, args, kwargs: NotImplemented  # noqa: E731
    torch.library.register_torch_dispatch("aten::sub.Tensor", DTensor, theirs, lib=lib)
    try:
        mf.patch()
        assert _dtensor_rules()["aten::sub.Tensor"] is theirs
        mf.unpatch()
        assert _dtensor_rules()["aten::sub.Tensor"] is theirs
    finally:
        lib._destroy()
    assert "aten::sub.Tensor" not in _dtensor_rules()


def test_a_library_registering_after_patch_takes_the_op_and_keeps_it_after_unpatch():
    lib = torch.library.Library("aten", "FRAGMENT")
    theirs = lambda cls, func, types, args, kwargs: NotImplemented  # noqa: E731
    mf.patch()
    ours = _dtensor_rules()["aten::dist"]
    try:
        torch.library.register_torch_dispatch("aten::dist", DTensor, theirs, lib=lib)  # used to raise
        assert _dtensor_rules()["aten::dist"] is theirs
        assert mf._lifecycle.patching.interceptor().owns("aten::dist") is None  # we stepped aside
        mf.unpatch()
        assert _dtensor_rules()["aten::dist"] is theirs
        from torch._library import simple_registry

        holder = simple_registry.singleton.find("aten::dist").torch_dispatch_rules
        assert "register" not in vars(holder)  # torch's own method again
    finally:
        lib._destroy()
    assert "aten::dist" not in _dtensor_rules()
    assert ours is not None


def test_a_library_rule_destroyed_while_patched_gives_the_op_back():
    lib = torch.library.Library("aten", "FRAGMENT")
    theirs = lambda cls, func, types, args, kwargs: NotImplemented  # noqa: E731
    mf.patch()
    try:
        torch.library.register_torch_dispatch("aten::dist", DTensor, theirs, lib=lib)
        other = torch.library.Library("aten", "FRAGMENT")
        # a second registration is refused, as torch refuses it
        with pytest.raises(RuntimeError, match="already has"):
            torch.library.register_torch_dispatch("aten::dist", DTensor, theirs, lib=other)
        other._destroy()
    finally:
        lib._destroy()
    assert mf._lifecycle.patching.interceptor().owns("aten::dist") is True
    mf.unpatch()
    assert "aten::dist" not in _dtensor_rules()


def test_registrations_for_other_classes_pass_through_while_patched():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    lib = torch.library.Library("aten", "FRAGMENT")
    mf.patch()
    try:
        torch.library.register_torch_dispatch("aten::dist", Mode,
                                              lambda mode, func, types, args, kwargs: torch.tensor(7.0), lib=lib)
        with Mode():
            assert torch.dist(torch.ones(2), torch.zeros(2)) == 7
        assert mf._lifecycle.patching.interceptor().owns("aten::dist") is True
    finally:
        lib._destroy()


def test_patching_leaves_compile_cache_key_tag_alone():
    config = torch.compiler.config
    before = config.cache_key_tag
    mf.patch()
    with register_rule("aten::mul.Tensor", "local"):
        assert config.cache_key_tag == before
    mf.unpatch()
    assert config.cache_key_tag == before


def test_aot_autograd_cache_save_is_wrapped_only_while_patched():
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache

    original = vars(AOTAutogradCache)["save"]
    mf.patch()
    assert vars(AOTAutogradCache)["save"] is not original
    mf.unpatch()
    assert vars(AOTAutogradCache)["save"] is original


def test_sharding_cache_cleared_on_unpatch(monkeypatch):
    calls = []
    real = torch._C._clear_DTensor_sharding_propagator_cache
    monkeypatch.setattr(torch._C, "_clear_DTensor_sharding_propagator_cache", lambda: calls.append(1) or real())
    mf.patch()
    mf.unpatch()
    assert calls


def test_patch_state_is_thread_safe_under_concurrent_toggling():
    before = _dtensor_rules()
    errors = []

    def toggle(n):
        try:
            for _ in range(n):
                mf.patch()
                mf.unpatch()
        except BaseException as exc:  # pragma: no cover  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=toggle, args=(15,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    # Whatever the interleaving, every patch was undone and nothing leaked.
    assert not mf.is_patched()
    assert _dtensor_rules() == before


def test_import_does_not_import_torch_distributed():
    import subprocess
    import sys

    code = (
        "import sys; import keras_dtensor_mixfix; "
        "print('torch.distributed.tensor' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_an_op_defined_after_another_was_destroyed_is_hooked():
    # The candidate-op cache was keyed by the number of op names, which repeats when one custom op
    # is destroyed and another defined: patch() then silently skipped the new op.
    def define(name):
        lib = torch.library.Library("mixfix_unit", "FRAGMENT")
        lib.define(f"{name}(Tensor a, Tensor b) -> Tensor")
        return lib

    first = define("first_op")
    mf.patch()
    assert mf._lifecycle.patching.interceptor().owns("mixfix_unit::first_op") is True
    mf.unpatch()
    first._destroy()
    second = define("second_op")
    try:
        mf.patch()
        assert mf._lifecycle.patching.interceptor().owns("mixfix_unit::second_op") is True
    finally:
        mf.unpatch()
        second._destroy()


def test_every_exception_users_see_is_exported_and_submodules_are_attributes_without_importing_torch():
    import subprocess
    import sys

    code = (
        "import sys, keras_dtensor_mixfix as mf\n"
        "names = dir(mf)\n"
        "print('helpers', sorted({'Any', 'importlib', 'TYPE_CHECKING', '_importlib', '_typing', '_EXPORTS'}"
        " & set(names)))\n"
        "print('public', all(n in names for n in mf.__all__),"
        " sorted({'testing', 'keras_integration', 'hookspecs'} & set(names)))\n"
        "print('exceptions', mf.testing.RankError.__module__, mf.ReplicationCheckError.__mro__[1].__name__,"
        " mf.ReplicationCheckWarning.__mro__[1].__name__)\n"
        "print('submodules', mf.testing.run_on_ranks.__module__, mf.keras_integration.install.__module__,"
        " mf.hookspecs.hookimpl is mf.hookimpl)\n"
        "print('torch', 'torch' in sys.modules, 'keras' in sys.modules)\n"
        "ns = {}; exec('from keras_dtensor_mixfix import *', ns)\n"
        "print('star', sorted({'MixfixError', 'ReplicationCheckError', 'ReplicationCheckWarning'} - set(ns)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "helpers []" in out
    assert "public True ['hookspecs', 'keras_integration', 'testing']" in out
    assert "exceptions keras_dtensor_mixfix.testing MixedOperandError UserWarning" in out
    assert "submodules keras_dtensor_mixfix.testing keras_dtensor_mixfix.keras_integration True" in out
    assert "torch False False" in out
    assert "star []" in out
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        mf.nope


def test_state_listeners_hear_each_change_once_in_the_changing_thread():
    from keras_dtensor_mixfix._lifecycle.patching import add_state_listener, remove_state_listener

    heard = []

    def listener(patched):
        heard.append((patched, mf.is_patched(), threading.current_thread().name))

    add_state_listener(listener)
    add_state_listener(listener)  # once only
    try:
        mf.patch()
        mf.patch(default="local")  # no change of state: not heard
        mf.unpatch()
        mf.unpatch()
        with mf.patched():
            pass
    finally:
        remove_state_listener(listener)
    mf.patch()
    mf.unpatch()
    me = threading.current_thread().name
    assert heard == [(True, True, me), (False, False, me), (True, True, me), (False, False, me)]


def test_aot_autograd_cache_save_left_in_place_when_replaced_on_top(caplog):
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache

    original = vars(AOTAutogradCache)["save"]
    mf.patch()
    theirs = staticmethod(lambda key, entry, remote: None)
    AOTAutogradCache.save = theirs
    try:
        caplog.set_level(logging.WARNING, logger="keras_dtensor_mixfix")
        mf.unpatch()
        assert vars(AOTAutogradCache)["save"] is theirs
        assert "AOTAutogradCache.save was replaced by someone else; left as it is" in caplog.text
    finally:
        AOTAutogradCache.save = original
    mf.patch()  # the guard installs again: its record was spent
    assert vars(AOTAutogradCache)["save"] is not original
    mf.unpatch()
    assert vars(AOTAutogradCache)["save"] is original


def test_aot_autograd_cache_skips_only_compilations_that_promoted(monkeypatch):
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache

    from keras_dtensor_mixfix._engine.context import traced_promotions
    from keras_dtensor_mixfix._lifecycle import compile_cache
    from keras_dtensor_mixfix._torch import api

    saved = []
    monkeypatch.setattr(AOTAutogradCache, "save", staticmethod(lambda key, entry, remote: saved.append(key)))
    compiling = ["first"]
    monkeypatch.setattr(api, "current_compile_id", lambda: compiling[0])
    monkeypatch.setattr(compile_cache, "current_compile_id", lambda: compiling[0])
    mf.patch()
    traced_promotions.note()  # the compilation "first" promoted
    AOTAutogradCache.save("first graph", None, False)
    compiling[0] = "second"
    AOTAutogradCache.save("second graph", None, False)
    assert saved == ["second graph"]
    mf.unpatch()
    assert not traced_promotions.traced  # unpatch() forgot it (and reset dynamo)


def test_patch_state_has_one_holder_the_engine_reads():
    from keras_dtensor_mixfix._engine import context
    from keras_dtensor_mixfix._lifecycle import patching

    assert context.state() == context.PatchState()
    mf.patch(default="local", allow_newer_torch=False)
    state = context.state()
    assert state.active and context.is_active() and mf.is_patched()
    assert state.installed is patching.interceptor() is not None
    assert context.options() is state.options is mf.current_options()
    assert state.options.default == "local" and state.allow_newer_torch is False
    mf.patch(direct=False)  # while patched: only the options change
    assert context.state().installed is state.installed and context.options().direct is False
    mf.unpatch()
    assert context.state() == context.PatchState()
    assert not hasattr(patching, "_options") and not hasattr(patching, "_interceptor")


def test_patch_and_patched_take_each_option_as_a_typed_keyword():
    import dataclasses
    import inspect

    from keras_dtensor_mixfix import Options

    fields = {field.name: field for field in dataclasses.fields(Options)}
    for function in (mf.patch, mf.patched):
        parameters = inspect.signature(function).parameters
        assert set(parameters) == set(fields) | {"allow_newer_torch"}, function
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters.values())
        for name in fields:
            assert parameters[name].annotation != inspect.Parameter.empty
            assert name in function.__doc__, (function, name)


@pytest.mark.parametrize("name, value", [("default", "local"), ("default", "error"), ("plain_grads", False),
                                         ("check", "warn"), ("direct", False)])
def test_each_option_reaches_current_options(name, value):
    defaults = mf.Options()
    mf.patch(**{name: value})
    assert getattr(mf.current_options(), name) == value
    others = {n: v for n, v in mf.current_options().as_dict().items() if n != name}
    assert others == {n: v for n, v in defaults.as_dict().items() if n != name}
    mf.unpatch()
    with mf.patched(**{name: value}):
        assert getattr(mf.current_options(), name) == value
    assert mf.current_options() == defaults


def test_a_callable_default_rule_reaches_current_options():
    def rule(call):
        return "local"

    with mf.patched(default=rule):
        assert mf.current_options().default is rule


def test_options_not_given_keep_the_environment_value(monkeypatch):
    monkeypatch.setenv("KERAS_DTENSOR_MIXFIX_DEFAULT", "local")
    mf.patch(direct=False)
    assert mf.current_options().default == "local" and mf.current_options().direct is False
    mf.unpatch()
    mf.patch(default="error")  # given: wins over the environment
    assert mf.current_options().default == "error"
    mf.unpatch()
    assert mf.current_options().default == "local"  # not patched: defaults with the environment

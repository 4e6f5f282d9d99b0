"""Rules for operators that do not exist yet: held, then applied once a custom-op library defines them."""

from __future__ import annotations

import importlib
import sys
import textwrap
import uuid

import pytest
import torch

import keras_dtensor_mixfix as mf
from keras_dtensor_mixfix._rules.registry import registry


def _custom_op_module(directory, namespace: str, module: str) -> None:
    """A custom-op library as users have them: a module that defines its ops when imported."""
    (directory / f"{module}.py").write_text(textwrap.dedent(
        f"""
        import torch

        @torch.library.custom_op("{namespace}::scale_add", mutates_args=())
        def scale_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x + 2 * y

        @scale_add.register_fake
        def _(x, y):
            return torch.empty_like(x)

        try:
            from torch.distributed.tensor import Replicate, Shard
            from torch.distributed.tensor.experimental import register_sharding

            @register_sharding(torch.ops.{namespace}.scale_add.default)
            def _(x, y):  # elementwise: both sharded alike, or both whole
                return [([Shard(0)], [Shard(0), Shard(0)]), ([Replicate()], [Replicate(), Replicate()])]
        except ImportError:  # no DTensor in this build of torch
            pass
        """
    ))


def _fresh_names():
    tag = uuid.uuid4().hex[:8]
    return f"mixfix_test_{tag}", f"mixfix_custom_ops_{tag}"


# --------------------------------------------------------------------------- registry (single process)


def test_a_typo_in_a_loaded_namespace_still_raises_at_once():
    with pytest.raises(ValueError, match="operator 'aten::not_an_op' does not exist"):
        mf.register_rule("aten::not_an_op", "replicate")
    with pytest.raises(ValueError, match=r"did you mean 'aten::mm'"):
        mf.register_rule("aten::mmm", "replicate")
    with pytest.raises(ValueError, match="has no overload"):
        mf.register_rule("aten::mm.nope", "replicate")
    assert not [entry for entry in registry.entries() if entry.pending]


def test_a_rule_for_an_op_not_defined_yet_is_held_and_applies_once_its_library_is_imported(tmp_path, monkeypatch):
    namespace, module = _fresh_names()
    _custom_op_module(tmp_path, namespace, module)
    monkeypatch.syspath_prepend(str(tmp_path))
    told = []
    registry.add_listener(told.append)
    try:
        with mf.register_rule(f"{namespace}::scale_add", "local") as handle, \
                mf.register_rule(f"{namespace}.scale_add.default", "error") as overload_handle:
            assert handle.pending and overload_handle.pending and "pending" in repr(handle)
            assert told == [None, None]  # nothing to hook yet
            assert registry.pending_qualnames() == [f"{namespace}::scale_add"]
            assert registry.resolve_pending() == []  # still not defined
            importlib.import_module(module)
            op = getattr(torch.ops, namespace).scale_add
            assert registry.lookup(op.default) == "error"  # the newest registration wins, as for any op
            assert [handle.pending, overload_handle.pending] == [True, False]
            overload_handle.remove()
            assert registry.lookup(op.default) == "local" and not handle.pending
            # A lookup runs inside the op: the listeners are told at the next check, not from there.
            assert told == [None, None, None]
            assert registry.resolve_pending() == [handle] and told[-1] is op
            assert registry.resolve_pending() == []
        assert registry.lookup(op.default) is None
    finally:
        registry._listeners.remove(told.append)
        sys.modules.pop(module, None)


def test_the_listeners_are_told_the_op_when_a_pending_rule_resolves(tmp_path, monkeypatch):
    namespace, module = _fresh_names()
    _custom_op_module(tmp_path, namespace, module)
    monkeypatch.syspath_prepend(str(tmp_path))
    told = []
    registry.add_listener(told.append)
    try:
        with mf.register_rule(f"{namespace}::scale_add", "local") as handle:
            importlib.import_module(module)
            op = getattr(torch.ops, namespace).scale_add
            with mf.register_rule("aten::mul.Tensor", "replicate"):  # any registration checks the pending ones
                assert not handle.pending
                assert told[-2:] == [op, torch.ops.aten.mul.Tensor]  # the resolved op first: it gets hooked
            assert registry.resolve_pending() == [] and registry.pending_qualnames() == []
        # Once its library is loaded, the namespace's names are checked like aten's.
        with pytest.raises(ValueError, match=f"did you mean '{namespace}::scale_add'"):
            mf.register_rule(f"{namespace}::scale_ad", "local")
    finally:
        registry._listeners.remove(told.append)
        sys.modules.pop(module, None)


def test_resolve_pending_reports_the_rules_whose_op_appeared(tmp_path, monkeypatch):
    namespace, module = _fresh_names()
    _custom_op_module(tmp_path, namespace, module)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with mf.register_rule(f"{namespace}::scale_add", "local") as handle, \
                mf.register_rule("never_imported_mixfix_lib::op", "local") as never:
            importlib.import_module(module)
            assert registry.resolve_pending() == [handle]
            assert never.pending and registry.pending_qualnames() == ["never_imported_mixfix_lib::op"]
        assert registry.pending_qualnames() == []  # removing a pending rule forgets it
    finally:
        sys.modules.pop(module, None)


# ---------------------------------------------------------------------- a pack, patch(), then the library (2 ranks)


def pack_rule_for_a_library_imported_after_patch(directory, namespace, module):
    """The rule-pack example of docs/rules.md end to end: the pack registers a rule for a custom op at the
    first patch(), before the library defining the op is imported; the mixed call then follows it."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from keras_dtensor_mixfix._rules import packs
    from keras_dtensor_mixfix.testing import mesh

    sys.path.insert(0, directory)  # holds the pack's distribution (entry point) and the library
    packs._reset_for_tests()
    try:
        mf.patch()  # loads the packs: the op does not exist yet
        record = next(r for r in packs.pack_records() if r.name == "late_ops")
        state = [record.status, [h.pending for h in record.rules]]
        importlib.import_module(module)  # the custom-op library, after patch()
        x = distribute_tensor(torch.ones(4, 3), mesh(), [Shard(0)])
        piece = torch.full((2, 3), float(dist.get_rank()))  # this rank's rows: the pack says "local"
        try:
            result = getattr(torch.ops, namespace).scale_add(x, piece)
            state.append((type(result).__name__, tuple(result.placements), result.full_tensor()[:, 0].tolist()))
        except Exception as exc:  # noqa: BLE001 - the type and first line are the result
            state.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
        return state
    finally:
        mf.unpatch()
        packs._reset_for_tests()
        sys.path.remove(directory)


def _install_pack(site, namespace: str) -> None:
    (site / "late_ops_pack.py").write_text(textwrap.dedent(
        f"""
        from keras_dtensor_mixfix import hookimpl

        @hookimpl
        def register_rules(register):
            register("{namespace}::scale_add", "local")
        """
    ))
    info = site / "late_ops_pack-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: late-ops-pack\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[keras_dtensor_mixfix]\nlate_ops = late_ops_pack\n")


def test_a_pack_rule_applies_to_a_custom_op_library_imported_after_patch(tmp_path):
    from keras_dtensor_mixfix.testing import run_on_ranks

    namespace, module = _fresh_names()
    _custom_op_module(tmp_path, namespace, module)
    _install_pack(tmp_path, namespace)
    results = run_on_ranks(pack_rule_for_a_library_imported_after_patch, str(tmp_path), namespace, module,
                           world_size=2)
    for state in results:
        assert state[:2] == ["loaded", [True]], state  # the pack loaded; its rule waits for the op
        # x + 2 * piece, rank 0's rows from rank 0's piece (0) and rank 1's from rank 1's (1)
        assert state[2] == ("DTensor", (Shard0(),), [1.0, 1.0, 3.0, 3.0]), state


def Shard0():  # noqa: N802 - reads like the placement it builds
    from torch.distributed.tensor import Shard

    return Shard(0)


def test_doctor_lists_a_pending_rule_as_pending():
    """doctor's rules section (the whole command runs in tests/lifecycle/test_activation.py)."""
    import io

    from keras_dtensor_mixfix._cli import _doctor_rules

    out = io.StringIO()
    with mf.register_rule("never_imported_mixfix_lib::fwd", "replicate"):
        _doctor_rules(out)
    line = next(line for line in out.getvalue().splitlines() if "never_imported_mixfix_lib::fwd" in line)
    assert "'replicate'" in line and "from user  (pending: no such op is defined yet; applies once one is)" in line

"""No silent wrong results: check mode catches per-rank data; patching survives concurrency."""

from __future__ import annotations

import os

import pytest
import torch

from _ranks import close, mesh_for, placements_for, shard
from keras_dtensor_mixfix.testing import run_on_ranks


def per_rank_data_is_caught(world_size):
    import warnings

    import torch.distributed as dist

    import keras_dtensor_mixfix as mf
    from keras_dtensor_mixfix._engine.check import ReplicationCheckError, ReplicationCheckWarning

    m = mesh_for(world_size)
    torch.manual_seed(0)
    weight = shard(torch.randn(8, 4), m, placements_for(m, 0))
    same = torch.randn(8, 4)  # identical on every rank (same seed)
    torch.manual_seed(100 + dist.get_rank())
    own = torch.randn(8, 4)  # each rank's own batch: NOT the same whole tensor everywhere
    caught = []
    with mf.patched(check="raise"):
        close(weight * same, weight.full_tensor() * same, "identical operand passes the check")
        cases = [
            lambda: weight * own,
            lambda: weight + own,
            lambda: own @ shard(torch.randn(4, 3), m, placements_for(m, 1)),
            lambda: torch.cat([weight, own]),
            lambda: torch._foreach_add_([weight], [own]),
        ]
        for case in cases:
            try:
                case()
                caught.append("missed")
            except ReplicationCheckError as exc:
                caught.append(str(exc))
    with mf.patched(check="warn"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            weight * own
        warned = [str(w.message) for w in seen if issubclass(w.category, ReplicationCheckWarning)]
    with mf.patched(check="off"):
        weight * own  # not checked: the documented default
    return caught, warned


def test_check_mode_catches_a_plain_operand_that_differs_between_ranks(world_size):
    caught, warned = run_on_ranks(per_rank_data_is_caught, world_size, world_size=world_size)[0]
    assert "missed" not in caught, caught
    assert "aten::mul.Tensor" in caught[0] and "args[1]" in caught[0] and "differs between ranks" in caught[0]
    assert "ranks [0]" in caught[0] or "ranks [0," in caught[0]
    assert "aten::add.Tensor" in caught[1] and "aten::mm.default" in caught[2]
    assert "aten::cat.default" in caught[3] and "aten::_foreach_add_.List" in caught[4]
    assert len(warned) == 1 and "differs between ranks" in warned[0]


def warn_mode_output(world_size):
    import contextlib
    import io
    import warnings

    import torch.distributed as dist

    import keras_dtensor_mixfix as mf

    m = mesh_for(world_size)
    weight = shard(torch.ones(8, 4), m, placements_for(m, 0))
    own = torch.full((8, 4), float(dist.get_rank()))  # differs between ranks
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed), warnings.catch_warnings():
        warnings.simplefilter("default")  # as in a plain `python script.py`
        with mf.patched(check="warn"):
            weight * own
    return printed.getvalue()


def test_check_mode_warn_prints_each_mismatch_once_per_rank():
    printed = run_on_ranks(warn_mode_output, 2, world_size=2)
    for text in printed:
        assert text.count("keras_dtensor_mixfix check: aten::mul.Tensor") == 1, text
        assert "ReplicationCheckWarning" in text


def local_shapes_are_checked(world_size):
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    import keras_dtensor_mixfix as mf
    from keras_dtensor_mixfix._engine.check import ReplicationCheckError

    m = mesh_for(world_size)
    weight = shard(torch.ones(8, 4), m, (Shard(0),) * m.ndim)
    rows = weight.to_local().shape[0] - (1 if dist.get_rank() == world_size - 1 else 0)  # the last rank is short
    piece = torch.ones(rows, 4)

    def batch_rows(call):
        return mf.Decision("local", placements=[Shard(0)] * call.mesh.ndim, shape=(8, 4))

    with mf.register_rule("aten::add.Tensor", batch_rows), mf.patched(check="raise"):
        try:
            weight + piece
            return "missed"
        except ReplicationCheckError as exc:
            return str(exc)


def test_check_mode_catches_a_local_operand_of_the_wrong_shape(world_size):
    message = run_on_ranks(local_shapes_are_checked, world_size, world_size=world_size)[0]
    assert "is not the piece of a (8, 4) tensor" in message and f"rank {world_size - 1} has" in message, message


# --------------------------------------------------------------------------- concurrency


def toggle_while_ops_run(world_size, cycles):
    import threading

    from torch._library import simple_registry
    from torch.distributed.tensor import DTensor

    import keras_dtensor_mixfix as mf

    def our_rules():
        return {q for q, e in simple_registry.singleton._data.items()
                if e.torch_dispatch_rules.find(DTensor) is not None}

    while mf.is_patched():  # start from torch as it is
        mf.unpatch()
    before = our_rules()
    m = mesh_for(world_size)
    torch.manual_seed(0)
    a, b, plain = torch.randn(8, 4), torch.randn(8, 4), torch.randn(8, 4)
    da, db = shard(a, m, placements_for(m, 0)), shard(b, m, placements_for(m, 0))
    # references computed up front: the threads must not run collectives (ranks' threads race)
    expected_pure = da.to_local() * db.to_local()
    expected_mixed = (da * shard(plain, m, placements_for(m, 0))).to_local()
    stop = threading.Event()
    problems = []
    counts = {"pure": 0, "mixed": 0, "refused": 0}

    def work():
        while not stop.is_set():
            try:
                if not torch.equal((da * db).to_local(), expected_pure):
                    problems.append("pure op gave a wrong value")
                counts["pure"] += 1
                try:
                    out = da * plain
                except RuntimeError as exc:  # unpatched at that instant: torch's own refusal is fine
                    if "got mixed torch.Tensor and DTensor" not in str(exc):
                        problems.append(f"unexpected error: {exc}")
                    counts["refused"] += 1
                    continue
                if not torch.equal(out.to_local(), expected_mixed):
                    problems.append("mixed op gave a wrong value")
                counts["mixed"] += 1
            except BaseException as exc:  # noqa: BLE001 - reported below
                problems.append(repr(exc))
                return

    threads = [threading.Thread(target=work) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(cycles):
            mf.patch()
            mf.unpatch()
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a worker thread is stuck"
    assert not problems, problems[:5]
    assert not mf.is_patched() and our_rules() == before, "registrations leaked"
    with pytest.raises(RuntimeError, match="got mixed torch.Tensor and DTensor"):
        da * plain  # torch's own behaviour is back
    return counts


PATCH_CYCLES = int(os.environ.get("MIXFIX_TEST_PATCH_CYCLES", "250"))
"""patch()/unpatch() cycles raced against the threads' ops: 250 in CI (~35 s on 2 loaded cores; every cycle crosses
both threads' ops many times over: the counts below show it); MIXFIX_TEST_PATCH_CYCLES=5000 for a longer soak."""


def test_patch_cycles_while_other_threads_run_dtensor_ops():
    counts = run_on_ranks(toggle_while_ops_run, 2, PATCH_CYCLES, world_size=2, timeout=900)[0]
    assert counts["pure"] > 0 and counts["mixed"] + counts["refused"] > 0, counts


# --------------------------------------------------------------------------- bad input leaves nothing half-patched


def bad_inputs(world_size):
    import keras_dtensor_mixfix as mf

    m = mesh_for(world_size)
    weight = shard(torch.randn(8, 4), m, placements_for(m, 0))
    results = {}

    def rule_with_bad_answer(call):
        return 42

    with mf.register_rule("aten::mul.Tensor", rule_with_bad_answer), mf.patched():
        try:
            weight * torch.randn(8, 4)
        except mf.MixedOperandError as exc:  # a RuntimeError: Python keeps its message in operators
            results["bad_answer"] = str(exc)
    with mf.register_rule("aten::mul.Tensor", lambda call: ["local", "local"]), mf.patched():
        try:
            weight * torch.randn(8, 4)
        except RuntimeError as exc:
            results["wrong_count"] = str(exc)
    # the patch still works after those errors, and the registrations are gone
    with mf.patched():
        close(weight * torch.ones(8, 4), weight.full_tensor(), "patch usable after bad rules")
    return results


@pytest.mark.parametrize("world_size", [2])
def test_bad_rule_answers_give_clear_errors(world_size):
    results = run_on_ranks(bad_inputs, world_size, world_size=world_size)[0]
    assert "rule for aten::mul.Tensor" in results["bad_answer"] and "42" in results["bad_answer"]
    assert "answered 2 decisions for 1 plain operands" in results["wrong_count"]

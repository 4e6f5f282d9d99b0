"""keras_dtensor_mixfix.testing: results, errors, time-outs and worker restarts; MixedCall.peer_for; built-in
refusals."""

from __future__ import annotations

import os
import time

import pytest
import torch

from _ranks import mesh_for, placements_for, shard
from keras_dtensor_mixfix.testing import RankError, run_on_ranks

_calls_in_this_worker = []


def count_calls():
    _calls_in_this_worker.append(1)
    return os.getpid(), len(_calls_in_this_worker)


def fail_on_rank(failing):
    from keras_dtensor_mixfix.testing import rank

    if rank() in failing:
        raise ValueError(f"boom on rank {rank()}")
    return rank()


def sleep_on_rank_one(seconds):
    from keras_dtensor_mixfix.testing import rank

    if rank() == 1:
        time.sleep(seconds)
    return rank()


def test_results_come_back_rank_zero_first_and_workers_are_reused():
    first = run_on_ranks(count_calls, world_size=2)
    second = run_on_ranks(count_calls, world_size=2)
    assert [pid for pid, _ in first] == [pid for pid, _ in second]  # same worker processes
    assert [n for _, n in second] == [n + 1 for _, n in first]


def test_a_rank_that_raises_is_reported_with_its_traceback_and_workers_restart():
    before = [pid for pid, _ in run_on_ranks(count_calls, world_size=2)]
    with pytest.raises(RankError) as info:
        run_on_ranks(fail_on_rank, [1], world_size=2)
    error = info.value
    assert (error.rank, error.exc_type, error.message) == (1, "ValueError", "boom on rank 1")
    assert "fail_on_rank" in error.remote_traceback and set(error.failures) == {1}
    after = run_on_ranks(count_calls, world_size=2)
    assert [pid for pid, _ in after] != before and [n for _, n in after] == [1, 1]  # fresh workers


def sum_of_ranks_over_a_mesh():
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from keras_dtensor_mixfix.testing import mesh, rank

    total = torch.tensor([float(rank())])
    dist.all_reduce(total)
    whole = distribute_tensor(torch.arange(4.0), mesh(), [Shard(0)]).redistribute(mesh(), [Replicate()]).to_local()
    return os.getpid(), total.item(), whole.tolist()


def test_the_repros_helper_keeps_the_workers_on_a_new_process_group_after_a_failure():
    from _rejoining_ranks import run_on_ranks_rejoining

    before = run_on_ranks(sum_of_ranks_over_a_mesh, world_size=2)
    with pytest.raises(RankError) as info:
        run_on_ranks_rejoining(fail_on_rank, [0, 1], world_size=2)
    assert set(info.value.failures) == {0, 1}
    after = run_on_ranks(sum_of_ranks_over_a_mesh, world_size=2)
    assert [pid for pid, _, _ in after] == [pid for pid, _, _ in before]  # the same workers
    assert [(total, whole) for _, total, whole in after] == [(1.0, [0.0, 1.0, 2.0, 3.0])] * 2  # a working group
    with pytest.raises(RankError):  # run_on_ranks itself still restarts them
        run_on_ranks(fail_on_rank, [1], world_size=2)
    assert [pid for pid, _, _ in run_on_ranks(sum_of_ranks_over_a_mesh, world_size=2)] != [pid for pid, _, _ in after]


def tensor_that_requires_grad():
    import torch

    return torch.ones(2, requires_grad=True) * 2


def test_a_result_that_cannot_go_back_is_an_error_at_once_not_a_timeout():
    assert run_on_ranks(fail_on_rank, [], world_size=2) == [0, 1]  # started workers: the clock times the call only
    started = time.monotonic()
    with pytest.raises(RankError, match=r"returned cannot be sent back .* \.detach\(\) it") as info:
        run_on_ranks(tensor_that_requires_grad, world_size=2, timeout=60)
    assert info.value.exc_type == "ArgumentTypeError" and time.monotonic() - started < 30
    assert run_on_ranks(tensor_that_requires_grad_detached, world_size=2)[0].tolist() == [2.0, 2.0]  # the advice


def tensor_that_requires_grad_detached():
    return tensor_that_requires_grad().detach()


def test_the_lowest_failing_rank_is_reported_and_the_others_listed():
    with pytest.raises(RankError, match=r"rank 0 raised ValueError: boom on rank 0 \(ranks \[1\] failed too\)") as info:
        run_on_ranks(fail_on_rank, [0, 1], world_size=2)
    assert set(info.value.failures) == {0, 1}


def test_a_rank_that_does_not_answer_in_time_is_a_timeout_error():
    # the workers have imported this module once, so rank 0 answers within the timeout even on a loaded machine
    assert run_on_ranks(sleep_on_rank_one, 0, world_size=2) == [0, 1]
    with pytest.raises(RankError) as info:
        run_on_ranks(sleep_on_rank_one, 120, world_size=2, timeout=20)
    assert (info.value.rank, info.value.exc_type) == (1, "TimeoutError")
    assert run_on_ranks(fail_on_rank, [], world_size=2) == [0, 1]  # restarted and usable


def die_on_rank_one():
    from keras_dtensor_mixfix.testing import rank

    if rank() == 1:
        os._exit(3)  # what a crash in native code looks like from outside: no traceback, no answer
    time.sleep(60)  # rank 0 waits as if in a collective the dead rank never joins
    return rank()


def test_a_rank_that_dies_is_reported_at_once_not_after_the_timeout():
    assert run_on_ranks(fail_on_rank, [], world_size=2) == [0, 1]  # started workers: the clock times the call only
    started = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 exited with code 3 while running the function") as info:
        run_on_ranks(die_on_rank_one, world_size=2, timeout=120)
    assert info.value.exc_type == "WorkerDied" and time.monotonic() - started < 30
    assert run_on_ranks(fail_on_rank, [], world_size=2) == [0, 1]  # restarted and usable


# --------------------------------------------------------------------------- MixedCall.peer_for


def peer_choice(world_size):
    import keras_dtensor_mixfix as mf

    m = mesh_for(world_size)
    wide = shard(torch.ones(4, 6), m, placements_for(m, 1))
    tall = shard(torch.ones(6, 4), m, placements_for(m, 0))
    seen = {}

    def rule(call):
        seen[call.op._schema.name] = {
            o.label: next(i for i, peer in enumerate(call.peers) if peer is call.peer_for(o)) for o in call.plain}
        return None

    column = shard(torch.ones(6, 1), m, placements_for(m, 0))
    with mf.register_rule("aten::_foreach_add.List", rule), mf.register_rule("aten::cat", rule), \
            mf.register_rule("aten::addcmul", rule), mf.patched():
        torch._foreach_add([tall, torch.ones(4, 6)], [torch.ones(6, 4), wide])  # same row of the other list
        torch.cat([wide, torch.ones(4, 6)])                                        # same list
        torch.addcmul(torch.ones(6, 4), column, tall)                              # same shape, not the first peer
    return seen


def test_peer_for_prefers_the_same_row_then_the_same_list_then_the_same_shape():
    seen = run_on_ranks(peer_choice, 2, world_size=2)[0]
    assert seen["aten::_foreach_add"] == {"args[0][1]": 1, "args[1][0]": 0}
    assert seen["aten::cat"] == {"args[0][1]": 0}
    assert seen["aten::addcmul"] == {"args[0]": 1}


# --------------------------------------------------------------------------- the built-in pack's refusals


def builtin_refusal(world_size):
    import keras_dtensor_mixfix as mf

    m = mesh_for(world_size)
    target = shard(torch.zeros(4, 3), m, placements_for(m, 0))
    index = torch.tensor([[0, 1, 2], [1, 2, 0], [0, 0, 0], [2, 2, 2]])
    with mf.patched():
        try:
            # src larger than the index along the split dim: DTensor would split src at other rows
            target.scatter_add(1, index, torch.ones(8, 3))
        except mf.MixedOperandError as exc:
            return str(exc)
    return "no error"


def test_the_builtin_pack_refuses_a_mixed_scatter_add_on_a_sharded_tensor(world_size):
    message = run_on_ranks(builtin_refusal, world_size, world_size=world_size)[0]
    assert "scatter_add" in message and "wrong src rows" in message and "Narrow src" in message, message


def test_the_store_port_is_drawn_below_the_ports_outgoing_connections_take(monkeypatch):
    import random
    import socket

    from keras_dtensor_mixfix import _loopback_ports as loopback

    low, _ = loopback.ephemeral_ports()
    random.seed(0)  # a test seeding Python's random in every process must not make processes draw the same ports
    ports = {loopback.free_port() for _ in range(20)}
    assert all(max(1024, low - 16384) <= port < low for port in ports), (low, sorted(ports))
    assert len(ports) > 1
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((loopback.LOOPBACK, ports.pop()))  # free to listen on
    # where no range lies below the ephemeral one, a port the kernel gives
    monkeypatch.setattr(loopback, "ephemeral_ports", lambda: (1024, 60999))
    assert loopback.free_port() > 0


def store_port():
    return int(os.environ["MASTER_PORT"])


def test_ranks_whose_store_port_was_taken_before_rank_0_listened_start_again_on_another(monkeypatch):
    import socket

    from keras_dtensor_mixfix import testing

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:  # another program's listener on the port drawn
        holder.bind((testing.LOOPBACK, 0))
        holder.listen()
        taken = holder.getsockname()[1]
        draws = iter([taken])
        draw = testing.free_port
        monkeypatch.setattr(testing, "free_port", lambda: next(draws, None) or draw())
        pool = testing._start_pool(2, start_timeout=120)
        try:
            ports = pool.run(store_port, (), {}, timeout=60)
        finally:
            pool.close()
    assert ports[0] == ports[1] != taken

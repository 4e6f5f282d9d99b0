"""The self-check in a process that already has a process group: run aside, the group left alone."""

from __future__ import annotations

from keras_dtensor_mixfix.testing import run_on_ranks


def self_check_beside_a_process_group():
    import torch.distributed as dist

    from keras_dtensor_mixfix._torch.selfcheck import run_self_check

    report = run_self_check()
    return report.ok, report.where, report.summary(), dist.is_initialized(), dist.get_world_size(), dist.get_rank()


def test_a_process_with_a_process_group_runs_the_self_check_in_a_subprocess():
    results = run_on_ranks(self_check_beside_a_process_group, world_size=2)
    for rank, (ok, where, summary, initialized, world, own_rank) in enumerate(results):
        assert ok, summary
        assert where == "in a subprocess (this process already has a process group)"
        assert initialized and world == 2 and own_rank == rank

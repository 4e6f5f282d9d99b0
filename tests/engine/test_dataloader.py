"""DataLoader worker processes: batches they produce, and mixed ops they run themselves."""

from __future__ import annotations

import pytest
import torch

from _ranks import close, mesh_for, placements_for, shard
from keras_dtensor_mixfix.testing import run_on_ranks


class _Rows(torch.utils.data.Dataset):
    def __init__(self, data, scale=None):
        self.data = data
        self.scale = scale  # a replicated DTensor captured by the dataset, used inside the workers

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        row = self.data[index]
        if self.scale is None:
            return row
        # a mixed op executed inside the worker process (fork inherits the patch)
        return (self.scale * row).to_local()


def dataloader_batches(world_size):
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import Replicate

    m = mesh_for(world_size)
    torch.manual_seed(0)
    data, w = torch.randn(12, 4), torch.randn(4, 4)
    dw = shard(w, m, placements_for(m, 1), True)
    rw = w.clone().requires_grad_()
    loader = torch.utils.data.DataLoader(_Rows(data), batch_size=4, num_workers=2)
    with mf.patched():
        for batch in loader:  # plain batches from worker processes (shared-memory storage)
            (batch @ dw).pow(2).sum().backward()
            (batch @ rw).pow(2).sum().backward()
        close(dw.grad, rw.grad, "gradient accumulated over worker batches")

        scale = shard(torch.arange(4.0), m, [Replicate()] * m.ndim)
        in_workers = torch.utils.data.DataLoader(_Rows(data, scale), batch_size=4, num_workers=2,
                                                 multiprocessing_context="fork")
        rows = torch.cat(list(in_workers))
    close(rows, data * torch.arange(4.0), "mixed op computed inside fork-started workers")
    return "ok"


# 2 ranks only: what is tested here is the worker processes (their batches, the patch a forked worker inherits),
# which do not depend on the mesh; the promotion of `@` and of a replicated operand on the 2-D mesh is tested in
# test_eager.py (it cost 34 s more of CI here, each of 4 ranks starting 4 workers that import torch)
@pytest.mark.parametrize("world_size", [2])
def test_dataloader_worker_processes(world_size):
    assert run_on_ranks(dataloader_batches, world_size, world_size=world_size) == ["ok"] * world_size

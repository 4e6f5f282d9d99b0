"""torch bug: DTensor's ``cumsum`` with a negative ``dim`` does not see that the input is split along that dim, so
each rank sums its own piece: silently wrong values (``torch.cumsum(x, dim=-1)`` of an ``x`` split along its last
dim; ``dim=1`` is right).

Seen on torch 2.11.0, 2.12.1 and 2.13.0; right on 2.14.1 and 2.15.0. No
keras_dtensor_mixfix involved; under Keras the integration's ``cumsum`` counts the axis from the start.

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_cumsum_negative_dim.py`` (exits 1 while the
bug is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure on those releases.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def repro() -> None:
    """Raises AssertionError while the bug is there; returns (values checked) once it is fixed."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = torch.arange(8.0).reshape(2, 4)
    summed = torch.cumsum(distribute_tensor(x, mesh, [Shard(1)]), dim=-1)
    torch.testing.assert_close(summed.full_tensor(), torch.cumsum(x, dim=-1))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

"""torch bug: DTensor has no sharding strategy for ``aten.ne.Tensor`` (``NotImplementedError: Operator aten.ne.Tensor
does not have a sharding strategy registered``), while ``eq.Tensor`` and the other comparisons have one.

Seen on torch 2.11.0; right on 2.12.1 and later. No keras_dtensor_mixfix involved; a mixed call the package promotes
is computed as ``logical_not(eq)`` on that release (keras_hub's RWKV7 compares its token ids with 0).

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_ne_tensor_no_strategy.py`` (exits 1 while
the bug is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure on that release.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def repro() -> None:
    """Raises NotImplementedError while the bug is there; returns (values checked) once it is fixed."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ids = torch.tensor([3, 0, 5, 0])
    different = torch.ne(distribute_tensor(ids, mesh, [Shard(0)]), distribute_tensor(torch.tensor(0), mesh,
                                                                                       [Replicate()]))
    torch.testing.assert_close(different.full_tensor(), ids != 0)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

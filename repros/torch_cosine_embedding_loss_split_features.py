"""torch bug: ``F.cosine_embedding_loss`` over inputs split along the feature dim (every operand a DTensor) gives
a wrong value, silently.

The loss is a composite (products summed over the feature dim, their norms, a cosine per row); with the inputs
``Shard(1)`` the result differs from one process on every reduction ("mean": 2.040 against 1.290 in the op sweep's
sample). Split along the batch (``Shard(0)``) it is right.

Seen on torch 2.11.0, 2.12.1, 2.13.0 and 2.15.0; no keras_dtensor_mixfix involved. The package cannot
refuse it: the composite reaches DTensor as its elementwise steps, none of them mixed in a way the package sees as
this loss (docs/rules.md, "Ops DTensor gets wrong", lists it as a gap).

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_cosine_embedding_loss_split_features.py``
(exits 1 while the bug is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def repro() -> None:
    """Raises AssertionError while the bug is there; returns (values checked) once it is fixed."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    first, second, target = torch.randn(4, 6), torch.randn(4, 6), torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss = F.cosine_embedding_loss(
        distribute_tensor(first, mesh, [Shard(1)]),
        distribute_tensor(second, mesh, [Shard(1)]),
        distribute_tensor(target, mesh, [Replicate()]),
    )
    torch.testing.assert_close(loss.full_tensor(), F.cosine_embedding_loss(first, second, target))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

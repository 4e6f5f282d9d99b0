"""torch bug: DTensor has no sharding strategy for ``aten.flip``, which ``cumsum``'s backward calls, so the gradient
of a ``cumsum`` of a DTensor fails (``NotImplementedError: Operator aten.flip.default does not have a sharding
strategy registered``), with every operand a DTensor.

Seen on torch 2.11.0; right on 2.12.1 and later. No keras_dtensor_mixfix involved; under Keras the integration runs
``cumsum`` on each rank's piece on that release (keras_hub's Qwen3.5 sums its gates with ``ops.cumsum``).

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_flip_no_strategy.py`` (exits 1 while the bug
is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure on that release.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def repro() -> None:
    """Raises NotImplementedError while the bug is there; returns (values checked) once it is fixed."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    leaf = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    torch.cumsum(leaf, dim=1).sum().backward()
    reference = x.clone().requires_grad_()
    torch.cumsum(reference, dim=1).sum().backward()
    torch.testing.assert_close(leaf.grad.full_tensor(), reference.grad)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

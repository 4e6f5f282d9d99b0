"""torch limitation: ``torch.optim.SGD(..., fused=True)`` cannot step DTensor parameters: DTensor has no sharding
strategy for ``aten._fused_sgd_``, so the step raises (``NotImplementedError``), with every parameter a DTensor.
Adam and AdamW with ``fused=True`` step DTensor parameters (``_fused_adam_``/``_fused_adamw_`` have strategies).

Seen on torch 2.11.0, 2.12.1, 2.13.0, 2.14.1 and 2.15.0. No keras_dtensor_mixfix involved. With a mixed parameter
list the package promotes the plain parameters and DTensor raises the same refusal, which the package's error
names (docs/rules.md, "Devices"): use ``foreach=True`` (or the default) for SGD over DTensor parameters.

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_fused_sgd_dtensor.py`` (exits 1 while the
limitation is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def repro() -> None:
    """Raises NotImplementedError while the limitation is there; returns once fused SGD steps DTensors."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    weight = torch.randn(4, 3)
    parameter = torch.nn.Parameter(distribute_tensor(weight.clone(), mesh, [Shard(0)]))
    parameter.grad = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
    torch.optim.SGD([parameter], lr=0.5, fused=True).step()
    torch.testing.assert_close(parameter.full_tensor(), weight - 0.5)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

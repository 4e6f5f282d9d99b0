"""torch bug: DTensor's gradient of ``mse_loss`` with ``reduction="mean"`` over an input split across ranks is
as many times too large as there are ranks.

The backward kernel divides by the element count of the tensor it sees, which under DTensor is each rank's own
piece: on 2 even shards every gradient is twice the one-process gradient, silently. The same holds for
``huber_loss``, ``smooth_l1_loss``, ``soft_margin_loss`` and ``binary_cross_entropy``; their forward, which
averages the ranks' own means (``Partial("avg")``), is also wrong when the shards are uneven.

Seen on torch 2.11.0, 2.12.1, 2.13.0 and 2.15.0, every operand a DTensor; no keras_dtensor_mixfix
involved. keras_dtensor_mixfix computes the mixed calls (a plain target, as torch would otherwise refuse) as the
sum over the global element count, forward and backward (``_engine/corrections.py``).

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_mse_loss_mean_backward.py`` (exits 1
while the bug is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def repro() -> None:
    """Raises AssertionError while the bug is there; returns (values checked) once it is fixed."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    prediction, target = torch.randn(8, 3), torch.randn(8, 3)
    reference = prediction.clone().requires_grad_()
    F.mse_loss(reference, target).backward()
    split = distribute_tensor(prediction, mesh, [Shard(0)]).requires_grad_()
    F.mse_loss(split, distribute_tensor(target, mesh, [Shard(0)])).backward()
    torch.testing.assert_close(split.grad.full_tensor(), reference.grad)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

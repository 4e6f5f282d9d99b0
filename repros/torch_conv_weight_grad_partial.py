"""torch bug: DTensor labels a convolution's weight and bias gradients ``Partial`` (summed over the ranks of the
first mesh dim) whatever the input's layout, so with a replicated input, where every rank computed the whole
gradient, they come out multiplied by the number of ranks: a silently wrong gradient, every operand a DTensor.

Seen on torch 2.11.0; right on 2.12.1 and later. No keras_dtensor_mixfix involved. keras_dtensor_mixfix refuses the
mixed calls that would meet it on that release (``_rules/builtin_pack.py``), with the layouts that are right (the
input split along its batch on the first mesh dim).

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_conv_weight_grad_partial.py`` (exits 1 while
the bug is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure on that release.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor


def repro() -> None:
    """Raises AssertionError (the gradient is world-size times too large) while the bug is there; returns once it
    is fixed. Stride equal to the kernel size: 2.11's convolution handler refuses others
    (torch_conv_handler_unsplit.py)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    x, w = torch.randn(2, 4, 8), torch.randn(3, 4, 2)
    expected = w.clone().requires_grad_()
    F.conv1d(x, expected, stride=2).sum().backward()
    weight = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
    F.conv1d(distribute_tensor(x, mesh, [Replicate()]), weight, stride=2).sum().backward()
    torch.testing.assert_close(weight.grad.full_tensor(), expected.grad)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

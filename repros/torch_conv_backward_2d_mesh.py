"""torch bug: DTensor cannot plan a convolution's backward on a 2-D mesh when the input is split along its batch on
one mesh dim and replicated on the other (``AssertionError: aten.convolution_backward.default: strategy position 0
mixes None with placements across mesh dims``), every operand a DTensor: data parallel beside tensor parallel.

Seen on torch 2.14.1 and 2.15.0; right on 2.11.0, 2.12.1 and 2.13.0. No keras_dtensor_mixfix involved; with the
package, a mixed call's backward gets its error naming this refusal.

Run: ``torchrun --nproc-per-node 4 --master-addr 127.0.0.1 repros/torch_conv_backward_2d_mesh.py`` (exits 1 while the
bug is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure on those releases.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def repro() -> None:
    """Raises AssertionError while the bug is there; returns (gradient checked) once it is fixed. 4 ranks."""
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    x, w = torch.randn(4, 4, 8), torch.randn(3, 4, 2)
    expected = w.clone().requires_grad_()
    F.conv1d(x, expected, stride=2).sum().backward()
    weight = distribute_tensor(w, mesh, [Replicate(), Replicate()]).requires_grad_()
    F.conv1d(distribute_tensor(x, mesh, [Shard(0), Replicate()]), weight, stride=2).sum().backward()
    torch.testing.assert_close(weight.grad.full_tensor(), expected.grad)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

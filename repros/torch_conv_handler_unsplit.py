"""torch bug: DTensor's convolution handler checks every call against the limits of its tensor-parallel
convolution (stride equal to the kernel size where there is no padding, dilation 1), including calls that need no
exchange between ranks (input and weight replicated, or the input split along its batch only), so an ordinary
``conv1d`` (kernel 3, stride 1) of replicated DTensors raises ``RuntimeError: ... for tensor parallel
convolution``.

Seen on torch 2.11.0; right on 2.12.1 and later (the check applies only where ranks exchange halos). No
keras_dtensor_mixfix involved, and nothing it can do without taking over DTensor's convolution: with the package a
mixed call on that release gets its error naming this refusal (a conv whose stride equals its kernel size runs).

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_conv_handler_unsplit.py`` (exits 1 while the
bug is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure on that release.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor


def repro() -> None:
    """Raises RuntimeError while the bug is there; returns (values checked) once it is fixed."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    x, w = torch.randn(2, 4, 8), torch.randn(3, 4, 3)
    out = F.conv1d(distribute_tensor(x, mesh, [Replicate()]), distribute_tensor(w, mesh, [Replicate()]))
    torch.testing.assert_close(out.full_tensor(), F.conv1d(x, w))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

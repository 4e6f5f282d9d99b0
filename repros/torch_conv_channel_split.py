"""torch bug: a convolution of a DTensor split along its channels runs torch's kernel on the piece with the whole
weight.

A depthwise ``conv1d`` (``groups`` = channels) of an input of shape (4, 8, 11) split over 2 ranks along its
channels (``Shard(1)``), with the weight replicated: DTensor's convolution handler calls the kernel on each
rank's (4, 4, 11) piece and the whole (8, 1, 4) weight, and torch refuses:

    RuntimeError: Given groups=8, weight of size [8, 1, 4], expected input[4, 4, 11] to have 8 channels, ...

Seen on torch 2.12.1, 2.13.0 and 2.15.0 (input split along its batch, or replicated: right values; on 2.11.0 the
convolution handler refuses the call first, torch_conv_handler_unsplit.py). No keras_dtensor_mixfix involved.
keras_hub's Qwen3.5 met it (its gated delta net convolves the output of a projection that tensor parallelism splits by
features); keras_dtensor_mixfix's Keras ``conv``/``conv_transpose`` make such an input whole along all but its batch
first (``_keras/ops/convolution.py``).

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_conv_channel_split.py`` (exits 1 while
the bug is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def repro() -> None:
    """Raises RuntimeError while the bug is there; returns (values checked) once it is fixed."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    x, weight = torch.randn(4, 8, 11), torch.randn(8, 1, 4)
    got = F.conv1d(distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(weight, mesh, [Replicate()]), groups=8)
    torch.testing.assert_close(got.full_tensor(), F.conv1d(x, weight, groups=8))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

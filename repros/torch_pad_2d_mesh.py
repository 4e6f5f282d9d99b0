"""torch bug: on a 2-D mesh, DTensor's ``constant_pad_nd`` (``F.pad``) returns a DTensor with one placement instead of
one per mesh dim, so the result is malformed (a replicated input) or the call fails (``IndexError: list index out of
range`` in the redistribution it plans for a split input).

Seen on torch 2.11.0; right on 2.12.1 and later. No keras_dtensor_mixfix involved; under Keras the integration pads
each rank's piece itself on that release (keras_hub's Qwen3.5 pads its gated delta rule's chunks).

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_pad_2d_mesh.py`` (exits 1 while the bug is
there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure on that release.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def repro() -> None:
    """Raises while the bug is there; returns (values checked) once it is fixed."""
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()))
    torch.manual_seed(0)
    x = torch.randn(4, 6, 8)
    padded = F.pad(distribute_tensor(x, mesh, [Replicate(), Shard(0)]), (2, 0))
    assert len(padded.placements) == 2, f"placements {padded.placements} for a 2-D mesh"
    torch.testing.assert_close(padded.full_tensor(), F.pad(x, (2, 0)))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

"""torch bug: DTensor's ``stack`` with a negative ``dim`` normalizes it against the inputs' rank instead of the
output's (one more), so inputs split along a dim at or after the new one come out labelled split one dim further:
``torch.stack(xs, -1)`` of four-dim inputs split along their last dim says the new dim is split (``Shard(4)``),
and its ``full_tensor()`` has the wrong shape, silently.

Seen on torch 2.11.0, every operand a DTensor; right on 2.12.1 and later. ``torch.stack(xs, dim + ndim + 1)``,
the same op, is right. No keras_dtensor_mixfix involved. keras_dtensor_mixfix runs the mixed calls it promotes
with the dim made non-negative on that release (``_engine/corrections.py``).

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_stack_negative_dim.py`` (exits 1 while
the bug is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure on that release.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def repro() -> None:
    """Raises AssertionError while the bug is there; returns (values checked) once it is fixed."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    pieces = [torch.randn(1, 2, 1, 4) for _ in range(3)]
    stacked = torch.stack([distribute_tensor(p, mesh, [Shard(3)]) for p in pieces], -1)
    torch.testing.assert_close(stacked.full_tensor(), torch.stack(pieces, -1),
                               msg=lambda m: f"stack along -1, placements {stacked.placements}: {m}")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

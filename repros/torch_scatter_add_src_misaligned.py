"""torch bug: DTensor's ``scatter_add`` into a tensor split along a non-scatter dim, with a ``src`` larger than the
index along that dim, scatters the wrong rows of ``src``, silently.

DTensor's ``scatter_add`` strategy keeps the split of ``self`` along a dim ``d`` other than the scatter dim when
the index has ``self``'s size on ``d``, and splits ``src`` along ``d`` as well without checking its size (the
strategy of ``scatter`` checks it). ``scatter_add`` reads only the first ``index.size(d)`` rows of ``src``; a
larger ``src`` split over the ranks hands rank 1 other rows than those.

Seen on torch 2.11.0, 2.12.1, 2.13.0 and 2.15.0, every operand a DTensor; no keras_dtensor_mixfix
involved. keras_dtensor_mixfix refuses the mixed call and says to narrow ``src`` (``_rules/builtin_pack.py``).

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_scatter_add_src_misaligned.py`` (exits 1
while the bug is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def repro() -> None:
    """Raises AssertionError while the bug is there; returns (values checked) once it is fixed."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    base, index, src = torch.randn(4, 6), torch.randint(0, 6, (4, 6)), torch.randn(8, 6)
    out = distribute_tensor(base, mesh, [Shard(0)]).scatter_add(
        1, distribute_tensor(index, mesh, [Replicate()]), distribute_tensor(src, mesh, [Replicate()]))
    torch.testing.assert_close(out.full_tensor(), base.scatter_add(1, index, src))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

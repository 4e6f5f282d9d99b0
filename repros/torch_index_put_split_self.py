"""torch bug: DTensor's ``index_put`` into a ``self`` split along a dim the indices index keeps that split when the
values have as many dims as ``self`` (they broadcast over the indexed rows), so each rank writes the global indices
into its own piece: an ``IndexError`` where an index lies past a piece, a shape mismatch, or, where every index
fits every piece, a silently wrong row on each rank. Every operand a DTensor; ``x[rows] = values`` with a row split
tensor is the everyday case.

Seen on torch 2.11.0; right on 2.12.1 and later (DTensor replicates ``self`` along those dims). No
keras_dtensor_mixfix involved. keras_dtensor_mixfix runs the mixed calls it promotes with ``self`` replicated along
those mesh dims for the call, the result split back (``_engine/corrections.py``), on that release only.

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_index_put_split_self.py`` (exits 1 while the
bug is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure on that release.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def repro() -> None:
    """Raises IndexError while the bug is there (row 3 lies past every rank's piece of 2 rows on 2 ranks);
    returns (values checked) once it is fixed."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    whole, rows, values = torch.zeros(4, 3), torch.tensor([3]), torch.ones(1, 3)
    target = distribute_tensor(whole, mesh, [Shard(0)])
    written = torch.ops.aten.index_put.default(target, [distribute_tensor(rows, mesh, [Replicate()])],
                                               distribute_tensor(values, mesh, [Replicate()]))
    torch.testing.assert_close(written.full_tensor(), whole.index_put((rows,), values))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

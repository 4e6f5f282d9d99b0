"""torch bug: a vocabulary-sharded embedding lookup on a 2-D mesh whose ids are split on the other axis.

On a (2, 2) ("batch", "model") mesh, token ids split over "batch" (``Shard(0)``) meet a table
sharded over both axes (the hidden dim over "batch", the vocabulary over "model": keras_hub's
``get_layout_map`` layout). DTensor's embedding strategy gathers the ids over "batch" and returns
``(Shard(2), _MaskPartial)``, but its mask was built from this rank's ids *before* the gather, so
the first reduction fails:

    IndexError: The shape of the mask [2, 3] at index 0 does not match the shape of the indexed
    tensor [4, 3, 4] at index 0

Seen on torch 2.13.0 and 2.15.0. No keras_dtensor_mixfix involved: plain DTensor code.
keras_dtensor_mixfix's Keras ``take`` avoids it by gathering the table over "batch" first
(``_keras/ops/embedding_ops.py``: ``whole_where_indices_split``).

Run: ``torchrun --nproc-per-node 4 --master-addr 127.0.0.1 repros/torch_embedding_mask_2d.py``
(exits 1 while the bug is there); ``tests/patterns/test_torch_repros.py`` runs it on 4 ranks as an
expected failure, so a torch release that fixes it shows up as an unexpected pass.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def repro() -> None:
    """Raises IndexError while the bug is there; returns (values checked) once it is fixed."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("batch", "model"))
    torch.manual_seed(0)
    table, ids = torch.randn(16, 8), torch.randint(0, 16, (4, 3))
    sharded_table = distribute_tensor(table, mesh, [Shard(1), Shard(0)])  # hidden over batch, vocabulary over model
    split_ids = distribute_tensor(ids, mesh, [Shard(0), Replicate()])  # rows over batch
    looked_up = torch.nn.functional.embedding(split_ids, sharded_table)
    torch.testing.assert_close(looked_up.full_tensor(), torch.nn.functional.embedding(ids, table))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

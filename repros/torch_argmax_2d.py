"""torch bug: ``argmax`` over a dim sharded on a 2-D mesh whose other axis splits the batch into single rows.

On a (2, 2) ("batch", "model") mesh, logits of shape (2, 8, 64) split over "batch" by rows (one row per
rank) and over "model" by vocabulary: ``argmax(dim=-1)`` (what a sparse categorical accuracy metric
does) goes to DTensor's ``argminmax_handler``, which gathers the pieces and fails reshaping them:

    RuntimeError: shape '[1, 8, 2, 2, 8, 1]' is invalid for input of size 16

Seen on torch 2.12.1 and 2.13.0 (keras_hub Gemma and Qwen on a (4, 2) mesh, 4 rows); fixed in 2.15.0 (2.14
not checked); with two rows per rank it passes. No keras_dtensor_mixfix involved.
keras_dtensor_mixfix's Keras ``argmax``/``argmin`` avoid it by gathering the reduced dim first
(``_keras/ops/reduction_ops.py``: ``whole_along``).

Run: ``torchrun --nproc-per-node 4 --master-addr 127.0.0.1 repros/torch_argmax_2d.py`` (exits 1 while
the bug is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def repro() -> None:
    """Raises RuntimeError while the bug is there; returns (values checked) once it is fixed."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("batch", "model"))
    torch.manual_seed(0)
    logits = torch.randn(2, 8, 64)
    sharded = distribute_tensor(logits, mesh, [Shard(0), Shard(2)])  # rows over batch, vocabulary over model
    torch.testing.assert_close(sharded.argmax(dim=-1).full_tensor(), logits.argmax(dim=-1))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

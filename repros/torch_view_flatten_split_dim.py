"""torch limitation: DTensor cannot flatten several dims into one when a dim after the first is split
(``RuntimeError: Attempted to flatten multiple dimensions, with dimension 1 being sharded``), with every operand a
DTensor. ``scaled_dot_product_attention`` on CPU with a plain ``attn_mask`` (promoted by keras_dtensor_mixfix) and
the heads split across ranks (tensor parallel attention) meets it: its math path views (batch, heads, rows, dim) as
(batch * heads, rows, dim).

Seen on torch 2.11.0; right on 2.12.1 and later (the flattened dim comes out as a strided split). No
keras_dtensor_mixfix involved. 2.11's strided splits cannot be carried further (its redistribution and ``mm`` refuse
them), so the package cannot run the view on pieces there: the Keras integration's ``einsum`` and ``matmul`` avoid
it, and elsewhere the package refuses the view with an error naming this release, the one that runs it and the
redistribution that runs it here (``_engine/release_refusals.py``).

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_view_flatten_split_dim.py`` (exits 1 while
the limitation is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure on that release.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def repro() -> None:
    """Raises RuntimeError while the limitation is there; returns (values checked) once it is lifted."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    heads_split = torch.randn(2, 4, 3, 8)  # (batch, heads, rows, dim), the heads split
    flattened = distribute_tensor(heads_split, mesh, [Shard(1)]).view(8, 3, 8)
    torch.testing.assert_close(flattened.full_tensor(), heads_split.view(8, 3, 8))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

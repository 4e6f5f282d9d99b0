"""torch bug: DTensor accepts a view that unflattens a dim split over two mesh axes, then fails on the pieces.

A (16, 16) tensor split along dim 0 over both axes of a (2, 2) mesh (placements ``Shard(0), Shard(0)``: 4 rows per
rank) viewed as (2, 8, 16): the new dim 0 (size 2) divides the first axis but not the two together, so no rank can
hold whole rows of it. On a 1-D mesh of 4 ranks DTensor refuses the same view with a clear message ("Cannot unflatten
unevenly sharded tensor ... Please redistribute the tensor before this operation"); on the 2-D mesh its sharding
propagation accepts it, declares output pieces of (1, 8, 16), and the view of each rank's (4, 16) piece raises:

    RuntimeError: shape '[1, 8, 16]' is invalid for input of size 64

Seen on torch 2.11.0, 2.12.1, 2.13.0 and 2.15.0, no mixed operand, no keras_dtensor_mixfix. keras_hub's Mixtral met it
on (2, 4) and (4, 2) meshes in the backward of its MoE block's flatten of the tokens, whose gradient arrived split over
both axes; the Keras integration lays such a gradient out as the forward output was before the view back
(``_keras/ops/reshape.py``).

The repro passes once DTensor either gives the right values or refuses the view as it does on one mesh axis.

Run: ``torchrun --nproc-per-node 4 --master-addr 127.0.0.1 repros/torch_view_two_axes_one_dim.py`` (exits 1 while the
bug is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard


def repro() -> None:
    """Raises RuntimeError while the bug is there; returns (values checked, or the view refused) once it is fixed."""
    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    whole = torch.randn(16, 16)
    piece = whole.chunk(dist.get_world_size())[dist.get_rank()]  # rank r's rows: mesh coordinates (r // 2, r % 2)
    x = DTensor.from_local(piece, mesh, [Shard(0), Shard(0)], shape=whole.shape, stride=whole.stride())
    try:
        viewed = x.view(2, 8, 16)
    except RuntimeError as refused:
        if "Please redistribute" in str(refused):
            return
        raise
    torch.testing.assert_close(viewed.full_tensor(), whole.view(2, 8, 16))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

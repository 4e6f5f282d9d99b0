"""torch limitation: DTensor cannot index with a boolean mask, even a replicated tensor by a replicated mask.

``x[mask]`` is ``aten.index.Tensor`` with a boolean index, whose result's size depends on the mask's values;
DTensor's strategy turns the mask into positions with ``nonzero``, which has no sharding strategy:

    RuntimeError: aten.nonzero.default ... Sharding propagation failed for aten.index.Tensor(...)

Seen on torch 2.12.1, 2.13.0 and 2.15.0; no keras_dtensor_mixfix involved. With a plain mask
(the same whole tensor on every rank), keras_dtensor_mixfix indexes each rank's piece where ``x`` is not split
along a dim the mask indexes (``_engine/corrections.py``).

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_boolean_mask_index.py`` (exits 1 while
the limitation is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor


def repro() -> None:
    """Raises RuntimeError while the limitation is there; returns (values checked) once it is lifted."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    x, mask = torch.randn(8, 4), torch.rand(8, 4) > 0.5
    out = distribute_tensor(x, mesh, [Replicate()])[distribute_tensor(mask, mesh, [Replicate()])]
    torch.testing.assert_close(out.full_tensor(), x[mask])


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: lifted in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

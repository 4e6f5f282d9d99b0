"""torch bug: DTensor has no sharding strategy for CPU's fused attention
(``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
strategy registered``), with every operand a DTensor. ``scaled_dot_product_attention`` on CPU runs that op for a
mask that needs no gradient (a mask that needs one takes the math path instead), so attention of DTensors fails
whatever their layout; later releases derive a strategy from the op's decomposition.

Seen on torch 2.11.0; right on 2.12.1 and later. No keras_dtensor_mixfix involved; a mixed call the package promotes
(a plain mask beside head-split queries, keys and values) is computed on each rank's heads on that release.

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_sdpa_cpu_no_strategy.py`` (exits 1 while
the bug is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure on that release.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor


def repro() -> None:
    """Raises NotImplementedError while the bug is there; returns (values checked) once it is fixed."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
    mask = torch.randn(3, 5)
    # replicated operands: DTensor's strategy search on later releases is quick for them (sdpa_cpu_sharding_search)
    attended = F.scaled_dot_product_attention(*(distribute_tensor(t, mesh, [Replicate()])
                                                for t in (query, key, value)),
                                              attn_mask=distribute_tensor(mask, mesh, [Replicate()]))
    torch.testing.assert_close(attended.full_tensor(), F.scaled_dot_product_attention(query, key, value,
                                                                                      attn_mask=mask))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

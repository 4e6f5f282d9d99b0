"""torch limitation: DTensor has no sharding strategy for ops that later releases derive from their decompositions
(``binary_cross_entropy_with_logits``, ``index_add_``, ...): ``NotImplementedError``, with every operand a DTensor
and even all of them ``Replicate``.

Seen on torch 2.11.0; there on 2.12.1 and later (DTensor derives a strategy from an op's decomposition where it has
none of its own). No keras_dtensor_mixfix involved. keras_dtensor_mixfix runs the mixed calls it promotes of
``binary_cross_entropy_with_logits`` by its elementwise formula and of ``index_add`` / ``index_add_`` with
replicated operands on each rank's whole local values (``_engine/corrections.py``), on that release only; other
layouts get its error naming DTensor's refusal.

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_no_decomposition_strategy.py`` (exits 1
while the limitation is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure on that
release.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor


def repro() -> None:
    """Raises NotImplementedError while the limitation is there; returns (values checked) once it is lifted."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    logits, targets = torch.randn(4, 3), torch.rand(4, 3)
    loss = F.binary_cross_entropy_with_logits(distribute_tensor(logits, mesh, [Replicate()]),
                                              distribute_tensor(targets, mesh, [Replicate()]))
    torch.testing.assert_close(loss.full_tensor(), F.binary_cross_entropy_with_logits(logits, targets))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

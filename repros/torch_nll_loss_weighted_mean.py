"""torch bug: DTensor's ``nll_loss`` with ``reduction="mean"`` over a batch split across ranks averages each
rank's own mean, which is the mean over the whole batch only when every rank's denominator is the same.

With class weights (``weight=``) the denominator is each rank's sum of its targets' weights; with an
``ignore_index`` that some targets hit, each rank's count of the others. DTensor's strategy marks the
output ``Partial("avg")``: the loss comes out as the average of the per-rank weighted means, a wrong
number, silently (pytorch/pytorch#185167). The backward is right (it divides by the summed total weight).

Seen on torch 2.12.1 and 2.13.0, every operand a DTensor; fixed in 2.15.0 (2.14 not checked). No
keras_dtensor_mixfix involved.
keras_dtensor_mixfix computes the mixed call (plain labels or weights, as torch would otherwise refuse)
as the summed loss over the summed weight (``_engine/corrections.py``).

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_nll_loss_weighted_mean.py`` (exits 1
while the bug is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor


def repro() -> None:
    """Raises AssertionError while the bug is there; returns (values checked) once it is fixed."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    logits, labels, weight = torch.randn(8, 5), torch.randint(0, 5, (8,)), torch.rand(5) + 0.1
    loss = F.cross_entropy(
        distribute_tensor(logits, mesh, [Shard(0)]),
        distribute_tensor(labels, mesh, [Shard(0)]),
        weight=distribute_tensor(weight, mesh, [Replicate()]),
    )
    torch.testing.assert_close(loss.full_tensor(), F.cross_entropy(logits, labels, weight=weight))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

"""torch limitation: a DTensor ``argmax`` along a sharded dim breaks TorchDynamo's graph.

DTensor's handler for ``argmax``/``argmin`` along a sharded dim (``_nonlinear_redux.py``) finds where
this rank's piece starts with ``compute_local_shape_and_global_offset``, which reads the offset out of
a tensor (``int(offsets[0])``): a data-dependent read, so ``torch.compile(fullgraph=True)`` fails ("Could not extract
specialized integer from data-dependent expression u0"), and without ``fullgraph`` the graph breaks
there ("Data dependent operator", ``Tensor.item()``). Values are right either way.

Seen on torch 2.11.0, 2.12.1, 2.13.0 and 2.15.0. No keras_dtensor_mixfix involved.
It matters inside Keras: a break under Keras' ``name_scope`` context manager cannot be taken gracefully,
so TorchDynamo throws the frame away and traces again from the frames inside it; in a compiled
keras_hub step (the accuracy metric's argmax over vocabulary-split logits, and the same offset read in
our vocabulary-parallel loss) each such break retraced the model. ``_keras/ops/reduction_ops.py``
(``winner_across_pieces``) gathers each piece's winner instead while compiling, and
``_keras/backend/local_pieces.py`` (``first_index_here``) computes the offset in Python integers.

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_dtensor_argmax_compiled.py``
(exits 1 while the limitation is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def repro() -> None:
    """Raises TorchDynamo's ``UserError`` while the limitation is there; returns once it is gone."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    logits = torch.randn(4, 16)
    split = distribute_tensor(logits, mesh, [Shard(1)])
    torch._dynamo.reset()
    winners = torch.compile(lambda x: x.argmax(-1), backend="eager", fullgraph=True)(split)
    torch.testing.assert_close(winners.full_tensor(), logits.argmax(-1))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

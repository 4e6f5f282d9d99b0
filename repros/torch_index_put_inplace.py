"""torch limitation: DTensor has no sharding strategy for the in-place ``index_put_`` (``x[index] = values``,
Keras' ``slice_update``, keras_hub's cache writes in ``generate()``): it raises ``NotImplementedError``, with every
operand a DTensor and even all of them ``Replicate``. The out-of-place ``index_put`` has one.

Seen on torch 2.11.0; there on 2.12.1 and later. No keras_dtensor_mixfix involved. keras_dtensor_mixfix runs the
mixed calls it promotes as ``index_put`` written back into ``self`` on that release (``_engine/corrections.py``),
and the Keras integration's ``slice_update`` updates the replicated values' local tensors there
(``_keras/ops/tensor_ops.py``).

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_index_put_inplace.py`` (exits 1 while the
limitation is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure on that release.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor


def repro() -> None:
    """Raises NotImplementedError while the limitation is there; returns (values checked) once it is lifted."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    whole, rows, values = torch.zeros(4, 3), torch.tensor([0, 2]), torch.ones(2, 3)
    target = distribute_tensor(whole.clone(), mesh, [Replicate()])
    target.index_put_((distribute_tensor(rows, mesh, [Replicate()]),), distribute_tensor(values, mesh, [Replicate()]))
    torch.testing.assert_close(target.full_tensor(), whole.index_put((rows,), values))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

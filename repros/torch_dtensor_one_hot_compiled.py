"""torch limitation: ``F.one_hot`` of a DTensor cannot be traced by ``torch.compile``.

Fake-running ``one_hot`` checks its input's range with ``aten._assert_async.msg``, which DTensor has
no sharding strategy for: TorchDynamo fails the node ("Operator aten._assert_async.msg does not have
a sharding strategy registered"), so ``fullgraph=True`` raises and without it the graph breaks. Eager
``one_hot`` of the same DTensor works.

Seen on torch 2.12.1, 2.13.0 and 2.15.0; not on 2.11.0. No keras_dtensor_mixfix involved.
keras_hub's Qwen MoE router calls Keras' ``one_hot`` on its expert choices; compiled under
``ModelParallel`` the break happened inside Keras' ``name_scope``, the model was traced again, and a
split graph returning a view of its DTensor input then failed in AOTAutograd ("as_strided not
supported with DTensor"). ``_keras/ops/tensor_ops.py`` (``_local_one_hot``) encodes the local piece while
compiling.

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_dtensor_one_hot_compiled.py``
(exits 1 while the limitation is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor


def repro() -> None:
    """Raises while the limitation is there; returns once it is gone."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    choices = torch.tensor([[0, 3], [2, 1]])
    whole = distribute_tensor(choices, mesh, [Replicate()])
    torch._dynamo.reset()
    encoded = torch.compile(lambda x: torch.nn.functional.one_hot(x, 4), backend="eager", fullgraph=True)(whole)
    torch.testing.assert_close(encoded.full_tensor(), torch.nn.functional.one_hot(choices, 4))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

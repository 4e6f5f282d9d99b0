"""torch limitation: ``clip_grad_norm_`` over parameters on two meshes that span the same ranks fails.

Expert parallelism puts the experts on a second mesh over the same ranks (transformers'
``DistributedConfig(tp_plan="auto", ep_size=...)``). ``clip_grad_norm_`` takes one norm per parameter
(each on its parameter's mesh) and stacks them; DTensor refuses an op whose operands sit on different
meshes, although a norm is the same whole value on every rank:

    RuntimeError: All operands in aten.stack.default must have the same mesh, but got DeviceMesh((ep=2), ...)

Seen on torch 2.11.0, 2.12.1, 2.13.0 and 2.15.0, no keras_dtensor_mixfix involved (run it with
``KERAS_DTENSOR_MIXFIX=0``: the package makes it pass, ``_engine/meshes.py``).

Run: ``KERAS_DTENSOR_MIXFIX=0 torchrun --nproc-per-node 2 --master-addr 127.0.0.1
repros/torch_clip_grad_norm_two_meshes.py`` (exits 1 while the limitation is there);
``tests/patterns/test_torch_repros.py`` runs it, unpatched, as an expected failure.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def repro() -> None:
    """Raises RuntimeError while the limitation is there; returns (values checked) once it is lifted."""
    size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
    experts = init_device_mesh("cpu", (size,), mesh_dim_names=("ep",))  # the same ranks
    torch.manual_seed(0)
    weights, grads = [torch.randn(4, 6), torch.randn(6, 4)], [torch.randn(4, 6), torch.randn(6, 4)]
    params = []
    for device_mesh, weight, grad in zip((mesh, experts), weights, grads):
        param = torch.nn.Parameter(distribute_tensor(weight, device_mesh, [Shard(0)]))
        param.grad = distribute_tensor(grad, device_mesh, [Shard(0)])
        params.append(param)
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=False)
    torch.testing.assert_close(norm.full_tensor(), torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: lifted in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

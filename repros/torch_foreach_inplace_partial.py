"""torch bug: DTensor runs an in-place ``_foreach_*`` op whose written list holds a ``Partial`` DTensor as a
no-op: the DTensor's local tensor is left unchanged, silently.

``torch._foreach_mul_([p], 2.0)`` on a ``Partial`` DTensor ``p`` leaves ``p`` as it was; the same op out of
place (``_foreach_mul``), the single-tensor ``p.mul_(2.0)`` and a ``Partial`` operand in any list the op only
reads are right. Optimizers and ``clip_grad_norm_`` write in place into lists that hold ``Partial`` DTensors
wherever a gradient is one (SGD's momentum buffers start as clones of the gradients; clipping scales the
gradients), so foreach optimizers update wrongly there.

Seen on torch 2.9.1, 2.10.0 and 2.11.0, every operand a DTensor; right on 2.12.1, 2.13.0, 2.14.1 and 2.15.0
(between the 2.11 and 2.12 branch cuts DTensor's foreach ops moved to single-dim sharding strategies:
pytorch/pytorch#172477, #174903, #177186/#177187, which adds ``test_foreach_add_list_partial``). No
keras_dtensor_mixfix involved. keras_dtensor_mixfix runs the calls it promotes exactly on those releases
(``_engine/foreach_partial.py``); calls with every operand a DTensor are torch's.

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_foreach_inplace_partial.py`` (exits 1
while the bug is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure on those releases.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial


def repro() -> None:
    """Raises AssertionError while the bug is there; returns (values checked) once it is fixed."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    piece = torch.arange(4.0) + dist.get_rank()
    partial = DTensor.from_local(piece, mesh, [Partial()])
    expected = 2 * partial.full_tensor()
    torch._foreach_mul_([partial], 2.0)
    torch.testing.assert_close(partial.full_tensor(), expected, msg=lambda m: f"in-place foreach on Partial: {m}")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

"""torch bug: a compiled function that mutates, in place, a DTensor input that requires grad.

A graph input that requires grad and is modified in place (``x.mul_(0.5)``; keras_hub Gemma's attention
does ``q *= normalization``, and a graph break just before makes ``q`` an input of the resumed frame) is
returned by AOTAutograd's forward graph as an extra output, with a tangent in the backward. For a
DTensor input, that tangent is built as a plain tensor of the DTensor's global shape, and the joint
graph's trace fails adding it to a DTensor gradient:

    RuntimeError: aten.add.Tensor got mixed torch.Tensor and DTensor, need to convert all torch.Tensor
    to DTensor before calling distributed operators!

The same miscount shows in the forward graph's metadata: the mutated input is counted as one forward
output, though the graph returns it flattened (its local tensor and its mesh), so inductor's backward
compile reads the saved activations' strides one slot off (with keras_dtensor_mixfix promoting that
plain tangent, keras_hub Gemma under ``jit_compile=True`` then failed ``IndexError: tuple index out of
range`` in ``_aot_stage2b_bw_compile``). Seen on torch 2.13.0 and 2.15.0. No keras_dtensor_mixfix
involved; ``aot_eager`` is enough to show it.

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_compile_mutated_dtensor_input.py``
(exits 1 while the bug is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor


def repro() -> None:
    """Raises RuntimeError while the bug is there; returns (gradient checked) once it is fixed."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    whole = torch.randn(4, 6)
    leaf = distribute_tensor(whole, mesh, [Shard(0)]).requires_grad_()

    def scaled_sine(x):
        x.mul_(0.5)  # in place, on an input that requires grad
        return x.sin().sum()

    torch._dynamo.reset()
    compiled = torch.compile(scaled_sine, backend="aot_eager", dynamic=False)
    compiled(leaf * 1).full_tensor().backward()  # leaf * 1: a non-leaf input may be modified in place
    torch.testing.assert_close(leaf.grad.full_tensor(), 0.5 * torch.cos(0.5 * whole))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

"""torch bug: a compiled function with two DTensor outputs that require grad, backward through only one.

When ``.backward()`` reaches only some outputs of a compiled function, autograd fills the others' gradients
with zeros; for a DTensor output that zero is a plain tensor, and AOTAutograd's backward refuses it:

    RuntimeError: During the backward, we encountered a tensor subclass where we guessed its metadata
    incorrectly. Expected a DTensor tangent but got a plain Tensor (tangent index: 1).

torch's message names the pattern and asks the caller to ``.detach()`` the output it does not need, which
a library cannot do for code it compiles: a graph break after ``m = x.amax(-1)`` makes ``m`` an output of the
graph before the break, and the code after it uses ``m`` without a gradient (keras_hub Gemma3n; GPT-OSS's
attention sinks until the Keras integration kept Keras' ``max`` from breaking the graph).
pytorch/pytorch#172556. Seen on torch 2.12.1, 2.13.0 and 2.15.0 (on 2.11.0 AOTAutograd refuses the same tangent
as a subclass whose metadata it guessed wrong). No keras_dtensor_mixfix involved; ``aot_eager`` is enough to show
it.

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_compile_dtensor_output_without_gradient.py``
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

    def sine_and_row_max(x):
        return x.sin(), x.amax(-1)

    torch._dynamo.reset()
    compiled = torch.compile(sine_and_row_max, backend="aot_eager", dynamic=False)
    sine, _ = compiled(leaf * 1)  # the row max is not used: no gradient reaches it
    sine.sum().full_tensor().backward()
    torch.testing.assert_close(leaf.grad.full_tensor(), torch.cos(whole))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

"""torch bug: DTensor declares softplus's and elu's gradient contiguous while the kernel writes it transposed.

``aten.softplus_backward`` and ``aten.elu_backward`` give their output the layout of the incoming gradient on
CPU, but their meta functions (which DTensor's sharding propagation runs to declare the output's strides) give it
the layout of the forward input. With a gradient laid out transposed, the DTensor result declares stride (32, 4, 1)
over a piece of stride (32, 1, 8); reshaping it, which DTensor turns into a view because the declared strides allow
one, then raises on the piece:

    RuntimeError: view size is not compatible with input tensor's size and stride ...

Seen on torch 2.11.0, 2.12.1, 2.13.0 and 2.15.0, with every operand a DTensor split along its batch (DataParallel's
layout) — no mixed operand, no keras_dtensor_mixfix. keras_hub's Qwen3.5 met it in the backward of its gated delta
net (``softplus`` of a projection, read back transposed); the Keras integration gives those activations a
contiguous gradient (``_keras/ops/activations.py``). ``hardtanh``/``hardsigmoid``/``hardswish`` share the meta
disagreement, but DTensor has no strategy for their backward at all.

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_activation_backward_strides.py`` (exits 1
while the bug is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard


def repro() -> None:
    """Raises RuntimeError while the bug is there; returns (values checked) once it is fixed."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    gradient = torch.randn(2, 4, 8).transpose(1, 2)  # this rank's (2, 8, 4) piece, laid out transposed
    x = torch.randn(2, 8, 4)
    backwards = {"softplus": lambda grad, inp: torch.ops.aten.softplus_backward(grad, inp, 1, 20),
                 "elu": lambda grad, inp: torch.ops.aten.elu_backward(grad, 1.0, 1, 1, False, inp)}
    for name, backward in backwards.items():
        got = backward(DTensor.from_local(gradient, mesh, [Shard(0)]), DTensor.from_local(x, mesh, [Shard(0)]))
        torch.testing.assert_close(got.reshape(-1, 4).to_local(), backward(gradient, x).reshape(-1, 4), msg=name)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

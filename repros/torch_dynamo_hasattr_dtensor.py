"""torch bug: under ``torch.compile``, ``hasattr(dtensor, "to_local")`` is False.

TorchDynamo answers ``hasattr`` on a tensor from ``torch.Tensor``'s attributes, so a method that only
the ``DTensor`` subclass has is reported missing while tracing, though ``isinstance(x, DTensor)`` is
traced correctly. Code that tells a DTensor apart by that ``hasattr`` takes its plain-tensor branch
only when compiled:

    eager (True, True), compiled (False, True)

Seen on torch 2.13.0 and 2.15.0. No keras_dtensor_mixfix involved.
keras_dtensor_mixfix's Keras attention (``_keras/ops/attention_ops.py``: ``_local_piece``) asked that
``hasattr`` to take each rank's piece; compiled, the pieces stayed whole DTensors and Keras' attention
ran on them, which AOTAutograd then failed to replay ("as_strided not supported with DTensor") in
keras_hub's Llama3 and Qwen under ``jit_compile=True``. It asks ``isinstance`` instead.

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_dynamo_hasattr_dtensor.py``
(exits 1 while the bug is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


def repro() -> None:
    """Raises AssertionError while the bug is there; returns once it is fixed."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])

    def probe(x):
        return x * 2, hasattr(x, "to_local"), isinstance(x, DTensor)

    eager = probe(sharded)[1:]
    compiled = torch.compile(probe, backend="eager", fullgraph=True)(sharded)[1:]
    assert eager == (True, True), eager
    assert compiled == eager, f"hasattr/isinstance compiled {compiled}, eager {eager}"


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

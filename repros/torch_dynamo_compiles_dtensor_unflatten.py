"""torch limitation: ``backward()`` inside a compiled function makes TorchDynamo compile DTensor's
``__tensor_unflatten__`` as frames of their own.

A function compiled with ``torch.compile`` that calls ``loss.backward()`` breaks its graph there and
runs the backward eagerly, but with TorchDynamo's frame hook still on. The compiled backward's Python
wrapper rebuilds every DTensor gradient with ``DTensor.__tensor_unflatten__``, which TorchDynamo does
not skip: it compiles that function as a frame, once per gradient shape and placement until its
recompile limit (8), and each compile breaks its graph at ``DTensor(...)`` ("Failed to convert
args/kwargs to proxy", the ``DTensorSpec`` argument). With static shapes (``dynamic=False``, as
here) values are right and the cost is compile time and guard checks on every gradient of every step;
with torch's default automatic dynamic shapes the second compile of that frame makes a size symbolic
and crashes the backward ("InternalTorchDynamoError: AsPythonConstantNotImplementedError:
SymNodeVariable() is not a constant").

Seen on torch 2.12.1, 2.13.0 and 2.15.0. No keras_dtensor_mixfix involved.
Keras' torch train step calls ``backward()`` inside the function it compiles for ``jit_compile=True``;
``_keras/step/forked_train_step.py`` (``_eagerly``) runs the backward with ``torch.compiler.disable``.

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_dynamo_compiles_dtensor_unflatten.py``
(exits 1 while the limitation is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def repro() -> None:
    """Raises AssertionError while the limitation is there; returns once it is gone."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [placement]))
               for placement in (Shard(0), Shard(1), Replicate())]
    inputs = distribute_tensor(torch.randn(4, 8), mesh, [Replicate()])

    def step(x):
        for weight in weights:
            x = torch.tanh(x @ weight)
        loss = x.sum()
        loss.backward()
        return loss.detach()

    torch._dynamo.reset()
    torch.compile(step, backend="aot_eager", dynamic=False)(inputs)
    compiled = torch._dynamo.eval_frame._debug_get_cache_entry_list(DTensor.__tensor_unflatten__.__code__)
    assert not compiled, f"TorchDynamo compiled DTensor.__tensor_unflatten__ as a frame {len(compiled)} times"


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

"""The device decision for a plain operand meeting a DTensor: torch's own rule for plain tensors.

The decision is a function of devices only, so it is tested here with devices that need no hardware
(``torch.device("cuda", 0)`` is only a name); the engine applying it on real DTensors is tested on
ranks with ``meta`` DTensors (tests/engine/test_devices.py) and, where two GPUs exist, on CUDA meshes.
"""

from __future__ import annotations

import types

import pytest
import torch

from keras_dtensor_mixfix._engine.devices import MOVE, SAME, device_decision, on_mesh_device
from keras_dtensor_mixfix._rules.decisions import Operand
from keras_dtensor_mixfix._rules.ops import op_traits

CPU, META = torch.device("cpu"), torch.device("meta")
CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


@pytest.mark.parametrize("plain, ndim, written, target, verdict", [
    (CPU, 2, False, CPU, SAME),
    (CUDA0, 2, False, CUDA0, SAME),
    (CUDA1, 2, False, torch.device("cuda"), SAME),  # a mesh's device type without index: any index of it
    (META, 2, True, META, SAME),
    (CPU, 0, False, CUDA0, MOVE),                   # a CPU scalar may meet tensors on another device
    (CPU, 0, False, META, MOVE),
    (CPU, 2, False, CUDA0, "error"),                # a CPU matrix next to a CUDA DTensor
    (CPU, 1, False, CUDA0, "error"),                # one element, but not 0-dim: not a scalar for torch either
    (CPU, 0, True, CUDA0, "error"),                 # a CPU scalar cannot receive a CUDA result
    (CUDA0, 0, False, CPU, "error"),                # only CPU scalars are scalars
    (CUDA1, 2, False, CUDA0, "error"),              # another GPU
    (CPU, 2, False, META, "error"),
])
def test_device_decision_follows_torchs_rule_for_plain_tensors(plain, ndim, written, target, verdict):
    got, why = device_decision(plain, ndim, written, target)
    assert got == verdict
    assert (why is None) == (verdict != "error")
    if why is not None:
        assert str(plain) in why and str(target) in why


def _peer_on(device: torch.device, mesh: object) -> types.SimpleNamespace:
    """What on_mesh_device reads of a DTensor peer: its spec's mesh and its local piece."""
    return types.SimpleNamespace(_spec=types.SimpleNamespace(mesh=mesh), device_mesh=mesh,
                                 _local_tensor=torch.empty(2, device=device))


def test_a_cpu_scalar_is_moved_to_the_peers_device_and_kept_otherwise():
    mesh = object()
    traits = op_traits(torch.ops.aten.mul.Tensor)
    scalar = torch.tensor(3.0)
    moved = on_mesh_device(Operand((1,), scalar, True, False), _peer_on(META, mesh), mesh, traits)
    assert moved.device == META and moved.shape == () and scalar.device == CPU
    same = torch.ones(2)
    assert on_mesh_device(Operand((1,), same, True, False), _peer_on(CPU, mesh), mesh, traits) is same



def test_a_moved_cpu_scalar_keeps_value_dtype_and_gradient():
    """The move (``scalar_on``) on CPU, where its value can be read: same value and dtype, and the gradient reaches
    the CPU scalar; onto ``meta``: a 0-dim tensor of the dtype on the target device."""
    from keras_dtensor_mixfix._engine.devices import scalar_on

    scalar = torch.tensor(3.0, requires_grad=True)
    moved = scalar_on(scalar, CPU)
    (moved * 2).backward()
    assert moved.item() == 3.0 and scalar.grad.item() == 2.0
    for dtype in (torch.float16, torch.int64, torch.bool):
        on_meta = scalar_on(torch.tensor(1, dtype=dtype), META)
        assert (on_meta.device, on_meta.dtype, on_meta.shape) == (META, dtype, torch.Size([]))


def test_the_move_is_never_a_blocking_copy(monkeypatch):
    """``Tensor.to``/``copy_`` are replaced by functions that fail: they stand for CUDA's blocking host-to-device
    copy (a memcpy and a stream synchronization), which the move must not use."""
    def blocking(*args, **kwargs):
        raise AssertionError("a blocking copy")

    monkeypatch.setattr(torch.Tensor, "to", blocking)
    monkeypatch.setattr(torch.Tensor, "copy_", blocking)
    mesh = object()
    traits = op_traits(torch.ops.aten.where.self)
    moved = on_mesh_device(Operand((2,), torch.tensor(3.0), True, False), _peer_on(META, mesh), mesh, traits)
    assert moved.device == META and moved.shape == ()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (this machine has none)")
def test_on_cuda_the_move_never_synchronizes():
    """On a GPU: torch's sync debug mode set to raise on any host-device synchronization around the move."""
    from keras_dtensor_mixfix._engine.devices import scalar_on

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved = scalar_on(torch.tensor(2.5), torch.device("cuda", torch.cuda.current_device()))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert moved.item() == 2.5

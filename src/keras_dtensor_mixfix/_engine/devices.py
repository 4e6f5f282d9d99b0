"""On which device a promoted operand's local piece sits: always its mesh's, never another.

A plain operand on another device than the DTensor it meets (a CPU batch next to a CUDA DTensor) gets
torch's own rule for plain tensors: every operand of an op sits on one device, except a 0-dim CPU
tensor, which torch takes as a scalar next to tensors on any device. So:

- same device as the DTensor peer's local piece: promoted as usual;
- a 0-dim CPU tensor the op only reads: accepted (``MOVE``), as torch accepts a CPU scalar (below: in
  practice it stays on the CPU, read as a kernel argument, and is never copied);
- anything else (a CPU matrix next to a CUDA DTensor, ``cuda:1`` next to ``cuda:0``, a 0-dim CPU tensor an
  op writes into, a CUDA scalar next to CPU DTensors): a ``MixedOperandError`` in the words of torch's
  device error, naming the op, the operand, shapes, devices and mesh, and what to do.

A DTensor whose local piece sits on another device than its mesh is never built: the op would fail on
the local tensors later with a message that names neither operand, or, on the ``meta`` device, silently
compute nothing.

A 0-dim CPU tensor is never copied on the way. The general path promotes only multi-element plain
operands (``operands.needs_promotion``) and those an op writes into, so a CPU scalar the op only reads
(``torch.where(mask, dt, torch.tensor(0.))``, an optimizer's ``lr`` tensor) is left to torch's own path,
which makes it ``Replicate`` with the CPU tensor itself as the local piece: the local kernel reads it as a
kernel argument (TensorIterator's CPU-scalar rule), as torch does for plain tensors, with no copy and no
host-device synchronization. No path of the engine reaches the ``MOVE`` verdict today (a written 0-dim
operand is refused); the scalar rule is here so that the decision is torch's whole rule, and its move
(:func:`scalar_on`) never waits for the device either: ``fill_`` with a value on another device reads it on
the host (``value.item()``, a read of CPU memory) and launches one fill kernel with the value as its
argument. ``DTensor.from_local`` would instead call ``local.to(mesh.device_type)``: a blocking copy (on
CUDA a host-to-device ``memcpy`` and a stream synchronization, which waits for every kernel queued before
it) onto the *current* device. The move is not cached across calls: a CPU scalar may change in place
between calls (a learning rate a scheduler ``fill_``-s), telling so needs torch's private version counter,
and one fill kernel costs what a lookup would.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor

from .._rules.decisions import Operand
from .._rules.errors import describe_mesh, promotion_error
from .._rules.ops import OpTraits

SAME = "same"
MOVE = "move"


def device_decision(plain: torch.device, plain_ndim: int, written: bool,
                    target: torch.device) -> Tuple[str, Optional[str]]:
    """``(SAME, None)``, ``(MOVE, None)`` or ``("error", why)`` for a plain operand on ``plain`` whose
    DTensor peer's local piece sits on ``target`` (a device without index: the mesh's device type)."""
    if plain == target or (target.index is None and plain.type == target.type):
        return SAME, None
    if plain.type == "cpu" and plain_ndim == 0:
        if not written:
            return MOVE, None
        return "error", (f"the op writes into a 0-dim plain tensor on cpu, but computes on {target}: its result "
                         "cannot be written into a tensor on another device (a CPU scalar may only be read next to "
                         "tensors on another device)")
    return "error", (f"the plain operand is on {plain}, but the DTensor's local pieces are on {target}: expected all "
                     "tensors to be on the same device (as for plain tensors, only a 0-dim CPU tensor may meet "
                     "tensors on another device)")


def target_device(peer: DTensor, mesh: Any) -> torch.device:
    """Where the promoted operand's local piece must sit: next to the peer's, or on the mesh's device type."""
    if peer._spec.mesh is mesh or peer.device_mesh == mesh:
        return peer._local_tensor.device
    return torch.device(mesh.device_type)


def scalar_on(scalar: torch.Tensor, target: torch.device) -> torch.Tensor:
    """A 0-dim tensor on ``target`` with ``scalar``'s value and dtype, made without waiting for the device.

    ``scalar`` is a 0-dim CPU tensor. The value goes to the device as a kernel argument (``fill_`` reads a
    value on another device on the host), never through a blocking copy; the result is differentiable with
    respect to ``scalar``. Contract: no host-device synchronization on any device, one kernel launch.
    """
    return torch.empty((), dtype=scalar.dtype, device=target).fill_(scalar)


def on_mesh_device(operand: Operand, peer: DTensor, mesh: Any, traits: OpTraits) -> torch.Tensor:
    """``operand``'s tensor on the device its promoted local piece must sit on (moved only for a 0-dim
    CPU tensor, with :func:`scalar_on`), or a ``MixedOperandError`` saying why it cannot be."""
    plain = operand.tensor
    target = target_device(peer, mesh)
    verdict, why = device_decision(plain.device, plain.dim(), operand.written, target)
    if verdict == SAME:
        return plain
    if verdict == MOVE:
        return scalar_on(plain, target)
    raise promotion_error(
        traits.name, f"{why}; mesh {describe_mesh(mesh)}", operand_label=operand.label, operand=plain, peers=[peer],
        advice=f"Put the plain tensor on the mesh's device first ({operand.label}.to({str(target)!r}), or create it "
               "there); a DTensor's local piece never sits on another device than its mesh.",
        rule_advice=False,
    )

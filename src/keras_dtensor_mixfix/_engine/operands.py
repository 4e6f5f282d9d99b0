"""Stage 2, operands: find the tensors of one mixed call and describe the call to rules (a ``MixedCall``)."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch.distributed.tensor import DTensor

from .._rules.decisions import MixedCall, Operand
from .._rules.ops import OpTraits

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter  # plain too: ``type(p) is Parameter`` for an nn.Parameter that is no DTensor


def needs_promotion(value: object) -> bool:
    """Whether ``value`` is a plain tensor torch itself would reject next to a DTensor.

    The one definition of "a plain multi-element tensor": the dispatch rules (entry.py) act on a call
    only for such an operand, and the general path promotes only those it reads. A one-element plain
    tensor torch accepts as a scalar (except as the tensor an op writes into: see ``build_call``).

    Args:
        value: any argument of an op call.

    Returns:
        True for a tensor that is no DTensor and has other than one element.
    """
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.numel() != 1


def collect_operands(args: Sequence[Any], kwargs: Dict[str, Any], traits: OpTraits) -> List[Operand]:
    operands: List[Operand] = []
    for index, value in enumerate(args):
        _collect(operands, (index,), value, index in traits.written)
    for name, value in kwargs.items():
        _collect(operands, (name,), value, name in traits.written)
    return operands


def _collect(out: List[Operand], position: Tuple[Any, ...], value: Any, written: bool) -> None:
    if isinstance(value, torch.Tensor):
        out.append(Operand(position, value, not isinstance(value, DTensor), written))
    elif isinstance(value, (list, tuple)):
        for sub, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                out.append(Operand(position + (sub,), item, not isinstance(item, DTensor), written))


def build_call(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], operands: List[Operand]) -> MixedCall:
    peers = tuple(o.tensor for o in operands if not o.is_plain)
    meshes: List[Any] = []
    for peer in peers:
        mesh = peer.device_mesh  # type: ignore[attr-defined]
        if not any(mesh == known for known in meshes):
            meshes.append(mesh)
    # torch accepts one-element plain operands itself, except as the tensor an op writes into
    plain = tuple(o for o in operands if o.is_plain and (o.written or needs_promotion(o.tensor)))
    return MixedCall(func, args, kwargs, tuple(operands), plain, peers,  # type: ignore[arg-type]
                     meshes[0] if len(meshes) == 1 else None, tuple(meshes))


def no_tensors(kwargs: Dict[str, Any]) -> bool:
    for value in kwargs.values():
        if isinstance(value, _Tensor):
            return False
        if (type(value) is list or type(value) is tuple) and any(isinstance(item, _Tensor) for item in value):
            return False
    return True


def dtensors_in(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[DTensor]:
    found: List[DTensor] = []
    for value in list(args) + list(kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else [value]
        found.extend(item for item in items if isinstance(item, DTensor))
    return found

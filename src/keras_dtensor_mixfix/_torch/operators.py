"""Torch's operator objects and schemas, read through torch-private names.

``torch._ops`` holds the operator classes (``torch.ops.aten.mm.default`` is an ``OpOverload``,
``torch.ops.aten.mm`` an ``OpOverloadPacket``); ``torch._C`` the dispatcher's list of operator names
and the classes of schema argument types. None of them has a public name. The rules layer
(``_rules/ops.py``) reads operators only through this module.

Imports ``torch`` and nothing of ``torch.distributed``: registering a rule must not load DTensor.
Each name here is exercised by a self-check (``checks.check_op_names``, ``check_op_schema``,
``check_op_overload``).
"""

from __future__ import annotations

from typing import Any, Callable, List

import torch
from torch._ops import OpOverload, OpOverloadPacket

__all__ = [
    "OpOverload", "OpOverloadPacket", "TensorType", "ListType", "OptionalType", "all_op_names", "op_schema",
    "schema_of", "overload_name", "packet_qualname", "op_callable", "is_view_schema",
]

# The classes of a schema argument's ``type``: ``Tensor``, ``T[]`` and ``T?``. Read once: promotion
# tests argument types with isinstance while it scans every operator at patch time.
TensorType = torch._C.TensorType
ListType = torch._C.ListType
OptionalType = torch._C.OptionalType

_all_op_names: Callable[[], List[str]] | None = getattr(torch._C, "_dispatch_get_all_op_names", None)


def all_op_names() -> List[str]:
    """Every operator overload name the dispatcher knows so far (``aten::mul.Tensor``; ``aten::mm`` for a
    default overload); empty on a torch without the listing (callers then treat every namespace as unknown).

    ``torch._C._dispatch_get_all_op_names``, which lists every operator: not for the promotion path.
    """
    return [] if _all_op_names is None else list(_all_op_names())


def op_schema(name: str, overload: str) -> Any:
    """The ``FunctionSchema`` of ``name.overload`` (``"aten::add_"``, ``"Tensor"``; ``""`` for the default
    overload), looked up by name before any ``OpOverload`` exists; raises RuntimeError if there is none.

    ``torch._C._get_schema``.
    """
    return torch._C._get_schema(name, overload)


def schema_of(func: OpOverload) -> Any:
    """The ``FunctionSchema`` of an overload (``OpOverload._schema``): its ``name``, ``arguments``
    (each with ``name``, ``type``, ``alias_info``, ``kwarg_only``)."""
    return func._schema


def overload_name(func: OpOverload) -> str:
    """``"Tensor"`` for ``aten.mul.Tensor``, ``"default"`` for a default overload (``OpOverload._overloadname``)."""
    return func._overloadname


def packet_qualname(packet: OpOverloadPacket) -> str:
    """``"aten::mm"`` for ``torch.ops.aten.mm`` (``OpOverloadPacket._qualified_op_name``)."""
    return packet._qualified_op_name


def op_callable(func: OpOverload) -> Callable[..., Any]:
    """The C++ operator behind an overload (``OpOverload._op``): calling it skips the Python ``__call__``."""
    return func._op


def is_view_schema(schema: Any) -> bool:
    """Whether the op returns a view of an input (``FunctionSchema._is_view_op``)."""
    return bool(schema._is_view_op())

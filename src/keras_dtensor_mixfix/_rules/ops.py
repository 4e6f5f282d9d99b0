"""Operator naming and per-operator facts (which arguments are written, is it elementwise).

Everything here is pure schema inspection: no DTensor, no process group. Torch's operator classes,
its dispatcher's list of names and its schema type classes are private; they are read through
``_torch.operators``.
"""

from __future__ import annotations

import difflib
import functools
from typing import Any, Union

import torch

from .._torch.operators import (ListType, OpOverload, OpOverloadPacket, OptionalType, TensorType, all_op_names,
                                overload_name, packet_qualname, schema_of)
from .errors import ArgumentTypeError, UnknownOperatorError

OpLike = Union[str, OpOverload, OpOverloadPacket]

# Ops that torch does not tag ``pointwise`` but whose plain operands line up with the
# DTensor operand element by element, so the peer's sharding can be reused for them.
_ELEMENTWISE_EXTRA = frozenset({"aten::copy_", "aten::copy", "aten::lerp_", "aten::addcmul_", "aten::addcdiv_"})

# Fused optimizer kernels: like the ``_foreach_*`` ops, independent per list index ("row").
_FUSED_OPTIMIZERS = frozenset({"aten::_fused_adam_", "aten::_fused_adamw_", "aten::_fused_sgd_",
                               "aten::_fused_adagrad_"})


def _split_name(text: str) -> tuple[str, str, str | None]:
    """Split ``"aten::mm.default"`` / ``"aten.mm.default"`` / ``"aten::mm"`` into parts."""
    if "::" in text:
        namespace, _, rest = text.partition("::")
        name, _, overload = rest.partition(".")
    else:
        parts = text.split(".")
        if len(parts) not in (2, 3):
            raise UnknownOperatorError(
                f"cannot parse operator name {text!r}: expected 'namespace::name[.overload]' "
                "or 'namespace.name[.overload]', e.g. 'aten::mm.default' or 'aten.mm'"
            )
        namespace, name = parts[0], parts[1]
        overload = parts[2] if len(parts) == 3 else ""
    if not namespace or not name:
        raise UnknownOperatorError(f"cannot parse operator name {text!r}")
    return namespace, name, (overload or None)


def resolve_op(op: OpLike) -> OpOverload | OpOverloadPacket:
    """Return the ``OpOverload`` or ``OpOverloadPacket`` that ``op`` names.

    Raises :class:`ArgumentTypeError` (a ``TypeError``) for an object that is not an operator and
    :class:`UnknownOperatorError` (a ``ValueError``) for a name that does not parse or exist, so a typo
    never registers a rule that can never fire.
    """
    if isinstance(op, (OpOverload, OpOverloadPacket)):
        return op
    if not isinstance(op, str):
        raise ArgumentTypeError(
            f"op must be a torch OpOverload (torch.ops.aten.mm.default), an OpOverloadPacket "
            f"(torch.ops.aten.mm) or a name string ('aten::mm.default'); got {type(op).__name__}: {op!r}"
        )
    namespace, name, overload = _split_name(op.strip())
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError) as exc:
        known = namespace_ops(namespace)
        close = difflib.get_close_matches(f"{namespace}::{name}", known, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownOperatorError(
            f"operator {op!r} does not exist (no '{namespace}::{name}' is registered with torch){hint}") from exc
    if overload is None:
        return packet
    try:
        return getattr(packet, overload)
    except (AttributeError, RuntimeError) as exc:
        overloads = ", ".join(sorted(packet.overloads()))
        raise UnknownOperatorError(
            f"operator {op!r}: '{namespace}::{name}' has no overload {overload!r} (known overloads: {overloads})"
        ) from exc


def namespace_ops(namespace: str) -> list[str]:
    """Names (``ns::name``, no overload) of the operators registered in ``namespace`` so far.

    Reads the dispatcher's full list of operator names: for error messages and registration-time policy only.
    Empty on a torch without that listing (the namespace is then treated as unknown).
    """
    prefix = namespace + "::"
    return sorted({qualname.partition(".")[0] for qualname in all_op_names() if qualname.startswith(prefix)})


def pending_key(op: OpLike) -> str | None:
    """The registry key to hold a rule under when ``op`` names an operator that does not exist *yet*.

    The policy: a name in a namespace that has no operator yet (its library is not imported
    yet: custom ops are defined when their module is imported) may appear later, so a rule for it
    is held. A name in a namespace that already has operators (``aten``, or a library already
    loaded) must exist now: a missing one is a typo, and ``None`` tells the caller to raise.
    """
    if not isinstance(op, str):
        return None
    namespace, name, overload = _split_name(op.strip())
    if namespace_ops(namespace):
        return None
    return f"{namespace}::{name}" + (f".{overload}" if overload else "")


def op_key(op: OpOverload | OpOverloadPacket) -> str:
    """Canonical display/registry key: ``aten::mm.default`` for an overload, ``aten::mm`` for a packet."""
    if isinstance(op, OpOverload):
        return f"{schema_of(op).name}.{overload_name(op)}"
    return packet_qualname(op)


def packet_name(func: OpOverload) -> str:
    """``aten::mm`` for ``aten.mm.default``."""
    return schema_of(func).name


def _is_tensor_type(type_: Any) -> bool:
    """``Tensor`` or ``Tensor?``."""
    if isinstance(type_, OptionalType):
        type_ = type_.getElementType()
    return isinstance(type_, TensorType)


def has_two_tensor_inputs(schema: Any, arguments: Any = None) -> bool:
    """True when an op can receive a DTensor and a plain tensor in the same call: two tensor
    arguments, or any list of tensors. ``arguments`` is ``schema.arguments`` if the caller
    already has it (building that list is most of the cost when every op is scanned)."""
    count = 0
    for argument in schema.arguments if arguments is None else arguments:
        type_ = argument.type
        if isinstance(type_, ListType):
            if _is_tensor_type(type_.getElementType()):
                return True
        elif _is_tensor_type(type_):
            count += 1
    return count >= 2


@functools.lru_cache(maxsize=None)
def op_traits(func: OpOverload) -> "OpTraits":
    """Facts about ``func`` used by promotion; cached because they never change."""
    schema = schema_of(func)
    written: set[object] = set()
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written.add(argument.name if argument.kwarg_only else index)
    name = schema.name
    tags = set(func.tags)
    elementwise = torch.Tag.pointwise in tags or name in _ELEMENTWISE_EXTRA or name.startswith("aten::_foreach_")
    if not elementwise and name.endswith("_"):
        # In-place variants (add_) are not tagged; their functional twin (add) is.
        functional = getattr(getattr(torch.ops, name.split("::")[0]), name.split("::")[1][:-1], None)
        if functional is not None:
            twin = getattr(functional, overload_name(func), None)
            elementwise = twin is not None and torch.Tag.pointwise in set(twin.tags)
    lists = tuple(index for index, argument in enumerate(schema.arguments)
                  if not argument.kwarg_only and isinstance(argument.type, ListType))
    tensor_lists = tuple(index for index in lists if _is_tensor_type(schema.arguments[index].type.getElementType()))
    foreach = name.startswith("aten::_foreach_")
    return OpTraits(
        name=op_key(func),
        elementwise=elementwise,
        foreach=foreach,
        written=frozenset(written),
        lists=lists,
        tensor_lists=tensor_lists,
        row_wise=foreach or name in _FUSED_OPTIMIZERS,
    )


class OpTraits:
    """What promotion needs to know about one op overload."""

    __slots__ = ("name", "elementwise", "foreach", "written", "lists", "tensor_lists", "row_wise")

    def __init__(self, name: str, elementwise: bool, foreach: bool, written: frozenset[object],
                 lists: tuple[int, ...] = (), tensor_lists: tuple[int, ...] = (), row_wise: bool = False) -> None:
        self.name = name
        self.elementwise = elementwise
        self.foreach = foreach
        self.written = written
        self.lists = lists  # positions of the positional list arguments (tensors or scalars)
        self.tensor_lists = tensor_lists  # the Tensor[] ones among them
        # independent per list index (foreach ops, fused optimizers): rows on two meshes may run apart
        self.row_wise = row_wise

    def __repr__(self) -> str:
        return (f"OpTraits({self.name}, elementwise={self.elementwise}, foreach={self.foreach}, "
                f"written={set(self.written)})")

"""Errors raised by the promotion layer, with messages that say what to do."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

if TYPE_CHECKING:
    import torch
    from torch.distributed.tensor import DTensor


class MixedOperandError(RuntimeError):
    """A plain operand could not be promoted to a DTensor for an op.

    Subclasses ``RuntimeError`` because torch's own mixed-operand error is one, so code
    that caught torch's error keeps working.
    """


class ReplicationCheckError(MixedOperandError):
    """A promoted operand broke its rule's assumption on some ranks (``patch(check="raise")``).

    For example a ``"replicate"`` operand that differs between ranks (each rank's own batch).
    """


class ReplicationCheckWarning(UserWarning):
    """A promoted operand broke its rule's assumption on some ranks (``patch(check="warn")``)."""


def describe_tensor(tensor: "torch.Tensor") -> str:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return (
            f"DTensor shape {tuple(tensor.shape)} (local {tuple(tensor._local_tensor.shape)} on "
            f"{tensor._local_tensor.device}), "
            f"dtype {tensor.dtype}, placements {tuple(tensor.placements)}, mesh {describe_mesh(tensor.device_mesh)}"
        )
    return f"plain torch.Tensor shape {tuple(tensor.shape)}, dtype {tensor.dtype}, device {tensor.device}"


def describe_mesh(mesh: object) -> str:
    try:
        names = getattr(mesh, "mesh_dim_names", None)
        ids = mesh.mesh.tolist()  # type: ignore[attr-defined]
        device = mesh.device_type  # type: ignore[attr-defined]
        named = f", dims {tuple(names)}" if names else ""
        return f"DeviceMesh({device!r}, {ids}{named})"
    except Exception:  # a mesh we cannot introspect still gets a description
        return repr(mesh)


def promotion_error(
    op_name: str,
    reason: str,
    *,
    operand_label: Optional[str] = None,
    operand: Optional["torch.Tensor"] = None,
    peers: Iterable["DTensor"] = (),
    advice: Optional[str] = None,
    rule_advice: bool = True,
) -> MixedOperandError:
    """Build an error naming the op, the operand, shapes, placements and mesh, and the fix.

    ``rule_advice=False`` leaves out the generic "register a rule" advice (for errors in a rule itself).
    """
    lines = [f"keras_dtensor_mixfix: cannot run {op_name} with mixed torch.Tensor and DTensor operands: {reason}"]
    if operand is not None:
        lines.append(f"  plain operand {operand_label}: {describe_tensor(operand)}")
    for index, peer in enumerate(peers):
        lines.append(f"  DTensor operand #{index}: {describe_tensor(peer)}")
    packet = op_name.split(".")[0]
    if not rule_advice:
        lines.append(f"  what to do: {advice}")
        return MixedOperandError("\n".join(lines))
    lines.append(
        "  what to do: "
        + (advice + " Or " if advice else "")
        + f"register a rule for this op, e.g. keras_dtensor_mixfix.register_rule({op_name!r}, 'local') "
        f"(the operand is this rank's piece) or register_rule({packet!r}, my_rule) with a callable that returns "
        "a Decision per plain operand; or convert the operand yourself with DTensor.from_local / distribute_tensor."
    )
    return MixedOperandError("\n".join(lines))

"""Every exception the package raises, and the builder of promotion errors that say what to do.

All of them derive from :class:`MixfixError` (``except keras_dtensor_mixfix.MixfixError`` catches
anything the package raises on purpose) and also from the builtin exception the same failure
raised before the hierarchy existed, so ``except ValueError`` / ``except TypeError`` /
``except RuntimeError`` written against earlier releases still catch them::

    MixfixError
    |-- MixedOperandError (RuntimeError)        a plain operand could not be promoted for an op
    |   `-- ReplicationCheckError               patch(check="raise") found a broken assumption
    |-- UnsupportedTorchError (RuntimeError)    patch() on a torch outside the supported range
    |-- DeviceAssignmentError (RuntimeError)    two ranks of one host on one CUDA device (NCCL refuses)
    |-- IncompleteCheckpointError (FileNotFoundError)  checkpoint.load of a save that never finished
    |-- InvalidArgumentError (ValueError)       a value a public function cannot accept
    |   `-- UnknownOperatorError                an operator name that does not parse or exist
    `-- ArgumentTypeError (TypeError)           an argument of the wrong type

``keras_dtensor_mixfix.testing`` adds ``RankError`` and ``WorkerStartError`` (both RuntimeError), the
pytest plugin ``MarkerUsageError`` (a ``pytest.UsageError``). ``tests/unit/rules/test_errors.py`` fails on a
``raise`` of a bare builtin exception anywhere in the package, unless listed there with its reason.
Kept free of torch imports: the package root exports these without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterable, List, Mapping, Optional, Sequence

from .._torch.dtensor_attributes import local_tensor

if TYPE_CHECKING:
    import torch
    from torch.distributed.tensor import DTensor


class MixfixError(Exception):
    """Base of every exception keras_dtensor_mixfix raises.

    Each subclass also derives from the builtin exception it replaced (``RuntimeError``,
    ``ValueError``, ``TypeError``), so code written against either keeps working.
    """


class MixedOperandError(MixfixError, RuntimeError):
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


class UnsupportedTorchError(MixfixError, RuntimeError):
    """``patch()`` on a torch release outside the supported range (see
    :func:`keras_dtensor_mixfix._torch.versions.supported_range`), or on a newer one allowed by the
    opt-in whose self-check failed."""


class ReleaseLimitationError(MixfixError, RuntimeError):
    """A call the running torch release's DTensor cannot run and a later release runs (a view that folds a split dim
    on torch 2.11, say), refused before torch's own error: the message keeps torch's text and names the op, shapes,
    placements, mesh, the releases that run it and what to do on this one. Subclasses ``RuntimeError`` because
    torch's own refusal is one."""


class DeviceAssignmentError(MixfixError, RuntimeError):
    """Two or more ranks of one host compute on one CUDA device under NCCL (which refuses that with
    ``Duplicate GPU detected``), found where the Keras integration builds the process group or a mesh.

    ``ranks`` maps each shared device (``"cuda:0 on host h"``) to the ranks on it. Subclasses
    ``RuntimeError`` because NCCL's own error is one.
    """

    def __init__(self, message: str, ranks: Optional[Mapping[str, Sequence[int]]] = None) -> None:
        super().__init__(message)
        self.ranks: Dict[str, List[int]] = {device: list(on) for device, on in (ranks or {}).items()}


class SpreadValueError(MixfixError, RuntimeError):
    """``.numpy()`` or ``.tolist()`` of a DTensor whose value is spread over the ranks (split, or a partial sum):
    reading it takes a collective every rank must run (``full_tensor()``). Subclasses ``RuntimeError`` because
    torch's own refusal of these calls on a DTensor is one."""


class UnsupportedKerasError(MixfixError, RuntimeError):
    """``keras_integration.install()`` on a Keras outside the supported releases, or on a newer one allowed by
    the opt-in whose Keras self-check failed; Keras is left as it is. ``reason`` is the one line that says which
    Keras, the supported releases and what to do."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"keras_dtensor_mixfix.keras_integration.install(): {reason}")
        self.reason = reason


class KerasIntegrationNotInstalledError(MixfixError, RuntimeError):
    """A Keras integration function that works only with the integration installed, called without it (on a Keras
    release that needs it): the message names the function and says to call ``keras_integration.install()``."""


class IncompleteCheckpointError(MixfixError, FileNotFoundError):
    """``checkpoint.load`` of a folder that holds no complete checkpoint: a save into it began and did not finish (a
    rank died during it), or none was ever made there. The message names the save left unfinished, the complete
    checkpoints beside it, and what to do. Subclasses ``FileNotFoundError``: torch's own load raises that for a
    checkpoint without its ``.metadata``."""


class InvalidArgumentError(MixfixError, ValueError):
    """A public function got a value it cannot accept: an unknown rule name, a ``Decision`` that
    contradicts itself, a ``patch()`` option value out of range. The message names the argument
    and the values it accepts."""


class UnknownOperatorError(InvalidArgumentError):
    """An operator name that does not parse, or names no operator (or overload) torch has defined.

    ``register_rule`` raises it for a typo; a name in a namespace with no operator yet is held
    as a pending rule instead (see :func:`keras_dtensor_mixfix.register_rule`).
    """


class ArgumentTypeError(MixfixError, TypeError):
    """A public function got an argument of the wrong type (a rule that is neither a name, a
    ``Decision`` nor a callable; an ``op`` that is not an operator; an unknown ``patch()`` option)."""


def describe_tensor(tensor: "torch.Tensor") -> str:
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        local = local_tensor(tensor)
        return (
            f"DTensor shape {tuple(tensor.shape)} (local {tuple(local.shape)} on {local.device}), "
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
    except Exception:  # noqa: BLE001 - a mesh we cannot introspect still gets a description
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

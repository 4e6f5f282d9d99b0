"""The vocabulary of rules: what a rule may answer, and what a callable rule is shown."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .errors import ArgumentTypeError, InvalidArgumentError

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

    from .._torch.operators import OpOverload

REPLICATE = "replicate"
LOCAL = "local"
ERROR = "error"
RULE_NAMES = (REPLICATE, LOCAL, ERROR)

Position = Tuple[Union[int, str], ...]
"""Where an operand sits in the normalized call: ``(1,)`` is the second positional argument,
``(0, 3)`` the fourth element of a tensor-list first argument, ``("out",)`` a keyword."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """How to promote one plain operand.

    ``kind`` is ``"replicate"`` (the operand is the same whole tensor on every rank),
    ``"local"`` (it is this rank's piece of a larger tensor) or ``"error"``.
    ``placements`` overrides the placements the built-in logic would choose; ``shape`` gives
    the global shape of a ``"local"`` operand when it cannot be inferred (uneven shards);
    ``mesh`` picks the mesh when the DTensor operands do not agree on one.
    """

    kind: str
    placements: Optional[Sequence["Placement"]] = None
    shape: Optional[Sequence[int]] = None
    mesh: Optional["DeviceMesh"] = None

    def __post_init__(self) -> None:
        if self.kind not in RULE_NAMES:
            raise InvalidArgumentError(f"Decision kind must be one of {RULE_NAMES}, got {self.kind!r}")
        if self.shape is not None and self.kind != LOCAL:
            raise InvalidArgumentError("Decision(shape=...) only makes sense for kind='local'")
        # Stored as tuples: the dataclass is frozen, and a list the caller keeps must not change it later.
        if self.placements is not None:
            object.__setattr__(self, "placements", _checked_placements(self.placements))
        if self.shape is not None:
            object.__setattr__(self, "shape", _checked_shape(self.shape))


_PLACEMENTS_EXAMPLE = "e.g. placements=[Shard(0)] or [Replicate()] (from torch.distributed.tensor), one per mesh dim"


def _checked_placements(value: object) -> Tuple["Placement", ...]:
    """``Decision(placements=...)`` at construction: a non-empty sequence of torch ``Placement`` objects.

    What depends on the call (one per mesh dim, ``Shard`` dims inside the tensor) is checked when the
    decision is used, by :func:`check_decision`.
    """
    from torch.distributed.tensor.placement_types import Placement

    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ArgumentTypeError(f"Decision(placements=...) must be a list or tuple of torch Placement objects, "
                                f"{_PLACEMENTS_EXAMPLE}; got {type(value).__name__}: {value!r}")
    placements = tuple(value)
    if not placements:
        raise InvalidArgumentError(
            f"Decision(placements=...) is empty: give one placement per mesh dim, {_PLACEMENTS_EXAMPLE}")
    for index, placement in enumerate(placements):
        if not isinstance(placement, Placement):
            hint = ""
            if isinstance(placement, type) and issubclass(placement, Placement):
                hint = f" (the class itself; write {placement.__name__}(...), an instance)"
            raise ArgumentTypeError(
                f"Decision(placements=...): item {index} is {type(placement).__name__} {placement!r}{hint}, "
                f"not a torch Placement; {_PLACEMENTS_EXAMPLE}")
    return placements


def _checked_shape(value: object) -> Tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ArgumentTypeError(f"Decision(shape=...) must be the global shape as a sequence of ints, e.g. "
                                f"shape=(8, 4); got {type(value).__name__}: {value!r}")
    shape = tuple(value)
    for size in shape:
        # ints, or the symbolic sizes torch.compile traces with (not specialized here)
        if isinstance(size, bool) or not hasattr(size, "__index__") or (isinstance(size, int) and size < 0):
            raise ArgumentTypeError(
                f"Decision(shape=...) must hold non-negative ints, e.g. shape=(8, 4); got {value!r}")
    return shape


@dataclasses.dataclass(frozen=True)
class Operand:
    """One tensor operand of a mixed call."""

    position: Position
    tensor: "torch.Tensor"
    is_plain: bool
    written: bool

    @property
    def label(self) -> str:
        """Human-readable position, e.g. ``args[1]`` or ``args[0][3]`` or ``kwargs['out']``."""
        head, *rest = self.position
        text = f"args[{head}]" if isinstance(head, int) else f"kwargs[{head!r}]"
        return text + "".join(f"[{i}]" for i in rest)


@dataclasses.dataclass(frozen=True)
class MixedCall:
    """What a callable rule receives: one op call that mixes plain tensors and DTensors.

    ``plain`` lists the operands the rule must decide on (plain tensors torch itself would
    reject; one-element tensors are promoted by torch and are not listed). ``peers`` are the
    DTensor operands, ``mesh`` their common mesh (``None`` when they sit on different meshes;
    ``meshes`` then lists them).
    """

    op: "OpOverload"
    args: Tuple[Any, ...]
    kwargs: Mapping[str, Any]
    operands: Tuple[Operand, ...]
    plain: Tuple[Operand, ...]
    peers: Tuple["DTensor", ...]
    mesh: Optional["DeviceMesh"]
    meshes: Tuple["DeviceMesh", ...]

    def peer_for(self, operand: Operand) -> "DTensor":
        """The DTensor a plain operand is matched against (same list first, then same shape)."""
        return choose_peer(operand, self)


def choose_peer(operand: Operand, call: MixedCall) -> DTensor:
    """The DTensor whose sharding a plain operand is matched to.

    Preference: the DTensor at the same index of another list (foreach rows), then a DTensor in
    the same list (cat), then one of the same shape, then the first one.
    """
    return PeerIndex(call.operands).choose(operand)


class PeerIndex:
    """``choose_peer`` for every plain operand of one call in O(operands), not O(operands**2).

    Each table keeps the *first* peer (in operand order) for its key, which is exactly what
    the linear scans of the preference order would find.
    """

    __slots__ = ("peers", "by_row", "by_head")

    def __init__(self, operands: Sequence[Operand]) -> None:
        self.peers: List[DTensor] = []
        self.by_row: Dict[Any, DTensor] = {}
        self.by_head: Dict[Any, DTensor] = {}
        for other in operands:
            if other.is_plain:
                continue
            tensor = other.tensor
            self.peers.append(tensor)  # type: ignore[arg-type]
            if len(other.position) == 2:
                self.by_row.setdefault(other.position[1], tensor)  # type: ignore[arg-type]
            self.by_head.setdefault(other.position[0], tensor)  # type: ignore[arg-type]

    def choose(self, operand: Operand) -> DTensor:
        position = operand.position
        if len(position) == 2:
            found = self.by_row.get(position[1])
            if found is not None:
                return found
            found = self.by_head.get(position[0])
            if found is not None:
                return found
        # Shapes are compared, not hashed: while tracing they may hold symbolic sizes.
        shape = tuple(operand.tensor.shape)
        for peer in self.peers:
            if tuple(peer.shape) == shape:
                return peer
        return self.peers[0]


def check_decision(decision: Decision, op_name: str, operand: Operand, mesh: "DeviceMesh",
                   peers: Sequence["DTensor"] = ()) -> Decision:
    """Check ``decision.placements`` against the mesh the operand is promoted to and the operand.

    Called when a decision is used (its mesh and tensor are known only then): one placement per
    mesh dim, and every ``Shard(dim)`` inside the (global) tensor's dims. A negative ``Shard`` dim
    is normalized (as ``distribute_tensor`` does) and the decision returned with it; a decision
    without placements is returned as it is. Raises :class:`MixedOperandError` naming the op, the
    operand, the mesh and what to write instead.
    """
    placements = decision.placements
    if placements is None:
        return decision
    from torch.distributed.tensor.placement_types import Replicate, Shard

    from .._torch.api import is_exactly

    from .errors import describe_mesh, promotion_error

    tensor = operand.tensor
    ndim = len(decision.shape) if decision.shape is not None else tensor.dim()
    mesh_ndim = mesh.ndim

    def fail(reason: str, advice: str) -> Exception:
        return promotion_error(op_name, f"the rule's Decision({decision.kind!r}, placements={list(placements)}) "
                               f"{reason}", operand_label=operand.label, operand=tensor, peers=peers,
                               advice=advice, rule_advice=False)

    if decision.shape is not None and len(decision.shape) != tensor.dim():
        raise fail(f"gives shape={tuple(decision.shape)} ({len(decision.shape)} dims) for a {tensor.dim()}-D operand",
                   "Give the operand's global shape, with as many dims as the operand has.")
    if len(placements) != mesh_ndim:
        fixed = (list(placements) + [Replicate()] * mesh_ndim)[:mesh_ndim]
        raise fail(f"has {len(placements)} placement(s) for the {mesh_ndim}-D mesh {describe_mesh(mesh)}",
                   f"Give exactly one placement per mesh dim ({mesh_ndim}), e.g. "
                   f"Decision({decision.kind!r}, placements={fixed}); in a callable rule, "
                   "[Shard(0)] * call.mesh.ndim or [Replicate()] * call.mesh.ndim fit any mesh.")
    normalized = list(placements)
    for index, placement in enumerate(placements):
        dim = getattr(placement, "dim", None)
        if not isinstance(dim, int) or isinstance(dim, bool):
            continue
        if 0 <= dim < ndim:
            continue
        if -ndim <= dim < 0 and is_exactly(placement, Shard):
            normalized[index] = Shard(dim + ndim)
            continue
        valid = f"Shard(0) to Shard({ndim - 1})" if ndim > 0 else "no Shard at all (use Replicate())"
        raise fail(f"shards dim {dim} (placement {index}, mesh dim {index}), but the "
                   f"{'global' if decision.kind == LOCAL else 'whole'} tensor has {ndim} dim(s)",
                   f"Shard a dim the tensor has: {valid}.")
    if normalized != list(placements):
        return dataclasses.replace(decision, placements=tuple(normalized))
    return decision


RuleAnswer = Union[str, Decision, Mapping[Position, Union[str, Decision]], Sequence[Union[str, Decision]], None]
Rule = Union[str, Callable[[MixedCall], RuleAnswer]]


def as_decision(value: Union[str, Decision], where: str) -> Decision:
    """Normalize a rule's answer for one operand."""
    if isinstance(value, Decision):
        return value
    if isinstance(value, str):
        if value not in RULE_NAMES:
            raise InvalidArgumentError(
                f"{where}: unknown rule {value!r}; use one of {RULE_NAMES}, a Decision, or a callable")
        return Decision(value)
    raise ArgumentTypeError(
        f"{where}: a rule must answer 'replicate', 'local', 'error', a Decision, a mapping from operand "
        f"position to those, a sequence aligned with call.plain, or None; got {type(value).__name__}: {value!r}"
    )


def validate_rule(rule: object, where: str) -> Rule:
    """Check a rule at registration time so mistakes surface where they are made."""
    if isinstance(rule, str):
        if rule not in RULE_NAMES:
            raise InvalidArgumentError(f"{where}: unknown rule {rule!r}; use one of {RULE_NAMES} or a callable")
        return rule
    if isinstance(rule, Decision):
        return rule  # type: ignore[return-value]
    if callable(rule):
        return rule
    raise ArgumentTypeError(
        f"{where}: a rule must be 'replicate', 'local', 'error', a Decision, or a callable taking a MixedCall; "
        f"got {type(rule).__name__}: {rule!r}"
    )

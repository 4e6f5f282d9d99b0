"""Options accepted by ``patch()`` and ``patched()`` (their keyword-only parameters)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .decisions import REPLICATE, Rule, validate_rule
from .errors import ArgumentTypeError, InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class Options:
    """Effective settings while patched.

    ``default``: the rule for ops with no registration (``"replicate"``, ``"local"``,
    ``"error"`` or a callable). ``plain_grads``: give plain tensors that require grad a
    plain ``.grad`` (True, the single-process semantics) instead of the DTensor gradient
    promotion below autograd would leave there.
    """

    default: Rule = REPLICATE
    plain_grads: bool = True
    check: str = "off"
    """``"off"`` (default), ``"warn"`` or ``"raise"``: verify across ranks that each promoted operand fits its
    rule (a ``"replicate"`` operand identical on every rank, a ``"local"`` one shaped as its placements imply);
    one small collective per promoted operand and mesh dim."""
    direct: bool = True
    """Once DTensor's sharding propagation has shown that a shape of mixed call needs no redistribution,
    run later calls of that shape on the local tensors and wrap the result as DTensor does, skipping a second
    dispatch (the result is the same, bit for bit). ``False`` sends every promoted call through DTensor's
    dispatch again, e.g. to have a DTensor debug mode record each one."""

    def updated(self, **changes: Any) -> "Options":
        """A copy with ``changes`` applied, validated.

        An unknown name or a flag that is not a bool raises ``ArgumentTypeError`` (a ``TypeError``, as
        Python does for an unexpected keyword); a value out of range, ``InvalidArgumentError`` (a ``ValueError``).
        """
        known = {field.name for field in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ArgumentTypeError(f"patch() got unknown option(s) {unknown}; known options: {sorted(known)}")
        if "default" in changes:
            validate_rule(changes["default"], "patch(default=...)")
        for flag in ("plain_grads", "direct"):
            if flag in changes and not isinstance(changes[flag], bool):
                raise ArgumentTypeError(f"patch({flag}=...) must be a bool, got {changes[flag]!r}")
        if "check" in changes and changes["check"] not in ("off", "warn", "raise"):
            raise InvalidArgumentError(f"patch(check=...) must be 'off', 'warn' or 'raise', got {changes['check']!r}")
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

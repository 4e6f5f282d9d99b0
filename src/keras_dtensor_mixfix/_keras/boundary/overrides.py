"""The Keras integration as declared overrides, applied in one loop through one patch recorder.

Each module of the integration declares what it changes in Keras as :class:`Override` values: a name, a kind (and
for an op override its op family), the attributes it replaces, what it must come after, whether this Keras release
needs it, and the line ``keras_integration.report()`` shows for it. ``keras_integration.install()`` decides which
overrides this Keras needs (on Keras as it is, before any is applied), puts them in an order that respects
``after`` (:func:`in_order`) and applies each through one ``PatchRecorder``, so that ``uninstall()``
restores every replaced attribute exactly; install() also counts each override's records, so the restore test
can name the override behind each one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..._lifecycle.recorder import PatchRecorder
from ..._rules.errors import InvalidArgumentError


class Kind(enum.Enum):
    """What part of Keras an override changes."""

    BACKEND_PROTOCOL = "backend protocol"
    """The torch backend's protocol with the rest of Keras: ``distribution_lib``, value conversion, the promotion
    mode."""
    KERAS_OBJECTS = "Keras objects"
    """Keras' variables, layers, distributions, saving and tracebacks."""
    TRAIN_STEP = "train step"
    """The trainer: its step functions, their inputs, compiling them, the ``DistributedDataParallel`` wrap."""
    OPS = "ops"
    """A Keras backend op, by op family (:attr:`Override.family`)."""


def _always() -> bool:
    return True


@dataclass(frozen=True)
class Override:
    """One change the integration makes to Keras.

    Attributes:
        name: unique among the declared overrides; what ``after`` refers to.
        kind: what part of Keras it changes.
        owner: where the replaced attributes are: the :mod:`.keras_modules` accessors that give the owners (a
            rebound op: its module and every Keras module that imported it by name).
        attributes: the names it may replace there (the restore test checks each recorded one is declared).
        description: the line ``report()`` shows once it is applied.
        apply: replaces the attributes through the recorder it is given; returns the report line where it depends
            on what this Keras has (None: ``description``).
        after: names of overrides that must be applied first (an override wrapping what another installed).
        family: for :attr:`Kind.OPS`, the op family (as DTensor groups its op strategies).
        needed: whether this Keras release needs it, asked before any override is applied.
        kept: the line ``report()`` shows where it is not needed (None: no line).
        undo: what to forget at uninstall besides the recorded attributes (state kept per model or
            distribution), run after the recorder has restored them, newest first.
    """

    name: str
    kind: Kind
    owner: str
    attributes: Tuple[str, ...]
    description: str
    apply: Callable[[PatchRecorder], Optional[str]]
    after: Tuple[str, ...] = ()
    family: str = ""
    needed: Callable[[], bool] = field(default=_always)
    kept: Optional[str] = None
    undo: Optional[Callable[[], None]] = None

    def __post_init__(self) -> None:
        if (self.kind is Kind.OPS) != bool(self.family):
            raise InvalidArgumentError(f"override {self.name!r}: an op family is given for, and only for, op overrides")


def in_order(overrides: Sequence[Override]) -> List[Override]:
    """``overrides`` ordered so that each comes after those it names in ``after``; otherwise as declared.

    Raises:
        InvalidArgumentError: two overrides share a name, one names an unknown override, or the ``after`` lists
            form a cycle.
    """
    by_name: Dict[str, Override] = {}
    for override in overrides:
        if override.name in by_name:
            raise InvalidArgumentError(f"two overrides are named {override.name!r}")
        by_name[override.name] = override
    for override in overrides:
        unknown = [name for name in override.after if name not in by_name]
        if unknown:
            raise InvalidArgumentError(f"override {override.name!r} comes after unknown overrides {unknown}")
    ordered: List[Override] = []
    placed: set = set()
    waiting = list(overrides)
    while waiting:
        ready = next((o for o in waiting if all(name in placed for name in o.after)), None)
        if ready is None:
            raise InvalidArgumentError(f"the overrides {[o.name for o in waiting]} come after each other in a cycle")
        ordered.append(ready)
        placed.add(ready.name)
        waiting.remove(ready)
    return ordered

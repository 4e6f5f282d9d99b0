"""The Keras integration as declared overrides, applied in one loop through one patch recorder.

Each module of the integration declares what it changes in Keras as :class:`Override` values: a name, the attributes
it replaces, what it must come after, whether this release needs it, and the line ``keras_integration.report()`` shows
for it. What part of Keras an override changes is the folder of the module that declares it (``_keras/ops``: a Keras
op; ``_keras/step``: the trainer; ``_keras/backend``: the distribution_lib protocol; ``_keras/files``: saving and
callbacks); where it replaced attributes the patch recorder says. ``keras_integration.install()`` decides which
overrides this Keras needs (on Keras as it is, before any is applied), puts them in an order that respects
``after`` (:func:`in_order`) and applies each through one ``PatchRecorder``, so that ``uninstall()`` restores every
replaced attribute exactly; each record names the override that made it (``PatchRecorder.on_behalf_of``), so the
restore test can name the override behind each one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..._lifecycle.recorder import PatchRecorder
from ..._rules.errors import InvalidArgumentError


def _always() -> bool:
    return True


@dataclass(frozen=True)
class Override:
    """One change the integration makes to Keras.

    Attributes:
        name: unique among the declared overrides; what ``after`` refers to.
        attributes: the names it may replace there (the restore test checks each recorded one is declared).
        description: the line ``report()`` shows once it is applied.
        apply: replaces the attributes through the recorder it is given; returns the report line where it depends
            on what this Keras has (None: ``description``).
        after: names of overrides that must be applied first (an override wrapping what another installed).
        needed: whether this Keras (and torch) release needs it, asked before any override is applied; a
            workaround of an upstream defect asks the defect table (:mod:`.defects`).
        kept: the line ``report()`` shows where it is not needed (None: no line).
        undo: what to forget at uninstall besides the recorded attributes (state kept per model or
            distribution), run after the recorder has restored them, newest first.
    """

    name: str
    attributes: Tuple[str, ...]
    description: str
    apply: Callable[[PatchRecorder], Optional[str]]
    after: Tuple[str, ...] = ()
    needed: Callable[[], bool] = field(default=_always)
    kept: Optional[str] = None
    undo: Optional[Callable[[], None]] = None


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

"""The one patch recorder: every attribute the package replaces in torch or Keras goes through it.

Each replacement is recorded as ``(owner, name, previous, ours)`` and undone in reverse order.
``previous`` is read from the owner's own ``__dict__``, so a class attribute comes back as the
very descriptor it was (a ``staticmethod`` stays one) and an attribute the owner only inherited
is deleted, not set, making the inherited one visible again. An attribute is restored only if it
is still ours: if someone replaced it on top of us, a warning names it and it is left in place
(restoring ours would silently undo their patch). A second ``restore()`` does nothing. ``records()``
lists what is recorded, oldest first, each with the name of what made it (``on_behalf_of``).

Only an attribute that exists (held or inherited) is replaced unless ``create=True`` says the
package adds it on purpose: a Keras or torch release that renamed what we replace then fails at
install, naming it, and not later in a user's step.

Used by the Keras integration (``_keras``), the dispatch-rule holders (``intercept``) and the
torch.compile cache guard (``compile_cache``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterator, List, NamedTuple, Optional

from .._rules.errors import MixfixError

log = logging.getLogger("keras_dtensor_mixfix")


class MissingAttributeError(MixfixError, AttributeError):
    """``PatchRecorder.set`` was asked to replace an attribute (or dict entry) that does not exist."""


class _Missing:
    """The type of :data:`MISSING`."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()
"""What :class:`PatchRecorder` records for an attribute the owner did not hold itself."""


def current_value(owner: Any, name: str) -> Any:
    """What ``owner`` itself holds under ``name`` (not inherited): the dict entry, or ``MISSING``."""
    if isinstance(owner, dict):
        return owner.get(name, MISSING)
    if hasattr(owner, "__dict__"):
        return owner.__dict__.get(name, MISSING)
    return getattr(owner, name, MISSING)


def _describe(owner: Any, name: str) -> str:
    if isinstance(owner, dict):
        return f"{name!r} in a dict"
    owner_name = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or type(owner).__name__
    return f"{owner_name}.{name}"


def _exists(owner: Any, name: str) -> bool:
    """Whether ``owner`` has ``name``: held, inherited, or (a dict) a key."""
    if isinstance(owner, dict):
        return name in owner
    return hasattr(owner, name)


def _missing_text(owner: Any, name: str) -> str:
    if isinstance(owner, dict):
        return "the dict has no such key"
    owner_name = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or repr(owner)
    return f"{owner_name} has no attribute {name!r}"


class _Record(NamedTuple):
    owner: Any
    name: str
    previous: Any
    ours: Any
    label: str
    by: str


class Replacement(NamedTuple):
    """One replacement a :class:`PatchRecorder` holds (see :meth:`PatchRecorder.records`)."""

    owner: Any
    """The object, class, module or dict that was given the new value."""
    name: str
    """The attribute (or key) replaced."""
    previous: Any
    """What ``owner`` itself held under ``name`` before, or :data:`MISSING` (inherited, absent): what
    ``restore()`` puts back."""
    label: str
    """How warnings name it (the ``label`` given to ``set``, else ``Owner.name``)."""
    by: str = ""
    """What made it: the name given to :meth:`PatchRecorder.on_behalf_of` around the ``set`` ("" outside one)."""


class PatchRecorder:
    """Replaces attributes (or dict entries, e.g. in ``sys.modules``) and restores them exactly.

    The lock covers only the recorder's own list and the attribute writes; it never calls out.
    """

    def __init__(self) -> None:
        self._undo: List[_Record] = []
        self._lock = threading.Lock()
        self._by = ""

    def __len__(self) -> int:
        """How many replacements are recorded (and not restored yet)."""
        return len(self._undo)

    def records(self) -> List[Replacement]:
        """Every replacement recorded and not restored yet, oldest first (a copy: restoring does not change it)."""
        with self._lock:
            return [Replacement(r.owner, r.name, r.previous, r.label, r.by) for r in self._undo]

    @contextlib.contextmanager
    def on_behalf_of(self, name: str) -> Iterator[None]:
        """Within it, each replacement is recorded as made by ``name`` (:attr:`Replacement.by`); not nested."""
        self._by = name
        try:
            yield
        finally:
            self._by = ""

    def set(self, owner: Any, name: str, value: Any, *, label: Optional[str] = None, create: bool = False) -> None:
        """Set ``owner.name`` (``owner[name]`` for a dict) to ``value`` and record what it was.

        Args:
            owner: the object, class, module or dict that gets ``value``.
            name: the attribute (or key) replaced.
            value: what ``owner.name`` becomes.
            label: names the attribute in the warning ``restore()`` logs if it is no longer ours.
            create: allow ``owner.name`` not to exist yet (``restore()`` then deletes it).

        Raises:
            MissingAttributeError: ``owner`` has no ``name`` (held or inherited) and ``create`` is false;
                nothing is set.
        """
        if not create and not _exists(owner, name):  # checked before the lock: hasattr() may run a descriptor
            raise MissingAttributeError(
                f"keras_dtensor_mixfix: cannot replace {label or _describe(owner, name)}: {_missing_text(owner, name)} "
                f"(renamed or removed in the release in use?); nothing was replaced")
        with self._lock:
            previous = current_value(owner, name)
            if isinstance(owner, dict):
                owner[name] = value
            else:
                setattr(owner, name, value)
            self._undo.append(_Record(owner, name, previous, value, label or _describe(owner, name), self._by))

    def restore(self) -> List[str]:
        """Undo every replacement, newest first; returns the labels of those left (no longer ours)."""
        with self._lock:
            records, self._undo = self._undo, []
        left: List[str] = []
        for record in reversed(records):
            owner, name, previous = record.owner, record.name, record.previous
            if current_value(owner, name) is not record.ours:
                log.warning("keras_dtensor_mixfix: %s was replaced by someone else; left as it is", record.label)
                left.append(record.label)
                continue
            if isinstance(owner, dict):
                if previous is MISSING:
                    del owner[name]
                else:
                    owner[name] = previous
            elif previous is MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)
        return left

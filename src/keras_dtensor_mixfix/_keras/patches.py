"""Replaced attributes and ``sys.modules`` entries, restored in reverse order only where still ours."""

from __future__ import annotations

import logging
from typing import Any, List, Tuple

log = logging.getLogger("keras_dtensor_mixfix")

MISSING = object()


def _current(owner: Any, name: str) -> Any:
    if isinstance(owner, dict):
        return owner.get(name, MISSING)
    return owner.__dict__.get(name, MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, MISSING)


class Patches:
    """Records ``(owner, name, previous, ours)``; ``owner`` is an object or a dict (``sys.modules``)."""

    def __init__(self) -> None:
        self._undo: List[Tuple[Any, str, Any, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        previous = _current(owner, name)
        if isinstance(owner, dict):
            owner[name] = value
        else:
            setattr(owner, name, value)
        self._undo.append((owner, name, previous, value))

    def restore(self) -> None:
        while self._undo:
            owner, name, previous, ours = self._undo.pop()
            if _current(owner, name) is not ours:
                log.warning("keras_dtensor_mixfix: %s.%s was replaced by someone else; left as it is",
                            getattr(owner, "__name__", type(owner).__name__), name)
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


def rebind_everywhere(patches: Patches, original: Any, replacement: Any) -> None:
    """Replace a Keras function in every ``keras.*`` module that holds it by name (``from x import f``)."""
    import sys

    for name, module in list(sys.modules.items()):
        if (name == "keras" or name.startswith("keras.")) and getattr(module, original.__name__, None) is original:
            patches.set(module, original.__name__, replacement)

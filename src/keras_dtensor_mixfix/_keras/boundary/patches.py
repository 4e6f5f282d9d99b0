"""Rebinding a Keras function by name in every Keras module that imported it.

The replacements are recorded by the package's one patch recorder (``_lifecycle.recorder``), so
``uninstall()`` restores each module's binding exactly.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, cast

from ..._lifecycle.recorder import PatchRecorder


def rebind_everywhere(patches: PatchRecorder, original: Any, replacement: Any) -> None:
    """Replace a Keras function in every ``keras.*`` module that holds it by name (``from x import f``)."""
    for name, module in list(sys.modules.items()):
        if (name == "keras" or name.startswith("keras.")) and getattr(module, original.__name__, None) is original:
            patches.set(module, cast(Any, original).__name__, replacement)  # cast: `is` narrowed it to Any | None


@contextlib.contextmanager
def replaced_for_the_call() -> Iterator[PatchRecorder]:
    """A recorder whose replacements last for the ``with`` block (one save or load), restored exactly after it."""
    patches = PatchRecorder()
    try:
        yield patches
    finally:
        patches.restore()

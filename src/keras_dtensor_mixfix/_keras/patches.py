"""The Keras integration's patches: the package's one recorder, and rebinding a Keras function by name.

The recorder itself lives in ``_lifecycle.recorder`` (the dispatch-rule holders and the
torch.compile cache guard use it too); ``Patches`` is the name the Keras installers take it by.
"""

from __future__ import annotations

import sys
from typing import Any

from .._lifecycle.recorder import MISSING, PatchRecorder

Patches = PatchRecorder

__all__ = ["MISSING", "Patches", "PatchRecorder", "rebind_everywhere"]


def rebind_everywhere(patches: PatchRecorder, original: Any, replacement: Any) -> None:
    """Replace a Keras function in every ``keras.*`` module that holds it by name (``from x import f``)."""
    for name, module in list(sys.modules.items()):
        if (name == "keras" or name.startswith("keras.")) and getattr(module, original.__name__, None) is original:
            patches.set(module, original.__name__, replacement)

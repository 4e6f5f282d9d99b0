"""keras_dtensor_mixfix: run ops that mix plain ``torch.Tensor`` and ``DTensor`` operands.

``patch()`` makes every op that meets a DTensor and a plain tensor promote the plain one to
a DTensor on the op's mesh (replicated, matched to the peer's sharding, or taken as this
rank's local shard), following per-op rules you can extend with :func:`register_rule`.
``unpatch()`` restores torch exactly.

Names are imported on first use, so the ``torch.backends`` entry point that auto-activates
the package adds almost nothing to ``import torch``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Decision": "._decisions",
    "MixedCall": "._decisions",
    "Operand": "._decisions",
    "Rule": "._decisions",
    "MixedOperandError": "._errors",
    "Options": "._options",
    "current_options": "._patching",
    "is_patched": "._patching",
    "patch": "._patching",
    "patched": "._patching",
    "unpatch": "._patching",
    "RuleHandle": "._registry",
    "register_rule": "._registry",
    "reset_stats": "._stats",
    "stats": "._stats",
    "hookimpl": ".hookspecs",
    "UnsupportedTorchError": "._versions",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # what static type checkers and IDEs see
    from ._decisions import Decision, MixedCall, Operand, Rule
    from ._errors import MixedOperandError
    from ._options import Options
    from ._patching import current_options, is_patched, patch, patched, unpatch
    from ._registry import RuleHandle, register_rule
    from ._stats import reset_stats, stats
    from ._versions import UnsupportedTorchError
    from .hookspecs import hookimpl

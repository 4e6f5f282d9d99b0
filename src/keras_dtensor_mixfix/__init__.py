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
    "Decision": "._rules.decisions",
    "MixedCall": "._rules.decisions",
    "Operand": "._rules.decisions",
    "Rule": "._rules.decisions",
    "MixedOperandError": "._rules.errors",
    "Options": "._rules.options",
    "current_options": "._lifecycle.patching",
    "is_patched": "._lifecycle.patching",
    "patch": "._lifecycle.patching",
    "patched": "._lifecycle.patching",
    "unpatch": "._lifecycle.patching",
    "RuleHandle": "._rules.registry",
    "register_rule": "._rules.registry",
    "reset_stats": "._engine.stats",
    "stats": "._engine.stats",
    "hookimpl": "._rules.hookspecs",
    "UnsupportedTorchError": "._torch.versions",
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
    from ._rules.decisions import Decision, MixedCall, Operand, Rule
    from ._rules.errors import MixedOperandError
    from ._rules.options import Options
    from ._lifecycle.patching import current_options, is_patched, patch, patched, unpatch
    from ._rules.registry import RuleHandle, register_rule
    from ._engine.stats import reset_stats, stats
    from ._torch.versions import UnsupportedTorchError
    from ._rules.hookspecs import hookimpl

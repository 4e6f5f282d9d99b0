"""keras_dtensor_mixfix: run ops that mix plain ``torch.Tensor`` and ``DTensor`` operands.

``patch()`` makes every op that meets a DTensor and a plain tensor promote the plain one to
a DTensor on the op's mesh (replicated, matched to the peer's sharding, or taken as this
rank's local shard), following per-op rules you can extend with :func:`register_rule`.
``unpatch()`` restores torch exactly.
"""

from __future__ import annotations

from ._decisions import Decision, MixedCall, Operand, Rule
from ._errors import MixedOperandError
from ._options import Options
from ._patching import current_options, is_patched, patch, patched, unpatch
from ._registry import RuleHandle, register_rule
from ._stats import reset_stats, stats

__version__ = "0.1.0"

__all__ = [
    "Decision",
    "MixedCall",
    "MixedOperandError",
    "Operand",
    "Options",
    "Rule",
    "RuleHandle",
    "current_options",
    "is_patched",
    "patch",
    "patched",
    "register_rule",
    "reset_stats",
    "stats",
    "unpatch",
    "__version__",
]


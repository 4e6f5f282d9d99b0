"""keras_dtensor_mixfix: run ops that mix plain ``torch.Tensor`` and ``DTensor`` operands.

``patch()`` makes every op that meets a DTensor and a plain tensor promote the plain one to
a DTensor on the op's mesh (replicated, matched to the peer's sharding, or taken as this
rank's local shard), following per-op rules you can extend with :func:`register_rule`.
``unpatch()`` restores torch exactly. Every exception the package raises derives from
:class:`MixfixError` (and from the builtin it replaced: ``ValueError``, ``TypeError``, ``RuntimeError``).

Names are imported on first use, so the ``torch.backends`` entry point that auto-activates
the package adds almost nothing to ``import torch``.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing
import warnings as _warnings

__version__ = "0.1.0"

_EXPORTS = {
    "Decision": "._rules.decisions",
    "MixedCall": "._rules.decisions",
    "Operand": "._rules.decisions",
    "Rule": "._rules.decisions",
    "MixfixError": "._rules.errors",
    "MixedOperandError": "._rules.errors",
    "ReplicationCheckError": "._rules.errors",
    "ReplicationCheckWarning": "._rules.errors",
    "UnsupportedTorchError": "._rules.errors",
    "DeviceAssignmentError": "._rules.errors",
    "SpreadValueError": "._rules.errors",
    "ReleaseLimitationError": "._rules.errors",
    "UnsupportedKerasError": "._rules.errors",
    "KerasIntegrationNotInstalledError": "._rules.errors",
    "InvalidArgumentError": "._rules.errors",
    "IncompleteCheckpointError": "._rules.errors",
    "UnknownOperatorError": "._rules.errors",
    "ArgumentTypeError": "._rules.errors",
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
    "hookimpl": ".hookspecs",
}

# Names that moved: still found here for one release, with a DeprecationWarning naming the new home.
# Not in ``__all__`` (a star import does not warn) nor in ``dir()``.
_DEPRECATED = {
    "RankError": ("keras_dtensor_mixfix.testing", "it is raised by the testing helpers only"),
}

# Public submodules, reachable as attributes (``keras_dtensor_mixfix.testing.run_on_ranks``) without
# an import of their own; imported on first access.
_SUBMODULES = ("checkpoint", "hookspecs", "keras_integration", "layouts", "testing")

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> _typing.Any:
    moved = _DEPRECATED.get(name)
    if moved is not None:
        new_home, why = moved
        _warnings.warn(f"keras_dtensor_mixfix.{name} is deprecated and will be removed in the next release: import "
                       f"it from {new_home} ({why})", DeprecationWarning, stacklevel=2)
        return getattr(_importlib.import_module(new_home), name)  # not cached here: every use warns
    module_name = _EXPORTS.get(name)
    if module_name is None:
        if name in _SUBMODULES:
            return _importlib.import_module(f"{__name__}.{name}")  # the import binds it here too
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module_name, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    # The public names and the module's dunders; not the helpers this file itself uses.
    return sorted({name for name in globals() if name.startswith("__")} | set(__all__) | set(_SUBMODULES))


if _typing.TYPE_CHECKING:  # what static type checkers and IDEs see
    # Unused at run time on purpose: these imports are the lazy exports, shown to type checkers. Each is imported
    # ``as`` itself: an explicit re-export, which type checkers in strict mode (no implicit re-export) accept.
    from . import checkpoint as checkpoint, hookspecs as hookspecs, keras_integration as keras_integration
    from . import layouts as layouts, testing as testing
    from ._rules.decisions import Decision as Decision, MixedCall as MixedCall, Operand as Operand, Rule as Rule
    from ._rules.errors import ArgumentTypeError as ArgumentTypeError, DeviceAssignmentError as DeviceAssignmentError
    from ._rules.errors import IncompleteCheckpointError as IncompleteCheckpointError
    from ._rules.errors import InvalidArgumentError as InvalidArgumentError
    from ._rules.errors import KerasIntegrationNotInstalledError as KerasIntegrationNotInstalledError
    from ._rules.errors import MixedOperandError as MixedOperandError, MixfixError as MixfixError
    from ._rules.errors import ReleaseLimitationError as ReleaseLimitationError
    from ._rules.errors import ReplicationCheckError as ReplicationCheckError
    from ._rules.errors import ReplicationCheckWarning as ReplicationCheckWarning
    from ._rules.errors import SpreadValueError as SpreadValueError, UnknownOperatorError as UnknownOperatorError
    from ._rules.errors import UnsupportedKerasError as UnsupportedKerasError
    from ._rules.errors import UnsupportedTorchError as UnsupportedTorchError
    from ._rules.options import Options as Options
    from ._lifecycle.patching import current_options as current_options, is_patched as is_patched
    from ._lifecycle.patching import patch as patch, patched as patched, unpatch as unpatch
    from ._rules.registry import RuleHandle as RuleHandle, register_rule as register_rule
    from ._engine.stats import reset_stats as reset_stats, stats as stats
    from .hookspecs import hookimpl as hookimpl

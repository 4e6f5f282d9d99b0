"""The patch state the engine reads: written by the lifecycle layer, read on every promotion.

Kept here (not in the lifecycle) so the engine never imports the layer above it.
"""

from __future__ import annotations

from .._rules.options import Options

_options: Options = Options()
_active = False


def options() -> Options:
    """The options in force (only meaningful while patched)."""
    return _options


def is_active() -> bool:
    """True while the patch is installed."""
    return _active


def set_state(active: bool, options_in_force: Options) -> None:
    """Called by the lifecycle layer whenever the patch or its options change."""
    global _options, _active
    _options = options_in_force
    _active = active

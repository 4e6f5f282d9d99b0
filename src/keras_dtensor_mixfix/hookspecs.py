"""Hook specifications for rule packs (pluggy); packs implement them with :data:`hookimpl`.

A pack is a module or object exposed under the ``keras_dtensor_mixfix`` entry-point group::

    # pyproject.toml of a pack
    [project.entry-points.keras_dtensor_mixfix]
    flash = "my_pack.rules"

    # my_pack/rules.py
    from keras_dtensor_mixfix import hookimpl

    @hookimpl
    def register_rules(register):
        register("flash_attn::fwd", "replicate")

This is the one definition of the specs and markers (``keras_dtensor_mixfix.hookimpl`` is this
module's :data:`hookimpl`). It imports nothing of the package, so the rule packs' loader
(:mod:`keras_dtensor_mixfix._rules.packs`, a lower layer) imports it without importing upward.
"""

from __future__ import annotations

from typing import Any, Callable

import pluggy

__all__ = ["PROJECT", "hookimpl", "hookspec", "register_rules"]

PROJECT = "keras_dtensor_mixfix"
"""The pluggy project name, also the entry-point group packs are found under."""

hookspec = pluggy.HookspecMarker(PROJECT)
"""Marks a hook specification of this project."""

hookimpl = pluggy.HookimplMarker(PROJECT)
"""Marks a pack's implementation of a hook (``@hookimpl def register_rules(register): ...``)."""


@hookspec
def register_rules(register: Callable[[Any, Any], Any]) -> None:
    """Register rules by calling ``register(op, rule)`` (same arguments as ``register_rule``)."""

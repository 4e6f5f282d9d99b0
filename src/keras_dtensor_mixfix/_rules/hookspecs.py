"""Hook specifications for rule packs (pluggy). Packs implement them with :data:`hookimpl`.

A pack is a module or object exposed under the ``keras_dtensor_mixfix`` entry-point group::

    # pyproject.toml of a pack
    [project.entry-points.keras_dtensor_mixfix]
    flash = "my_pack.rules"

    # my_pack/rules.py
    from keras_dtensor_mixfix import hookimpl

    @hookimpl
    def register_rules(register):
        register("flash_attn::fwd", "replicate")
"""

from __future__ import annotations

from typing import Any, Callable

import pluggy

PROJECT = "keras_dtensor_mixfix"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_rules(register: Callable[[Any, Any], Any]) -> None:
    """Register rules by calling ``register(op, rule)`` (same arguments as ``register_rule``)."""

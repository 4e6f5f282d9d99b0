"""Hook specifications for rule packs (pluggy); see :mod:`keras_dtensor_mixfix._rules.hookspecs`.

A pack implements :func:`register_rules` with :data:`hookimpl`::

    from keras_dtensor_mixfix import hookimpl

    @hookimpl
    def register_rules(register):
        register("flash_attn::fwd", "replicate")
"""

from ._rules.hookspecs import PROJECT, hookimpl, hookspec, register_rules

__all__ = ["PROJECT", "hookimpl", "hookspec", "register_rules"]

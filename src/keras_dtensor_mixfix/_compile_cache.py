"""Keep torch.compile's caches from reusing a graph traced under other rules.

torch.compile's on-disk caches key a graph by the dynamo graph, which does not show what our
dispatch rule did while tracing. We add a fingerprint of the rules in force to
``torch.compiler.config.cache_key_tag`` while patched and put the previous tag back on unpatch.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Iterable, Optional

log = logging.getLogger(__name__)

_MARK = "keras_dtensor_mixfix:"


def _describe(rule: Any) -> str:
    if isinstance(rule, str):
        return rule
    name = getattr(rule, "__qualname__", None) or type(rule).__qualname__
    return f"{getattr(rule, '__module__', '?')}.{name}:{rule!r}" if not callable(rule) else f"{getattr(rule, '__module__', '?')}.{name}"


def fingerprint(options: Any, entries: Iterable[Any]) -> str:
    parts = [f"default={_describe(options.default)}", f"plain_grads={options.plain_grads}"]
    parts += [f"{entry.op}={_describe(entry.rule)}" for entry in entries]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def _config() -> Optional[Any]:
    import torch

    config = getattr(getattr(torch, "compiler", None), "config", None)
    return config if config is not None and hasattr(config, "cache_key_tag") else None


def set_tag(base: str, digest: str) -> Optional[str]:
    """Set the tag to ``base`` plus our fingerprint; returns what we set (None if unsupported)."""
    config = _config()
    if config is None:
        return None
    tag = f"{base}|{_MARK}{digest}" if base else f"{_MARK}{digest}"
    config.cache_key_tag = tag
    return tag


def current_tag() -> Optional[str]:
    config = _config()
    return None if config is None else config.cache_key_tag


def restore_tag(ours: Optional[str], previous: Optional[str]) -> None:
    config = _config()
    if config is None or ours is None:
        return
    if config.cache_key_tag == ours:
        config.cache_key_tag = previous
    else:
        log.warning("torch.compiler.config.cache_key_tag was changed by someone else while patched; left as %r",
                    config.cache_key_tag)

"""Configuration from environment variables; a malformed value warns and falls back, never raises."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import TYPE_CHECKING, Mapping, Optional, Set, Tuple

if TYPE_CHECKING:
    from .options import Options

log = logging.getLogger("keras_dtensor_mixfix")

ENABLE = "KERAS_DTENSOR_MIXFIX"
"""``0``/``false``/``off``/``no`` turns auto-activation off (default: on)."""
PREFIX = "KERAS_DTENSOR_MIXFIX_"
"""``KERAS_DTENSOR_MIXFIX_<OPTION>`` sets a ``patch()`` option, e.g. ``KERAS_DTENSOR_MIXFIX_DEFAULT=local``."""
DISABLE_PACKS = "KERAS_DTENSOR_MIXFIX_DISABLE_PACKS"
"""Comma-separated names of rule packs not to load (``*`` for all third-party packs)."""

ALLOW_NEWER_TORCH = "KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH"
"""``1`` lets the package run on a torch newer than the newest tested one if its self-check passes
(``patch(allow_newer_torch=True)`` for one call)."""

ALLOW_NEWER_KERAS = "KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_KERAS"
"""``1`` lets the Keras integration install into a Keras newer than the newest tested one if the Keras
self-check passes (``keras_integration.install(allow_newer_keras=True)`` for one call)."""

KERAS_COMPILE_UNIT = "KERAS_DTENSOR_MIXFIX_COMPILE_UNIT"
"""``layer`` (default) or ``step``: what Keras' ``jit_compile=True`` compiles under a distribution, each distinct
repeated block once or the whole step (``keras_integration.set_compile_unit`` for one process)."""

KERAS_BLOCK_TRACER = "KERAS_DTENSOR_MIXFIX_BLOCK_TRACER"
"""``dynamo`` (default) or ``aot``: how ``jit_compile=True`` traces each repeated block under a distribution,
``torch.compile`` (TorchDynamo) or AOTAutograd alone, once per input signature (``_keras/step/block_tracer.py``)."""

COLLECTIVE_TIMEOUT = "KERAS_DTENSOR_MIXFIX_COLLECTIVE_TIMEOUT"
"""Seconds a collective of a process group the package creates (``keras.distribution.initialize()`` on Keras 3.12 to
3.15) waits for every rank before it raises (``keras_integration.set_collective_timeout`` for one process)."""

DTENSORS_ON_ONE_DEVICE = "KERAS_DTENSOR_MIXFIX_DTENSORS_ON_ONE_DEVICE"
"""``1`` keeps DTensors on a ``keras.distribution`` mesh of one device in a one-process job, where by default its
variables and batches are plain tensors (every layout of one device is the whole tensor; DTensor's dispatch would
only add host time): for checking the DTensor path on one GPU (``benchmarks/gpu_check.py``)."""

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NOT_OPTIONS = {DISABLE_PACKS, ALLOW_NEWER_TORCH, ALLOW_NEWER_KERAS, KERAS_COMPILE_UNIT, KERAS_BLOCK_TRACER,
                COLLECTIVE_TIMEOUT, DTENSORS_ON_ONE_DEVICE}

_warned: Set[Tuple[str, ...]] = set()
_warned_lock = threading.Lock()


def warn_once(key: Tuple[str, ...], message: str, *args: object) -> None:
    """Log ``message`` at WARNING once per process for each ``key`` (a malformed variable's value, the version
    gates' one line about a newer release)."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(message, *args)


def _warn_once(name: str, raw: str, message: str, *args: object) -> None:
    """Log ``message`` once per process for each (variable, value): the environment is read again at
    auto-activation, at every ``patch()`` and by ``current_options()``, and one bad value is one mistake."""
    warn_once((name, raw), message, *args)


def _parse_bool(name: str, raw: str, fallback: str) -> Optional[bool]:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    _warn_once(name, raw, "keras_dtensor_mixfix: ignoring %s=%r: expected one of %s; %s", name, raw,
               sorted(_TRUE | _FALSE), fallback)
    return None


def auto_activation_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    raw = environ.get(ENABLE)
    if raw is None or raw.strip() == "":
        return True
    parsed = _parse_bool(ENABLE, raw, "auto-activation stays on (the default)")
    return True if parsed is None else parsed


def _opted_in(name: str, environ: Mapping[str, str], fallback: str) -> bool:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return False
    return bool(_parse_bool(name, raw, fallback))


def allow_newer_torch(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH`` opts in to a torch newer than the newest tested one."""
    return _opted_in(ALLOW_NEWER_TORCH, environ, "a newer torch stays refused (the default)")


def allow_newer_keras(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_KERAS`` opts in to a Keras newer than the newest tested one."""
    return _opted_in(ALLOW_NEWER_KERAS, environ, "a newer Keras stays refused (the default)")


def dtensors_on_one_device(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``KERAS_DTENSOR_MIXFIX_DTENSORS_ON_ONE_DEVICE`` keeps DTensors on a one-device mesh."""
    return _opted_in(DTENSORS_ON_ONE_DEVICE, environ, "a one-device mesh holds plain tensors (the default)")


def collective_timeout_s(environ: Mapping[str, str] = os.environ) -> Optional[float]:
    """``KERAS_DTENSOR_MIXFIX_COLLECTIVE_TIMEOUT`` in seconds (a positive number), or None where it is unset or
    malformed (which warns once)."""
    raw = environ.get(COLLECTIVE_TIMEOUT)
    if raw is None or raw.strip() == "":
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        _warn_once(COLLECTIVE_TIMEOUT, raw, "keras_dtensor_mixfix: ignoring %s=%r: expected a number of seconds above "
                   "0; using the default", COLLECTIVE_TIMEOUT, raw)
        return None
    return seconds


def options_from_env(environ: Mapping[str, str] = os.environ) -> Tuple["Options", dict]:
    """Options with environment overrides applied, and ``{option: variable}`` for those that were."""
    from .options import Options

    options = Options()
    fields = {field.name: field for field in dataclasses.fields(Options)}
    sources = {}
    for name, raw in environ.items():
        if not name.startswith(PREFIX) or name in _NOT_OPTIONS:
            continue
        option = name[len(PREFIX):].lower()
        if option not in fields:
            _warn_once(name, raw, "keras_dtensor_mixfix: ignoring unknown variable %s; known: %s", name,
                       ", ".join([PREFIX + f.upper() for f in fields] + sorted(_NOT_OPTIONS)))
            continue
        current = getattr(options, option)
        value: object = raw.strip()
        if isinstance(current, bool):
            value = _parse_bool(name, raw, f"using {option}={current!r}")
            if value is None:
                continue
        try:
            options = options.updated(**{option: value})
        except (TypeError, ValueError) as exc:
            _warn_once(name, raw, "keras_dtensor_mixfix: ignoring %s=%r (%s); using %s=%r", name, raw, exc, option,
                       current)
            continue
        sources[option] = name
    return options, sources


def disabled_packs(environ: Mapping[str, str] = os.environ) -> set:
    raw = environ.get(DISABLE_PACKS, "")
    return {part.strip() for part in raw.split(",") if part.strip()}

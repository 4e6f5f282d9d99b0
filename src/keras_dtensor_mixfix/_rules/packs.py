"""Rule packs: pluggy plugins from the ``keras_dtensor_mixfix`` entry-point group, plus the built-in one.

Packs load lazily (first ``patch()``) and once. A pack that fails to import or raises while
registering is logged and skipped; ``KERAS_DTENSOR_MIXFIX_DISABLE_PACKS`` names packs to skip.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, List, Optional

from ..hookspecs import PROJECT

log = logging.getLogger("keras_dtensor_mixfix")

ENTRY_POINT_GROUP = PROJECT
BUILTIN = "builtin"


@dataclasses.dataclass
class PackRecord:
    """What happened to one pack."""

    name: str
    origin: str
    status: str = "pending"  # loaded / failed / disabled
    error: Optional[str] = None
    rules: List[Any] = dataclasses.field(default_factory=list)


_lock = threading.Lock()  # guards the fields below; never held while a pack's code runs
_loaded = False
_loader: Optional[int] = None  # the thread loading the packs, until they have all run
_finished = threading.Event()
_records: List[PackRecord] = []
_manager: Optional[Any] = None


def _entry_points() -> List[Any]:
    from importlib.metadata import entry_points

    return list(entry_points(group=ENTRY_POINT_GROUP))


def plugin_manager() -> Any:
    global _manager
    if _manager is None:
        import pluggy

        from .. import hookspecs
        manager = pluggy.PluginManager(PROJECT)
        manager.add_hookspecs(hookspecs)
        _manager = manager
    return _manager


def load_packs() -> List[PackRecord]:
    """Load and run every pack once; later calls return the records.

    A call from another thread while the packs load waits until they have all run, so a ``patch()``
    never starts without their rules. No lock is held while a pack's code runs (its import, its
    hook); a hook that waits on another thread's ``patch()`` would still wait forever on itself.
    """
    global _loaded, _loader
    with _lock:
        first = not _loaded
        loading_here = _loader == threading.get_ident()
        if first:
            _loaded, _loader = True, threading.get_ident()
    if not first:
        if not loading_here:  # a hook of this thread's load that loads again does not wait on itself
            _finished.wait()
        return pack_records()
    try:
        _load_and_run()
    finally:
        with _lock:
            _loader = None
        _finished.set()
    return pack_records()


def _load_and_run() -> None:
    """Register the built-in pack and each entry point's with pluggy, then run their hooks."""
    from . import builtin_pack as _builtin_pack
    from .env import disabled_packs

    disabled = disabled_packs()
    manager = plugin_manager()
    candidates: List[PackRecord] = []
    builtin = PackRecord(BUILTIN, f"{_builtin_pack.__name__} (built in)")
    if BUILTIN in disabled:
        builtin.status = "disabled"
    else:
        manager.register(_builtin_pack, name=BUILTIN)
        candidates.append(builtin)
    _add_record(builtin)
    for entry_point in _entry_points():
        dist = getattr(entry_point, "dist", None)
        origin = f"{entry_point.value}" + (f" ({dist.name} {dist.version})" if dist is not None else "")
        record = PackRecord(entry_point.name, origin)
        _add_record(record)
        if entry_point.name in disabled or "*" in disabled:
            record.status = "disabled"
            log.info("keras_dtensor_mixfix: rule pack %r disabled by environment", entry_point.name)
            continue
        try:
            plugin = entry_point.load()
            manager.register(plugin, name=entry_point.name)
        except Exception as exc:  # noqa: BLE001 - one bad pack never stops the rest
            record.status, record.error = "failed", f"{type(exc).__name__}: {exc}"
            log.warning("keras_dtensor_mixfix: rule pack %r failed to load and is skipped: %s", entry_point.name,
                        record.error)
            continue
        candidates.append(record)
    for record in candidates:
        _run_pack(manager, record)


def _add_record(record: PackRecord) -> None:
    with _lock:
        _records.append(record)


def _run_pack(manager: Any, record: PackRecord) -> None:
    from .registry import registry

    def register(op: Any, rule: Any) -> Any:
        handle = registry.register(op, rule, source=f"pack:{record.name}")
        record.rules.append(handle)
        return handle

    impls = [impl for impl in manager.hook.register_rules.get_hookimpls() if impl.plugin_name == record.name]
    try:
        for impl in impls:
            impl.function(register=register)
    except Exception as exc:  # noqa: BLE001 - a pack that raises is skipped, the others still run
        for handle in record.rules:  # a pack that raised leaves nothing half-registered
            handle.remove()
        record.rules.clear()
        record.status, record.error = "failed", f"{type(exc).__name__}: {exc}"
        log.warning("keras_dtensor_mixfix: rule pack %r raised while registering and is skipped: %s", record.name,
                    record.error)
        return
    record.status = "loaded"


def pack_records() -> List[PackRecord]:
    with _lock:
        return list(_records)


def _reset_for_tests() -> None:
    """Unload every pack (its rules too) so a test can load again."""
    global _loaded, _manager
    with _lock:
        for record in _records:
            for handle in record.rules:
                handle.remove()
        _records.clear()
        _loaded = False
        _manager = None
        _finished.clear()

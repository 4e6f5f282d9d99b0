"""Counts of promotions per op and decision, and a log line the first time each op is promoted."""

from __future__ import annotations

import logging
import threading
from typing import Dict, Iterable, Set, Tuple

log = logging.getLogger("keras_dtensor_mixfix")

_counts: Dict[Tuple[str, str], int] = {}  # a plain dict: cheaper to update than a Counter
_seen_ops: Set[str] = set()
_lock = threading.Lock()


def record(op: str, kinds: Iterable[str]) -> None:
    with _lock:
        for kind in kinds:
            _counts[(op, kind)] = _counts.get((op, kind), 0) + 1
        first = op not in _seen_ops
        if first:
            _seen_ops.add(op)
    if first:
        log.info("promoted plain operand(s) of %s (%s); further promotions of this op are counted in stats()",
                 op, ", ".join(sorted(set(kinds))))


def record_key(key: Tuple[str, str]) -> None:
    """``record(op, [kind])`` for one promotion, ``key`` being ``(op, kind)``: the fast path's version."""
    _lock.acquire()
    try:
        _counts[key] = _counts.get(key, 0) + 1
        if key[0] in _seen_ops:
            return
        _seen_ops.add(key[0])
    finally:
        _lock.release()
    log.info("promoted plain operand(s) of %s (%s); further promotions of this op are counted in stats()", *key)


def stats() -> Dict[str, Dict[str, int]]:
    """Promotions since patch() or the last reset_stats(): ``{op: {decision: count}}``."""
    with _lock:
        result: Dict[str, Dict[str, int]] = {}
        for (op, kind), count in sorted(_counts.items()):
            result.setdefault(op, {})[kind] = count
        return result


def reset_stats() -> None:
    """Forget the counts (and log the first promotion of each op again)."""
    with _lock:
        _counts.clear()
        _seen_ops.clear()

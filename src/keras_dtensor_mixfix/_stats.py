"""Counts of promotions per op and decision, and a log line the first time each op is promoted."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Dict, Iterable, Tuple

log = logging.getLogger("keras_dtensor_mixfix")

_counts: "Counter[Tuple[str, str]]" = Counter()
_seen_ops: set = set()
_lock = threading.Lock()


def record(op: str, kinds: Iterable[str]) -> None:
    with _lock:
        for kind in kinds:
            _counts[(op, kind)] += 1
        first = op not in _seen_ops
        if first:
            _seen_ops.add(op)
    if first:
        log.info("promoted plain operand(s) of %s (%s); further promotions of this op are counted in stats()",
                 op, ", ".join(sorted(set(kinds))))


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

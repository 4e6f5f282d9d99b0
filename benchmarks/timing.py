"""Timing helpers shared by the benchmark cases: batches of calls with the collector off, rounds."""

from __future__ import annotations

import gc
import socket
import statistics
import time
from typing import Any, Callable, Dict, List


SHAPE = (64, 64)




def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def timed(fn: Callable[[], Any], calls: int) -> float:
    """Microseconds per call of ``fn`` over ``calls`` calls, GC off (as timeit does)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
    finally:
        if enabled:
            gc.enable()
    return elapsed / calls * 1e6


def summary(values: List[float]) -> Dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "n": len(values)}


class Rounds:
    """Collects per-round figures for named cases."""

    def __init__(self) -> None:
        self.samples: Dict[str, List[float]] = {}

    def add(self, name: str, value: float) -> None:
        self.samples.setdefault(name, []).append(value)

    def stat(self, name: str) -> Dict[str, float]:
        return summary(self.samples[name])


# ----------------------------------------------------------------------------- per-op cases

"""A switch that is on for the duration of a ``with`` block, in the thread that entered it."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class ThreadSwitch:
    """Off unless this thread is inside :meth:`on`'s block; blocks nest (leaving an inner one keeps it on)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __bool__(self) -> bool:
        return bool(getattr(self._local, "on", False))

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        previous = bool(self)
        self._local.on = True
        try:
            yield
        finally:
            self._local.on = previous

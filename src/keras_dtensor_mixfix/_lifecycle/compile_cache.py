"""Keeps graphs traced with a promotion out of torch.compile's caches, and out of use after a change.

A graph that contains a promotion is only right under the rules it was traced with. Dynamo keys
its graphs by the Python code, and AOTAutograd's on-disk cache by the dynamo graph, neither of
which shows what a dispatch rule did below them. So: while patched, ``AOTAutogradCache.save``
skips the compilations that promoted (a program that never promotes is cached exactly as before),
and when the patch or its rules change after such a compilation, dynamo's in-memory caches are
reset so those functions recompile under the new state (after ``unpatch()``: torch's own
mixed-operand error again).

The engine notes the compilations that promoted (``_engine.context.traced_promotions``); this
module owns the ``save`` swap, through the package's one patch recorder. The swap waits for the
first compilation that promotes, unless torch.compile's cache module is already imported: importing
it imports TorchDynamo and inductor (about a second, and hundreds of modules), which a process that
never compiles a promotion does not pay for importing DTensor.
"""

from __future__ import annotations

import logging
import threading

from .._engine.context import TracedPromotions, traced_promotions
from .._torch.api import (aot_autograd_cache, aot_autograd_cache_imported, current_compile_id, reset_compiled_code,
                          skipping_save)
from .recorder import PatchRecorder, current_value

log = logging.getLogger("keras_dtensor_mixfix")


class CompileCacheGuard:
    """Installs the skipping ``AOTAutogradCache.save`` while patched; invalidates compiled promotions."""

    def __init__(self, traced: TracedPromotions) -> None:
        self._traced = traced
        self._patches = PatchRecorder()
        self._lock = threading.Lock()
        self._wanted = False
        self.changes = 0
        """How many times the patch, its options or its rules changed: what a graph traced under them was traced
        under (a cache of graphs of its own, as the Keras integration's block tracer keeps, keys by it)."""

    def _skip(self) -> bool:
        return self._traced.promoted_in(current_compile_id())

    def install(self) -> None:
        """Wrap ``AOTAutogradCache.save`` while patched (once; nothing where torch has no such cache): now if
        torch.compile's cache module is imported, else when a compilation first traces a promotion (before it
        can save its graph)."""
        with self._lock:
            self._wanted = True
        self._traced.listen(self._wrap_save)
        if aot_autograd_cache_imported():
            self._wrap_save()

    def _wrap_save(self) -> None:
        with self._lock:
            if not self._wanted or len(self._patches):
                return
            cache = aot_autograd_cache()
            if cache is None:
                return
            original = current_value(cache, "save")
            self._patches.set(cache, "save", skipping_save(original, self._skip), label="AOTAutogradCache.save")
        self._traced.listen(None)  # wrapped until uninstall(): later promotions need not call back

    def uninstall(self) -> None:
        """Give ``AOTAutogradCache.save`` back exactly, if it is still ours (else warn and leave it)."""
        self._traced.listen(None)
        with self._lock:
            self._wanted = False
            self._patches.restore()

    def invalidate(self, why: str) -> None:
        """Make functions compiled with a promotion recompile (only if any was compiled); count the change
        (:attr:`changes`) whatever was compiled."""
        self.changes += 1
        if not self._traced.take():
            return
        log.info("keras_dtensor_mixfix: %s; resetting torch.compile's caches so graphs traced with a "
                 "promotion recompile", why)
        reset_compiled_code()


compile_cache_guard = CompileCacheGuard(traced_promotions)

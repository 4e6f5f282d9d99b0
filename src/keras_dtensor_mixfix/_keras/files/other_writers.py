"""Keras' callbacks that write other than through ``file_utils``, under a multi-process distribution: what each hook
needs besides the treatment every file-writing callback gets (:mod:`.callback_files`).

Contract: ``OrbaxCheckpoint``'s checkpointer saves on rank 0 only (the other ranks' saves are dropped, the rest of the
checkpointer is its own), and its ``on_train_end`` counts as a hook that wrote (rank 0's background saves are on disk
when it returns); ``TensorBoard`` writes its event files on rank 0 only (the other ranks' writers write to a folder of
their own, removed at ``on_train_end``, which counts as a hook that wrote).
"""

from __future__ import annotations

import concurrent.futures
import functools
import shutil
import tempfile
import weakref
from typing import Any, Callable, Dict, Tuple

from ..ranks import agreement


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


class _SavesDropped:
    """An Orbax checkpointer on a rank other than 0: its saves are rank 0's (dropped here); the rest is the
    checkpointer's own."""

    def __init__(self, checkpointer: Any) -> None:
        self.checkpointer = checkpointer

    def save_checkpointables(self, *args: Any, **kwargs: Any) -> None:
        return None

    def save_checkpointables_async(self, *args: Any, **kwargs: Any) -> "concurrent.futures.Future[None]":
        done: "concurrent.futures.Future[None]" = concurrent.futures.Future()
        done.set_result(None)
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self.checkpointer, name)


def _orbax_set_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def set_model(self: Any, model: Any) -> Any:
        result = original(self, model)
        if agreement.multi_process() and _rank() != 0 and not isinstance(self.checkpointer, _SavesDropped):
            self.checkpointer = _SavesDropped(self.checkpointer)
        return result

    return set_model


def _orbax_train_end(original: Callable[..., Any], hook_wrote: Callable[[], None]) -> Callable[..., Any]:
    @functools.wraps(original)
    def on_train_end(self: Any, logs: Any = None) -> Any:
        result = original(self, logs)
        # rank 0's background saves are finished and on disk: the barrier of a hook that wrote (_in_step) follows
        hook_wrote()
        return result

    return on_train_end


_OWN_FOLDERS: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
"""The folder each TensorBoard callback writes to on this rank (not rank 0) since its ``set_model``."""


def _tensorboard_set_model(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def set_model(self: Any, model: Any) -> Any:
        if not agreement.multi_process() or _rank() == 0:
            return original(self, model)
        log_dir = self.log_dir
        self.log_dir = _OWN_FOLDERS[self] = tempfile.mkdtemp(prefix=f"keras_dtensor_mixfix-tensorboard-rank{_rank()}-")
        weakref.finalize(self, shutil.rmtree, self.log_dir, ignore_errors=True)
        try:
            return original(self, model)  # its writers write under the rank's own folder
        finally:
            self.log_dir = log_dir

    return set_model


def _tensorboard_train_end(original: Callable[..., Any], hook_wrote: Callable[[], None]) -> Callable[..., Any]:
    @functools.wraps(original)
    def on_train_end(self: Any, logs: Any = None) -> Any:
        result = original(self, logs)  # closes the writers
        own = _OWN_FOLDERS.pop(self, None)
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)
        # rank 0's event files are closed and complete: the barrier of a hook that wrote (_in_step) follows
        hook_wrote()
        return result

    return on_train_end


Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


def treatments(hook_wrote: Callable[[], None]) -> Dict[Tuple[str, str], Wrapper]:
    """Each ``(callback class name, hook name)`` of a callback that writes other than through ``file_utils``, with
    the wrapper it needs besides; ``hook_wrote`` tells the hook's treatment that the hook wrote (its barrier
    follows)."""
    return {("OrbaxCheckpoint", "set_model"): _orbax_set_model,
            ("OrbaxCheckpoint", "on_train_end"): functools.partial(_orbax_train_end, hook_wrote=hook_wrote),
            ("TensorBoard", "set_model"): _tensorboard_set_model,
            ("TensorBoard", "on_train_end"): functools.partial(_tensorboard_train_end, hook_wrote=hook_wrote)}

"""Keras' callbacks that write files, under a multi-process distribution: each file written once, the ranks in step.

Every rank runs every callback. Keras' file-writing callbacks (``BackupAndRestore``, ``ModelCheckpoint``,
``CSVLogger``, ``TensorBoard``, ``OrbaxCheckpoint``) make folders, write metadata and delete them through
Keras' ``file_utils`` with nothing ordering the ranks, so on one shared folder they race:
``FileExistsError`` from two ``makedirs``, ``FileNotFoundError`` for a ``training_metadata.json`` another rank's
``rmtree`` removed, a CSV file written by every rank. While one of their hooks runs on a multi-process
distribution, ``file_utils``' writes (``makedirs``, ``rmtree``, ``remove``, ``copy``, a ``File`` opened to write)
happen on rank 0 only — on the other ranks a write is skipped and a file opened to write takes and drops what is
written — and a hook that wrote anything ends with a barrier, so that every rank then reads what rank 0 wrote.
What a hook asks of the file system (``exists``, ``isdir``, ``listdir``) is answered by rank 0 for every rank (one
broadcast), so every rank takes rank 0's branch; a ``File`` opened to read is read by each rank. ``model.save`` and
``save_weights`` inside a hook keep their own division of work (``saving.py``: every rank takes part, rank 0 writes).

What one hook writes is one unit, committed when the hook returns (:mod:`.commits`): a file it writes (``File`` opened
with ``w`` or ``x``, ``copy``'s destination, ``save_weights`` and ``model.save``) goes to a staging folder beside its
target, a deletion waits, and at the hook's end rank 0 puts them all in place at once (one rename, or a commit record
that a later look at the folder finishes). So ``BackupAndRestore``'s weights and its ``training_metadata.json`` (and
``double_checkpoint``'s previous pair) change together or not at all, whatever point a rank is killed at: Keras alone
writes them in place, one after the other. A look at or a read of a path the hook has staged commits what it staged
first (Keras' restore of the previous backup copies it, then loads it, in one hook). A hook that raises commits
nothing. A file opened to append (``CSVLogger``) is written in place: each row is appended and flushed whole.
Remote paths (``gs://``) are written in place, as Keras writes them.
Rank 0 writes for all: the folder must be one every rank sees (a shared file system), as with Keras on JAX. A
user's own callback runs on every rank as it does without the package: :func:`writes_once` gives it the same
treatment, or it tests ``torch.distributed.get_rank() == 0`` itself.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import threading
import weakref
from typing import Any, Callable, Iterator, Optional, Type

from ..._lifecycle.recorder import PatchRecorder
from ..boundary import keras_modules
from ..boundary.overrides import Override
from ..boundary.patches import rebind_everywhere
from ..ranks import agreement
from . import commits, other_writers

FILE_CALLBACKS = ("BackupAndRestore", "ModelCheckpoint", "CSVLogger", "TensorBoard", "OrbaxCheckpoint")
"""Keras' callbacks that write files (those a Keras release has)."""

WRITES_NO_FILE = {
    "RemoteMonitor": "its `path` is a URL's: each rank posts its logs to the server, and writes no file",
}
"""Keras' callbacks that take a path-like argument yet write no file, each with why: left as they are."""

HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_train_batch_begin",
         "on_train_batch_end", "on_test_begin", "on_test_end", "on_test_batch_begin", "on_test_batch_end",
         "on_predict_begin", "on_predict_end", "on_predict_batch_begin", "on_predict_batch_end", "set_model")
"""The methods of a callback that may write."""

WRITES = ("makedirs", "rmtree", "remove", "copy")
"""``file_utils``' functions that change the file system (``File`` is handled by its mode); what each does within a
hook: :data:`_WRITE_TREATMENT`."""

LOOKS = ("exists", "isdir", "listdir")
"""``file_utils``' functions that look at the file system: within a hook, rank 0's answer is every rank's (a hook
that asks whether a folder exists while rank 0 deletes it would otherwise take other branches on other ranks)."""

_state = threading.local()


def _in_section() -> bool:
    return getattr(_state, "depth", 0) > 0


def current_unit() -> Optional[commits.Unit]:
    """The files the callback hook running on this thread writes, committed together when it returns (None outside
    such a hook, or in one process)."""
    return getattr(_state, "unit", None)


def _unit() -> commits.Unit:
    """The unit of the hook running on this thread, within a hook's section (where there always is one)."""
    unit = current_unit()
    assert unit is not None, "a file written within a callback hook's section, which has no unit"
    return unit


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


class _Dropped(io.StringIO):
    """What a rank other than 0 writes to: accepts and drops everything."""

    def write(self, text: Any) -> int:
        return len(text)


class _DroppedBytes(io.BytesIO):
    def write(self, data: Any) -> int:
        return len(data)


def _local(*paths: Any) -> bool:
    """Whether every path is on the local file system (Keras writes a remote one, ``gs://...``, through TensorFlow's
    gfile: in place, as it would)."""
    remote = keras_modules.file_utils().is_remote_path
    return all(isinstance(path, (str, os.PathLike)) and not remote(path) for path in paths)


def flush_if_touched(*paths: Any) -> None:
    """On every rank alike (each keeps the same unit): before a look at, a read of or an in-place write to ``paths``,
    commit what the running hook has staged there (rank 0), the others waiting, so that every rank then finds it."""
    unit = current_unit()
    if unit is None or not unit.pending or not _local(*paths):
        return
    if any(unit.touches(os.fspath(path)) for path in paths):
        _commit(unit)
        agreement.barrier()


def _commit(unit: commits.Unit) -> None:
    if _rank() == 0:
        commits.commit(unit)
    else:
        unit.clear()


def recover(path: Any) -> None:
    """On every rank alike, once per folder and hook: rank 0 finishes a commit stopped in ``path``'s folder (and in
    ``path``, a folder) before any rank reads there; the others wait for it (one broadcast)."""
    if not _local(path):
        return
    checked = getattr(_state, "checked", None)
    path = os.path.abspath(os.fspath(path))
    folders = [folder for folder in (os.path.dirname(path), path) if checked is None or folder not in checked]
    if not folders:
        return
    if checked is not None:
        checked.update(folders)
    finished = [commits.finish_interrupted(folder) for folder in folders] if _rank() == 0 else []
    agreement.from_rank_zero(int(any(finished)))  # the others wait until rank 0 has finished


def _rank_zero_makedirs(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def makedirs(path: Any, *args: Any, **kwargs: Any) -> Any:
        if not _in_section():
            return original(path, *args, **kwargs)
        flush_if_touched(path)
        _state.wrote = True
        return original(path, *args, **kwargs) if _rank() == 0 else None

    return makedirs


def _deferred_delete(original: Callable[..., Any]) -> Callable[..., Any]:
    """``remove`` and ``rmtree`` within a hook: carried out when the hook's files are committed, with them."""
    @functools.wraps(original)
    def delete(path: Any, *args: Any, **kwargs: Any) -> Any:
        if not _in_section():
            return original(path, *args, **kwargs)
        _state.wrote = True
        if not _local(path):
            return original(path, *args, **kwargs) if _rank() == 0 else None
        _unit().delete(os.fspath(path))
        return None

    return delete


def _staged_copy(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def copy(source: Any, destination: Any, *args: Any, **kwargs: Any) -> Any:
        if not _in_section():
            return original(source, destination, *args, **kwargs)
        _state.wrote = True
        if not _local(source, destination):
            return original(source, destination, *args, **kwargs) if _rank() == 0 else None
        flush_if_touched(source)
        recover(source)
        unit = _unit()
        if _rank() != 0:
            unit.stage(os.fspath(destination))
            return None
        return original(source, unit.stage_on_disk(os.fspath(destination)), *args, **kwargs)

    return copy


def _recover_here(path: Any) -> None:
    """In one process, within a file callback's hook: finish a commit a killed rank of an earlier multi-process run
    left in ``path``'s folder, before Keras reads there (once per folder and hook)."""
    checked = getattr(_state, "checked_here", None)
    if checked is None or not _local(path):
        return
    path = os.path.abspath(os.fspath(path))
    for folder in (os.path.dirname(path), path):
        if folder not in checked:
            checked.add(folder)
            commits.finish_interrupted(folder)


def _rank_zero_look(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def look(path: Any, *args: Any, **kwargs: Any) -> Any:
        if not _in_section():
            _recover_here(path)
            return original(path, *args, **kwargs)
        import torch.distributed as dist

        flush_if_touched(path)
        recover(path)
        answer = [original(path, *args, **kwargs) if _rank() == 0 else None]
        dist.broadcast_object_list(answer, src=0)
        return answer[0]

    return look


def _rank_zero_file(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def File(path: Any, mode: str = "r") -> Any:  # noqa: N802 - Keras' name
        if not _in_section():
            _recover_here(path)
            return original(path, mode)
        flush_if_touched(path)
        recover(path)
        if not any(flag in mode for flag in "wax+"):
            return original(path, mode)
        _state.wrote = True
        staged = "a" not in mode and "+" not in mode and _local(path)  # an append goes where it appends
        if _rank() != 0:
            if staged:
                _unit().stage(os.fspath(path))
            return _DroppedBytes() if "b" in mode else _Dropped()
        return original(_unit().stage_on_disk(os.fspath(path)) if staged else path, mode)

    return File


def _in_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (a callback hook) with ``file_utils``' writes on rank 0 only, staged and committed together when
    it returns, and a barrier after it if it wrote, on a multi-process distribution; as it is otherwise (and inside
    another such hook)."""

    @functools.wraps(original)
    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _in_section() or getattr(_state, "checked_here", None) is not None:
            return original(self, *args, **kwargs)
        if not agreement.multi_process():
            _state.checked_here = set()
            try:
                return original(self, *args, **kwargs)
            finally:
                _state.checked_here = None
        _state.depth = 1
        _state.wrote = False
        _state.unit = unit = commits.Unit()
        _state.checked = set()
        try:
            result = original(self, *args, **kwargs)
        except BaseException:
            if _rank() == 0:
                commits.discard(unit)  # nothing of a hook that raised is committed: the files stay as they were
            raise
        finally:
            _state.depth = 0
            _state.unit = _state.checked = None
        if unit.pending:
            _state.wrote = True
            _commit(unit)
        if _state.wrote:
            agreement.barrier()  # what rank 0 wrote is there before any rank reads it
        return result

    return hook


@contextlib.contextmanager
def outside_callback_writes() -> Iterator[None]:
    """Within it, ``file_utils``' writes act on every rank again (Keras' saving inside a hook divides its work
    itself: every rank writes its scratch copy, rank 0 the file)."""
    depth = getattr(_state, "depth", 0)
    _state.depth = 0
    try:
        yield
    finally:
        _state.depth = depth


def writes_once(callback: Any) -> Any:
    """``callback`` (a ``keras.callbacks.Callback`` instance or class) with its hooks run as Keras' own file-writing
    callbacks are under a multi-process distribution: Keras' ``file_utils`` writes on rank 0 only, and
    the ranks in step after a hook that wrote. Returns ``callback``; an instance is changed in place, a class gets
    the hooks it defines wrapped (once)."""
    target = callback if isinstance(callback, type) else None
    for name in HOOKS:
        if target is not None:
            hook = target.__dict__.get(name)
            if callable(hook) and hook not in _IN_STEP:
                setattr(target, name, _marked(_in_step(hook)))
        else:
            function = getattr(getattr(callback, name, None), "__func__", None)
            if function is not None and function not in _IN_STEP:
                setattr(callback, name, _marked(_in_step(function)).__get__(callback))
    return callback


_IN_STEP: "weakref.WeakSet[Callable[..., Any]]" = weakref.WeakSet()
"""The hooks already run in step (not wrapped twice)."""


def _marked(function: Callable[..., Any]) -> Callable[..., Any]:
    _IN_STEP.add(function)
    return function


_WRITE_TREATMENT = {"makedirs": _rank_zero_makedirs, "rmtree": _deferred_delete, "remove": _deferred_delete,
                    "copy": _staged_copy}
"""What each of ``file_utils``' writes does within a hook (:data:`WRITES`)."""


def _file_callbacks_write_once(patches: PatchRecorder) -> None:
    file_utils = keras_modules.file_utils()
    for name in WRITES:
        rebind_everywhere(patches, getattr(file_utils, name), _WRITE_TREATMENT[name](getattr(file_utils, name)))
    for name in LOOKS:
        rebind_everywhere(patches, getattr(file_utils, name), _rank_zero_look(getattr(file_utils, name)))
    rebind_everywhere(patches, file_utils.File, _rank_zero_file(file_utils.File))
    for callback_class in _file_callback_classes():
        for name in HOOKS:
            hook = callback_class.__dict__.get(name)
            if callable(hook):
                treatment = _OWN_TREATMENT.get((callback_class.__name__, name))
                patches.set(callback_class, name, _marked(_in_step(treatment(hook) if treatment else hook)))


def _hook_wrote() -> None:
    _state.wrote = True


_OWN_TREATMENT = other_writers.treatments(_hook_wrote)
"""Hooks of a callback that writes other than through ``file_utils``, with what each needs besides."""


def _file_callback_classes() -> Iterator[Type[Any]]:
    callbacks = keras_modules.callbacks_package()
    for name in FILE_CALLBACKS:
        found: Optional[Type[Any]] = getattr(callbacks, name, None)
        if found is not None:
            yield found


OVERRIDE = Override(
    name="callbacks that write files",
    attributes=WRITES + LOOKS + ("File",) + HOOKS + ("OrbaxCheckpoint.checkpointer", "TensorBoard.log_dir"),
    description="callbacks: files written once (rank 0), the ranks in step after a hook that wrote",
    apply=_file_callbacks_write_once)

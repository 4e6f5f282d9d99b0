"""Keras' own files under a multi-process distribution: no rank holds a whole sharded weight.

Saving: every rank runs Keras' save (the same traversal of the same model, so the ranks meet each weight
together), with Keras' conversions of a DTensor replaced for the call (:mod:`.rank_zero_gather`). On rank 0, the
h5 weight store writes each sharded weight into its dataset piece by piece as the other ranks send the pieces (a
sharded ``.weights.json`` or an npz file receives it assembled whole, one weight at a time). On the others the
conversion sends this rank's piece and returns a placeholder, and their weight stores write nothing; their copy of
the small rest (a ``.keras`` archive's configuration and assets) goes to a temporary directory, deleted at once.

Loading (:mod:`.slice_loading`): each rank reads from the h5 file only the slice of each weight its own piece holds.

A save is atomic to a reader (:mod:`.commits`): rank 0 writes the file into a staging folder beside it and, once the
save has succeeded, moves it over the old one (one rename) before any rank returns; inside a callback's hook the
file joins the hook's unit, committed with the hook's other files. A rank killed at any point leaves the old file or
the new one. A load first finishes a commit a killed rank left half done in the file's folder.

Both take Keras' path for models too large for memory: a ``.keras`` archive's weights file is built on disk beside
the archive when saving, and extracted beside it (a temporary copy per process) when loading, instead of being held
in memory whole.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from typing import Any, Callable, Iterator, Optional

from ..._lifecycle.recorder import PatchRecorder
from ..boundary import keras_modules, keras_private
from ..boundary.overrides import Override
from ..boundary.patches import rebind_everywhere, replaced_for_the_call
from ..ranks import agreement
from . import callback_files, commits, rank_zero_gather, slice_loading
from .memory import return_freed_memory

WEIGHT_STORES = ("H5IOStore", "ShardedH5IOStore", "NpzIOStore")
"""The weight store classes of ``saving_lib`` (3.16 has no ``NpzIOStore``)."""


def _rank_zero_saving(patches: PatchRecorder) -> None:
    saving_lib = keras_modules.saving_lib()
    for name in ("save_model", "save_weights_only"):
        patches.set(saving_lib, name, _rank_zero_writes(getattr(saving_lib, name)))
    for name in ("load_model", "load_weights_only"):
        patches.set(saving_lib, name, _reading_slices(getattr(saving_lib, name)))


OVERRIDE = Override(
    name="saving", attributes=("save_model", "save_weights_only", "load_model", "load_weights_only"),
    description="saving: rank 0 alone assembles and writes whole weights; loading reads each rank's slices",
    apply=_rank_zero_saving)


def _rank_zero_writes(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def save(model: Any, filepath: Any, *args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        if not agreement.multi_process():
            return original(model, filepath, *args, **kwargs)
        try:
            hook_unit = callback_files.current_unit()
            with callback_files.outside_callback_writes():  # inside a callback's hook: this divides its own work
                if dist.get_rank() == 0:
                    return _save_on_rank_zero(original, model, filepath, hook_unit, *args, **kwargs)
                if hook_unit is not None and _staged(filepath):
                    hook_unit.stage(os.fspath(filepath))  # every rank keeps the hook's unit alike
                return _save_elsewhere(original, model, filepath, *args, **kwargs)
        finally:
            return_freed_memory()

    return save


def _staged(filepath: Any) -> bool:
    """Whether a save to ``filepath`` is staged and committed (a local path; Keras writes a remote one, or a file
    object, itself)."""
    return isinstance(filepath, (str, os.PathLike)) and not keras_modules.file_utils().is_remote_path(filepath)


def _reading_slices(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(*args: Any, **kwargs: Any) -> Any:
        if not agreement.multi_process():
            return original(*args, **kwargs)
        filepath = kwargs.get("filepath", args[1] if original.__name__ == "load_weights_only" and len(args) > 1
                              else args[0] if args else None)
        if _staged(filepath):
            callback_files.flush_if_touched(filepath)  # a file the running hook wrote is in place before it is read
            callback_files.recover(filepath)
        try:
            with callback_files.outside_callback_writes(), slice_loading.reading_slices(), _weights_file_on_disk():
                return original(*args, **kwargs)
        finally:
            return_freed_memory()

    return load


def _save_on_rank_zero(original: Callable[..., Any], model: Any, filepath: Any, hook_unit: Optional[commits.Unit],
                       *args: Any, **kwargs: Any) -> Any:
    failed = True
    unit = (hook_unit or commits.Unit()) if _staged(filepath) else None
    try:
        target = filepath if unit is None else unit.stage_on_disk(os.fspath(filepath))
        if unit is not None and target.endswith(".json"):  # a sharded weights file: its shards beside it, named there
            unit.entries[os.path.dirname(os.path.dirname(target))] = os.path.basename(target)
        with _converting_dtensors(rank_zero_gather.gather_whole, rank_zero_gather.pending_whole), \
                _weights_file_on_disk(), _weight_stores(_streaming_store):
            result = original(model, target, *args, **kwargs)
        if unit is not None and unit is not hook_unit:
            commits.commit(unit)  # before any rank returns: the file is in place when save() does
        failed = False
        return result
    finally:
        if failed and unit is not None and unit is not hook_unit:
            commits.discard(unit)
        rank_zero_gather.announce_end(failed)


def _save_elsewhere(original: Callable[..., Any], model: Any, filepath: Any, *args: Any, **kwargs: Any) -> Any:
    scratch = tempfile.mkdtemp(prefix="mixfix-save-")
    try:
        # the same file name (Keras checks its suffix), in a directory of this rank's own
        name = (os.path.basename(str(filepath).rstrip("/")) if isinstance(filepath, (str, os.PathLike))
                else "model.keras")
        with _converting_dtensors(rank_zero_gather.send_piece_for_placeholder,
                                  rank_zero_gather.send_piece_for_placeholder), \
                _weight_stores(lambda name, kind: _SendingStore):
            result = original(model, os.path.join(scratch, name), *args, **kwargs)
        rank_zero_gather.await_end()
        return result
    except agreement.RankZeroStopped:
        raise
    except BaseException:
        with contextlib.suppress(agreement.RankZeroStopped):
            rank_zero_gather.await_end()
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _converting_dtensors(convert: Callable[[Any], Any], convert_for_numpy: Callable[[Any], Any]) -> Iterator[None]:
    """Keras' ``convert_to_numpy`` hands DTensors to ``convert`` for one save, and a Variable's ``numpy()`` to
    ``convert_for_numpy`` (in every module that holds the function by name: layers store Variables, which convert
    through it; optimizers store ``variable.numpy()``)."""
    import numpy as np
    from torch.distributed.tensor import DTensor

    current = keras_modules.core().convert_to_numpy

    @functools.wraps(current)
    def convert_to_numpy(x: Any) -> Any:
        if isinstance(x, (np.ndarray, rank_zero_gather.PendingWhole)):
            return np.asarray(x)  # Keras' np.array() would copy a whole weight already in hand
        stored = rank_zero_gather.as_stored(x)  # a Variable converts as its tensor (Keras 3.16 gathers it inside)
        if isinstance(stored, DTensor):
            return convert(stored)
        if isinstance(x, (list, tuple)) and any(isinstance(rank_zero_gather.as_stored(item), DTensor) for item in x):
            x = type(x)(convert(stored) if isinstance(stored := rank_zero_gather.as_stored(item), DTensor) else item
                        for item in x)
        return current(x)

    variable_class = keras_modules.base_variable_class()
    current_numpy = variable_class.numpy

    @functools.wraps(current_numpy)
    def numpy(self: Any) -> Any:
        stored = rank_zero_gather.as_stored(self)
        # Keras' np.array(self) would copy the array convert() returns (optimizers store variable.numpy())
        return convert_for_numpy(stored) if isinstance(stored, DTensor) else current_numpy(self)

    with replaced_for_the_call() as patches:
        rebind_everywhere(patches, current, convert_to_numpy)
        patches.set(variable_class, "numpy", numpy)
        yield


@contextlib.contextmanager
def _weights_file_on_disk() -> Iterator[None]:
    """Keras builds a ``.keras`` archive's weights file on disk and streams it into the archive (its path for models
    it judges too large for memory), rather than in memory: under a distribution the model is sharded because
    memory is short. The file is the same."""
    with replaced_for_the_call() as patches:
        patches.set(keras_modules.saving_lib(), "is_memory_sufficient", lambda model: False)
        yield


@contextlib.contextmanager
def _weight_stores(replacement: Callable[[str, type], type]) -> Iterator[None]:
    """Keras' weight store classes replaced in ``saving_lib`` for one save (Keras looks them up there):
    ``replacement(name, store_class)`` gives each one's replacement."""
    saving_lib = keras_modules.saving_lib()
    with replaced_for_the_call() as patches:
        for name in WEIGHT_STORES:
            if hasattr(saving_lib, name):
                patches.set(saving_lib, name, replacement(name, getattr(saving_lib, name)))
        yield


def _streaming_store(name: str, store_class: type) -> type:
    """Rank 0's ``H5IOStore`` writes a sharded weight into its h5 dataset piece by piece, as the pieces arrive;
    the other stores (sharded h5 files, npz) receive it whole."""
    return _streaming_h5_store(store_class) if name == "H5IOStore" else store_class


@functools.lru_cache(maxsize=None)
def _streaming_h5_store(store_class: Any) -> type:  # store_class: Keras' H5IOStore (Keras is untyped)
    def __setitem__(self: Any, key: Any, value: Any) -> None:
        pending = value if isinstance(value, rank_zero_gather.PendingWhole) else None
        if pending is None and self.mode in ("w", "a"):
            candidate = rank_zero_gather.pending_whole(value)  # a sharded Variable's (what layers store)
            pending = candidate if isinstance(candidate, rank_zero_gather.PendingWhole) else None
            value = candidate
        if pending is None or pending.gathered:
            store_class.__setitem__(self, key, value)
            return
        # Keras' own __setitem__, the dataset filled by pieces instead of from one whole array
        dataset = keras_private.open_h5_entry_group(self).create_dataset(key, shape=pending.shape, dtype=pending.dtype)
        pending.stream_into(dataset.__setitem__)

    return type(store_class.__name__, (store_class,), {"__setitem__": __setitem__, "__module__": __name__,
                                                      "__qualname__": store_class.__name__})


class _SendingStore:
    """A weight store that writes nothing: each sharded weight set in it sends this rank's piece to rank 0."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.archive = None

    def __bool__(self) -> bool:
        return True

    def __len__(self) -> int:
        return 0

    def make(self, path: Any, metadata: Any = None) -> "_SendingStore":
        return self

    def __setitem__(self, key: Any, value: Any) -> None:
        rank_zero_gather.send_piece(value)  # a Variable (what layers store); an array was sent when converted

    def __contains__(self, key: Any) -> bool:
        return False

    def keys(self) -> list:
        return []

    def close(self) -> None:
        pass

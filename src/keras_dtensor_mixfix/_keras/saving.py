"""Keras' own files under a multi-process distribution: no rank but 0 holds a whole sharded weight.

Saving:

Every rank runs Keras' save (the same traversal of the same model, so the ranks meet each weight together), with
Keras' ``convert_to_numpy`` of a DTensor replaced for the call: on rank 0 it assembles the weight from the pieces
the other ranks send (:mod:`.rank_zero_gather`), and Keras writes it; on the others it sends this rank's piece and
returns a placeholder, and their weight stores write nothing. Rank 0 holds one whole weight at a time (and
what Keras itself holds: a ``.keras`` archive's weights file is built in memory when Keras judges the memory
sufficient); no other rank holds any or writes the weights file. Their copy of the small rest (the configuration
and assets of a ``.keras`` file) goes to a temporary directory, deleted at once.

Loading (:mod:`.slice_loading`): each rank reads from the h5 file only the slice of each weight its own piece holds.

Both take Keras' path for models too large for memory where it has one: a ``.keras`` archive's weights file is built
on disk beside the archive when saving, and extracted beside it (a temporary copy per process) when loading, instead
of being held in memory whole.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from typing import Any, Callable, Dict, Iterator

from . import keras_modules, rank_zero_gather, slice_loading
from .._lifecycle.recorder import PatchRecorder
from .memory import return_freed_memory

WEIGHT_STORES = ("H5IOStore", "ShardedH5IOStore", "NpzIOStore")
"""The weight store classes of ``saving_lib`` (3.16 has no ``NpzIOStore``)."""


def install(patches: PatchRecorder) -> None:
    saving_lib = keras_modules.saving_lib()
    for name in ("save_model", "save_weights_only"):
        patches.set(saving_lib, name, _rank_zero_writes(getattr(saving_lib, name)))
    for name in ("load_model", "load_weights_only"):
        patches.set(saving_lib, name, _reading_slices(getattr(saving_lib, name)))


def _multi_process() -> bool:
    import torch.distributed as dist

    return keras_modules.distribution() is not None and dist.is_initialized() and dist.get_world_size() > 1


def _rank_zero_writes(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def save(model: Any, filepath: Any, *args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        if not _multi_process():
            return original(model, filepath, *args, **kwargs)
        try:
            if dist.get_rank() == 0:
                return _save_on_rank_zero(original, model, filepath, *args, **kwargs)
            return _save_elsewhere(original, model, filepath, *args, **kwargs)
        finally:
            return_freed_memory()

    return save


def _reading_slices(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(*args: Any, **kwargs: Any) -> Any:
        if not _multi_process():
            return original(*args, **kwargs)
        try:
            with slice_loading.reading_slices(), _weights_file_on_disk():
                return original(*args, **kwargs)
        finally:
            return_freed_memory()

    return load


def _save_on_rank_zero(original: Callable[..., Any], model: Any, filepath: Any, *args: Any, **kwargs: Any) -> Any:
    failed = True
    try:
        with _converting_dtensors(rank_zero_gather.gather_whole), _weights_file_on_disk():
            result = original(model, filepath, *args, **kwargs)
        failed = False
        return result
    finally:
        rank_zero_gather.announce_end(failed)


def _save_elsewhere(original: Callable[..., Any], model: Any, filepath: Any, *args: Any, **kwargs: Any) -> Any:
    scratch = tempfile.mkdtemp(prefix="mixfix-save-")
    try:
        # the same file name (Keras checks its suffix), in a directory of this rank's own
        name = os.path.basename(str(filepath).rstrip("/")) if isinstance(filepath, (str, os.PathLike)) else "model.keras"
        with _converting_dtensors(rank_zero_gather.send_piece_for_placeholder), _weight_stores(_SendingStore):
            result = original(model, os.path.join(scratch, name), *args, **kwargs)
        rank_zero_gather.await_end()
        return result
    except rank_zero_gather.RankZeroStopped:
        raise
    except BaseException:
        with contextlib.suppress(rank_zero_gather.RankZeroStopped):
            rank_zero_gather.await_end()
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _converting_dtensors(convert: Callable[[Any], Any]) -> Iterator[None]:
    """Keras' ``convert_to_numpy`` hands DTensors to ``convert`` for one save (in every module that holds it by
    name: layers store Variables, which convert through it, and optimizers store ``variable.numpy()``)."""
    import sys

    from torch.distributed.tensor import DTensor

    current = keras_modules.core().convert_to_numpy

    @functools.wraps(current)
    def convert_to_numpy(x: Any) -> Any:
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
        return convert(stored) if isinstance(stored, DTensor) else current_numpy(self)

    holders = [module for name, module in list(sys.modules.items())
               if (name == "keras" or name.startswith("keras.")) and getattr(module, "convert_to_numpy", None) is current]
    for module in holders:
        setattr(module, "convert_to_numpy", convert_to_numpy)
    variable_class.numpy = numpy
    try:
        yield
    finally:
        variable_class.numpy = current_numpy
        for module in holders:
            setattr(module, "convert_to_numpy", current)


@contextlib.contextmanager
def _weights_file_on_disk() -> Iterator[None]:
    """Keras builds a ``.keras`` archive's weights file on disk and streams it into the archive (its path for models
    it judges too large for memory), rather than in memory: under a distribution the model is sharded because
    memory is short. The file is the same."""
    saving_lib = keras_modules.saving_lib()
    current = saving_lib.is_memory_sufficient
    saving_lib.is_memory_sufficient = lambda model: False
    try:
        yield
    finally:
        saving_lib.is_memory_sufficient = current


@contextlib.contextmanager
def _weight_stores(replacement: type) -> Iterator[None]:
    """Keras' weight store classes replaced in ``saving_lib`` for one save (Keras looks them up there)."""
    saving_lib = keras_modules.saving_lib()
    originals: Dict[str, type] = {name: getattr(saving_lib, name) for name in WEIGHT_STORES
                                  if hasattr(saving_lib, name)}
    for name in originals:
        setattr(saving_lib, name, replacement)
    try:
        yield
    finally:
        for name, store_class in originals.items():
            setattr(saving_lib, name, store_class)


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

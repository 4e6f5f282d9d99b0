"""Loading a Keras h5 weights file into sharded variables, each rank reading only its own slice of each weight.

For the duration of a load, Keras' ``H5IOStore`` hands out a weight as a :class:`StoredWeight` (the h5 dataset,
unread) instead of a whole NumPy array, and ``Variable.assign`` given one fills a sharded variable's local piece
from the dataset's hyperslab at this rank's offset. Anything else that meets a :class:`StoredWeight` (a layer that
computes on what it loads, a variable that is not sharded) gets the whole array, as Keras would have given it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional, Tuple

import numpy as np

from ..boundary import keras_modules, keras_private
from ..boundary.patches import replaced_for_the_call
from .array_proxy import ArrayProxy


class StoredWeight(ArrayProxy):
    """A weight in an h5 file, read by slices on demand; anything else gets the whole array (:class:`ArrayProxy`)."""

    def __init__(self, dataset: Any, bfloat16: bool) -> None:
        self._dataset = dataset
        self._bfloat16 = bfloat16

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self._dataset.shape)

    @property
    def ndim(self) -> int:
        return len(self._dataset.shape)

    @property
    def dtype(self) -> Any:
        if self._bfloat16:
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return self._dataset.dtype

    def read_slice(self, index: Optional[Tuple[slice, ...]]) -> np.ndarray:
        """The values in ``index`` (a tuple of slices; ``()`` or None reads everything), as Keras would convert them."""
        values = self._dataset[index] if index else self._dataset[()]
        if self._bfloat16:
            import ml_dtypes

            # stored as 2-byte opaque values, which NumPy cannot cast: the same bytes, seen as bfloat16
            if values.dtype.kind == "V" and values.dtype.itemsize == 2:
                return values.view(ml_dtypes.bfloat16)
            return np.array(values, dtype=ml_dtypes.bfloat16)
        return np.asarray(values)

    def whole_array(self) -> np.ndarray:
        return self.read_slice(())


@contextlib.contextmanager
def reading_slices() -> Iterator[None]:
    """Within: h5 weights reach sharded variables by slices (see the module's docstring)."""
    saving_lib = keras_modules.saving_lib()
    variable_class = keras_modules.base_variable_class()
    with replaced_for_the_call() as patches:
        patches.set(saving_lib, "H5IOStore", _slicing_store(saving_lib.H5IOStore))
        patches.set(variable_class, "assign", _assigning_slices(variable_class.assign))
        yield


@functools.lru_cache(maxsize=None)
def _slicing_store(store_class: Any) -> type:  # store_class: Keras' H5IOStore (Keras is untyped)
    saving_lib = keras_modules.saving_lib()

    def __getitem__(self: Any, key: Any) -> Any:
        import h5py

        group = keras_private.h5_entry_group(self)
        dataset: Any = None
        if group is not None and not isinstance(group, dict):
            try:
                dataset = saving_lib.safe_get_h5_dataset(group, key)
            except (KeyError, ValueError, TypeError):
                dataset = None
        if not isinstance(dataset, h5py.Dataset) or dataset.shape is None:
            return store_class.__getitem__(self, key)
        attrs = getattr(dataset, "attrs", {})
        return StoredWeight(dataset, bfloat16="dtype" in attrs and attrs["dtype"] == "bfloat16")

    return type(store_class.__name__, (store_class,), {"__getitem__": __getitem__, "__module__": __name__,
                                                      "__qualname__": store_class.__name__})


def _assigning_slices(original_assign: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original_assign)
    def assign(self: Any, value: Any) -> Any:
        if isinstance(value, StoredWeight):
            if _fill_local_piece(self, value):
                return keras_private.variable_storage(self)
            value = np.asarray(value)
        return original_assign(self, value)

    return assign


def _fill_local_piece(variable: Any, stored: StoredWeight) -> bool:
    """Fill a sharded variable's piece from ``stored``'s slice at this rank's offset; False if not sharded."""
    import torch
    from torch.distributed.tensor import DTensor

    from ..._engine.specs import local_slice  # imports torch: not at the module's import

    storage = keras_private.variable_storage(variable)
    if not isinstance(storage, DTensor) or stored.shape != tuple(storage.shape):
        return False  # a plain variable, or a shape Keras' own assign reports
    piece = stored.read_slice(local_slice(stored.shape, storage.device_mesh, tuple(storage.placements)))
    with torch.no_grad():
        local = storage.to_local()
        local.copy_(keras_modules.core().convert_to_tensor(piece, dtype=variable.dtype).reshape(local.shape))
    return True

"""A stand-in for a NumPy array whose values are produced only when something uses them as an array.

Loading and saving hand Keras such stand-ins (a weight still in the h5 file, a sharded weight not gathered yet) so
that the common path (the value goes straight into a variable, or into a file) never holds the whole array; any
other use (NumPy functions, operators, attributes, ``float()``) gets the whole array, as Keras would have.
"""

from __future__ import annotations

import abc

from typing import Any, Callable

import numpy as np


class ArrayProxy(abc.ABC):
    """Behaves as the array :meth:`whole_array` returns; subclasses say how to produce it."""

    __array_priority__ = 1000  # NumPy defers binary operators to ours, which use the whole array
    __hash__ = None  # type: ignore[assignment]  # compares by value, as an array does

    @abc.abstractmethod
    def whole_array(self) -> np.ndarray:
        """The whole array's values."""

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self.whole_array()
        return whole if dtype is None else whole.astype(dtype)

    def __len__(self) -> int:
        return int(self.shape[0])  # every subclass knows its shape unread

    def __float__(self) -> float:
        return float(self.whole_array())

    def __int__(self) -> int:
        return int(self.whole_array())

    def __bool__(self) -> bool:
        return bool(self.whole_array())

    def __getattr__(self, name: str) -> Any:  # anything else an array has: the whole array's
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.whole_array(), name)


def _whole_array_operator(name: str) -> Callable[..., Any]:
    def operator(self: ArrayProxy, *args: Any) -> Any:
        return getattr(self.whole_array(), name)(*args)

    operator.__name__ = name
    return operator


for _name in ("__getitem__", "__iter__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__truediv__", "__rtruediv__", "__neg__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
              "__matmul__", "__rmatmul__", "__pow__"):
    setattr(ArrayProxy, _name, _whole_array_operator(_name))

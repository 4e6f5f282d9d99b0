"""Random values that depend only on a seed and each element's position: any piece of a tensor drawn alone.

Element ``n`` (its row-major position in the tensor's global shape) takes the ``n``-th 64-bit word of NumPy's
counter-based ``Philox`` bit generator keyed by the seed. Philox is a function of (key, counter), so the words of
any range of positions are computed directly, without drawing the positions before them: a rank draws exactly its
piece of a sharded weight, and the values equal the same positions of the whole tensor drawn at once, on any mesh,
in any number of processes. NumPy keeps its bit generators' streams stable across releases (NEP 19), and the
words are the same on every platform; the transforms below are float64 arithmetic on them, rounded once to the
variable's dtype.

A word ``w`` becomes:

- ``uniform``: ``(w >> 11) * 2**-53`` in [0, 1) (53 bits), scaled to [minval, maxval);
- ``normal``: Box-Muller of the word's two 32-bit halves, ``sqrt(-2 log u1) * cos(2 pi u2)`` with
  ``u = (half + 0.5) * 2**-32`` in (0, 1); one word per element;
- ``truncated_normal``: the normal quantile of a uniform between the normal's cumulative values at -2 and 2 (the
  distribution truncated to two standard deviations, Keras' definition), drawn without rejection.

Values are not those Keras draws without a distribution (torch's CPU generator is a Mersenne twister, which cannot
start at a position). Bits are exact; ``log``, ``cos`` and ``erfinv`` are torch's float64 kernels, whose vector and
scalar paths may differ by one float64 ulp, so a float64 variable's value may differ in its last bit between two
ways of splitting it (a float32 or narrower one, rounded from float64, practically never).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterator, Sequence, Tuple

import numpy as np

from ..._rules.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

KINDS = ("uniform", "normal", "truncated_normal")
"""The distributions drawn here: those Keras' element-wise initializers draw (RandomUniform, RandomNormal,
TruncatedNormal and every VarianceScaling)."""

_CHUNK = 1 << 16
"""Elements transformed per step: the float64 temporaries of one step stay in the CPU's cache."""

_PHILOX_BLOCK = 4
"""64-bit words per Philox counter value (Philox4x64): counter ``c`` gives words ``4c`` to ``4c + 3``."""

_TRUNCATION = 2.0
"""Keras' truncated normal keeps values within two standard deviations."""


def key_of(seed: int) -> int:
    """The Philox key of a Keras seed (an int of any sign): its value modulo 2**64."""
    return int(seed) % (1 << 64)


class Stream:
    """The stream of words keyed by a seed, read at any position: position ``n`` is word ``n % 4`` of Philox's
    block at counter ``n // 4``."""

    def __init__(self, seed: int) -> None:
        self._generator = np.random.Philox(key=key_of(seed))
        self._state = self._generator.state

    def words(self, start: int, count: int) -> np.ndarray:
        """Words ``start`` to ``start + count`` (uint64), computed without the ones before them."""
        # the next word a Philox state gives with an empty buffer is the first of its counter's block
        counter = self._state["state"]["counter"]
        counter[:] = 0
        counter[0] = start // _PHILOX_BLOCK
        self._state["buffer_pos"] = _PHILOX_BLOCK
        self._generator.state = self._state
        skip = start % _PHILOX_BLOCK
        return np.asarray(self._generator.random_raw(count + skip), dtype=np.uint64)[skip:]


def runs(shape: Sequence[int], box: Sequence[slice]) -> Iterator[Tuple[int, int]]:
    """The box ``box`` (one ``slice(start, stop)`` per dim, step 1) of a row-major tensor of ``shape`` as runs of
    consecutive positions, in the box's own row-major order: ``(first position, length)`` pairs."""
    shape = [int(size) for size in shape]
    bounds = [(0 if s.start is None else int(s.start), size if s.stop is None else int(s.stop))
              for s, size in zip(box, shape)]
    if not shape:
        yield 0, 1
        return
    if any(stop <= start for start, stop in bounds):
        return
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    # the innermost dim the box does not cover whole, and everything inside it, is one run
    cut = len(shape) - 1
    while cut > 0 and bounds[cut] == (0, shape[cut]):
        cut -= 1
    length = (bounds[cut][1] - bounds[cut][0]) * strides[cut]
    outer = [range(start, stop) for start, stop in bounds[:cut]]
    for index in np.ndindex(*[len(r) for r in outer]) if outer else [()]:
        first = bounds[cut][0] * strides[cut] + sum((outer[d][i]) * strides[d] for d, i in enumerate(index))
        yield first, length


def draw(kind: str, seed: int, shape: Sequence[int], box: Sequence[slice], dtype: "torch.dtype",
         low: float = 0.0, high: float = 1.0) -> "torch.Tensor":
    """The piece ``box`` of a tensor of global ``shape`` drawn from ``kind`` with ``seed``: a contiguous CPU tensor
    of the box's shape and ``dtype``.

    Args:
        kind: one of :data:`KINDS`.
        box: one ``slice`` per dim (``slice(None)`` for a whole dim); ``()`` for a 0-dim tensor.
        low, high: ``uniform``: the range [low, high); ``normal`` and ``truncated_normal``: the mean and the
            standard deviation (of the untruncated normal, as Keras' ``stddev``).
    """
    import torch

    if kind not in KINDS:
        raise InvalidArgumentError(f"keras_dtensor_mixfix: no position-keyed draw of kind {kind!r}; the kinds are {KINDS}")
    box = tuple(box) + (slice(None),) * (len(shape) - len(box))
    piece_shape = tuple(len(range(*s.indices(int(size)))) for s, size in zip(box, shape))
    out = torch.empty(math.prod(piece_shape), dtype=dtype)
    stream = Stream(seed)
    buffer = np.empty(_CHUNK, np.uint64)
    filled = written = 0
    for first, length in runs(shape, box):
        taken = 0
        while taken < length:
            step = min(length - taken, _CHUNK - filled)
            buffer[filled:filled + step] = stream.words(first + taken, step)
            filled += step
            taken += step
            if filled == _CHUNK:
                out[written:written + filled] = _transform(kind, buffer[:filled], low, high)
                written += filled
                filled = 0
    if filled:
        out[written:written + filled] = _transform(kind, buffer[:filled], low, high)
    return out.reshape(piece_shape)


def _transform(kind: str, block: np.ndarray, low: float, high: float) -> "torch.Tensor":
    """Words to float64 values of ``kind`` (see the module's docstring)."""
    import torch

    if kind == "normal":
        u1 = torch.from_numpy(((block >> np.uint64(32)).astype(np.float64) + 0.5) * 2.0 ** -32)
        u2 = torch.from_numpy(((block & np.uint64(0xFFFFFFFF)).astype(np.float64) + 0.5) * 2.0 ** -32)
        standard = u1.log_().mul_(-2.0).sqrt_().mul_(u2.mul_(2.0 * math.pi).cos_())
        return standard.mul_(high).add_(low)
    uniform = torch.from_numpy((block >> np.uint64(11)).astype(np.float64) * 2.0 ** -53)
    if kind == "uniform":
        return uniform.mul_(high - low).add_(low)
    # truncated normal: between Phi(-2) and Phi(2); the half ulp keeps the quantile finite at either end
    lower = 0.5 * math.erfc(_TRUNCATION / math.sqrt(2.0))
    width = 1.0 - 2.0 * lower
    p = uniform.add_(2.0 ** -54).mul_(width).add_(lower)
    standard = torch.special.erfinv(p.mul_(2.0).sub_(1.0)).mul_(math.sqrt(2.0))
    return standard.mul_(high).add_(low)

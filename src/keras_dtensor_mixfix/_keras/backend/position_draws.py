"""Random values that depend only on a seed and each element's position: any piece of a tensor drawn alone.

Elements ``2k`` and ``2k + 1`` (row-major positions in the tensor's global shape) take the ``k``-th 64-bit word of
NumPy's counter-based ``Philox`` bit generator keyed by the seed. Philox is a function of (key, counter), so the words
of any range of positions are computed directly, without drawing the positions before them: a rank draws exactly
its piece of a sharded weight, and the values equal the same positions of the whole tensor drawn at once, on any
mesh, in any number of processes. NumPy keeps its bit generators' streams stable across releases (NEP 19), and the
words are the same on every platform; the transforms below are float64 arithmetic on them, rounded once to the
variable's dtype.

A word's two 32-bit halves (``u = (half + 0.5) * 2**-32``, in (0, 1): 32 random bits per value) become:

- ``uniform``: each half one value, ``u`` scaled to [minval, maxval) (the high half at the even position);
- ``normal``: the Box-Muller pair of the two, ``sqrt(-2 log u1) * cos(2 pi u2)`` at the even position and ``* sin``
  at the odd one;
- ``truncated_normal``: each half one value, the normal quantile of ``u`` placed between the normal's cumulative
  values at -2 and 2 (the distribution truncated to two standard deviations, Keras' definition), without rejection.

Values are not those Keras draws without a distribution (torch's CPU generator is a Mersenne twister, which cannot
start at a position). Bits are exact; ``log``, ``cos`` and ``erfinv`` are torch's float64 kernels, whose vector and
scalar paths may differ by one float64 ulp, so a float64 variable's value may differ in its last bit between two
ways of splitting it (a float32 or narrower one, rounded from float64, practically never). Cost per element:
``benchmarks/position_draws_cost.py`` (BENCHMARKS.md).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterator, Optional, Sequence, Tuple

import numpy as np

from ..._rules.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

KINDS = ("uniform", "normal", "truncated_normal")
"""The distributions drawn here: those Keras' element-wise initializers draw (RandomUniform, RandomNormal,
TruncatedNormal and every VarianceScaling)."""

_CHUNK_WORDS = 1 << 15
"""Words transformed per step (two values each): the float64 temporaries of one step stay in the CPU's cache."""

_WORDS_PER_READ = 700
"""What one more read of the stream costs, in words read: a gap shorter than this is cheaper read through."""

_VALUES_PER_WORD = 2
"""Each 64-bit word makes two values (of its two 32-bit halves): position ``n`` is half ``n % 2`` of word ``n // 2``."""

_PHILOX_BLOCK = 4
"""64-bit words per Philox counter value (Philox4x64): counter ``c`` gives words ``4c`` to ``4c + 3``."""

_TRUNCATION = 2.0
"""Keras' truncated normal keeps values within two standard deviations."""


def key_of(seed: int) -> int:
    """The Philox key of a Keras seed (an int of any sign): its value modulo 2**64."""
    return int(seed) % (1 << 64)


class Stream:
    """The stream of words keyed by a seed, read at any position: word ``k`` is word ``k % 4`` of Philox's block at
    counter ``k // 4``."""

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


def runs(shape: Sequence[int], box: Sequence[slice]) -> Tuple[np.ndarray, int]:
    """The box ``box`` (one ``slice(start, stop)`` per dim, step 1) of a row-major tensor of ``shape`` as runs of
    consecutive positions, in the box's own row-major order: the first position of each run (int64) and their
    common length (0 runs for an empty box)."""
    shape = [int(size) for size in shape]
    if not shape:
        return np.zeros(1, np.int64), 1
    bounds = [(0 if s.start is None else int(s.start), size if s.stop is None else int(s.stop))
              for s, size in zip(box, shape)]
    if any(stop <= start for start, stop in bounds):
        return np.zeros(0, np.int64), 0
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    # the innermost dim the box does not cover whole, and everything inside it, is one run
    cut = len(shape) - 1
    while cut > 0 and bounds[cut] == (0, shape[cut]):
        cut -= 1
    firsts = np.full(1, bounds[cut][0] * strides[cut], np.int64)
    for dim in range(cut - 1, -1, -1):  # outer dims: every combination, the outermost varying slowest
        offsets = np.arange(bounds[dim][0], bounds[dim][1], dtype=np.int64) * strides[dim]
        firsts = (offsets[:, None] + firsts[None, :]).reshape(-1)
    return firsts, (bounds[cut][1] - bounds[cut][0]) * strides[cut]


def _batches(firsts: np.ndarray, length: int) -> Iterator[Tuple[int, int, Optional[np.ndarray]]]:
    """The runs, in order, in batches of about ``_CHUNK_WORDS * 2`` values: ``(first, stop, None)`` for consecutive
    positions (a long run, or part of one), ``(first, length, firsts)`` for several short runs of ``length``
    starting at ``firsts``."""
    per_batch = _CHUNK_WORDS * _VALUES_PER_WORD
    if not length:
        return
    if length >= per_batch // 4:
        for first in firsts.tolist():
            for start in range(first, first + length, per_batch):
                yield start, min(start + per_batch, first + length), None
        return
    count = max(1, per_batch // length)
    for start in range(0, len(firsts), count):
        yield int(firsts[start]), length, firsts[start:start + count]


def _words_of(stream: "Stream", firsts: np.ndarray, length: int) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """The words that hold the runs of ``length`` starting at ``firsts`` (ascending, far enough apart that no two
    share a word), in order, and where each position's value is among the values they make (None: in order, all of
    them)."""
    aligned = not (length & 1 or (firsts & 1).any())
    first_words = firsts >> 1
    per_run = (length + 1) // 2 + (0 if aligned else 1)  # an unaligned run may reach into one more word
    offsets = np.arange(per_run, dtype=np.int64)
    span = int(first_words[-1] - first_words[0]) + per_run
    if span <= len(firsts) * (per_run + _WORDS_PER_READ):  # reading through the gaps costs less than a read per run
        whole = stream.words(int(first_words[0]), span)
        block = whole[((first_words - first_words[0])[:, None] + offsets[None, :]).reshape(-1)]
    else:
        block = np.concatenate([stream.words(word, per_run) for word in first_words.tolist()])
    if aligned:
        return block, None
    # each run's values start at its first's half of its first word: per_run * 2 values a run, `length` of them kept
    index = ((np.arange(len(firsts), dtype=np.int64) * (per_run * _VALUES_PER_WORD) + (firsts & 1))[:, None]
             + np.arange(length, dtype=np.int64)[None, :]).reshape(-1)
    return block, index


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
        raise InvalidArgumentError(f"keras_dtensor_mixfix: no position-keyed draw of kind {kind!r}; the kinds are "
                                   f"{KINDS}")
    box = tuple(box) + (slice(None),) * (len(shape) - len(box))
    piece_shape = tuple(len(range(*s.indices(int(size)))) for s, size in zip(box, shape))
    out = torch.empty(math.prod(piece_shape), dtype=dtype)
    stream = Stream(seed)
    firsts, length = runs(shape, box)
    written = 0
    for first, stop_or_length, short_runs in _batches(firsts, length):
        if short_runs is None:  # consecutive positions: the words from the first's to the last's, its values a slice
            stop, skip = stop_or_length, first & 1
            block = stream.words(first >> 1, ((stop - 1) >> 1) - (first >> 1) + 1)
            values = _transform(kind, block, low, high)[skip:skip + stop - first]
        else:
            block, index = _words_of(stream, short_runs, stop_or_length)
            values = _transform(kind, block, low, high)
            if index is not None:
                values = values[torch.from_numpy(index)]
        out[written:written + len(values)] = values
        written += len(values)
    return out.reshape(piece_shape)


def _transform(kind: str, block: np.ndarray, low: float, high: float) -> "torch.Tensor":
    """Words to float64 values of ``kind``, two per word, in position order (see the module's docstring)."""
    import torch

    words_ = torch.from_numpy(block.view(np.int64))
    high_half = torch.bitwise_right_shift(words_, 32).bitwise_and_(0xFFFFFFFF).to(torch.float64)
    low_half = words_.bitwise_and(0xFFFFFFFF).to(torch.float64)
    values = torch.empty((len(block), _VALUES_PER_WORD), dtype=torch.float64)
    if kind == "normal":
        radius = high_half.add_(0.5).mul_(2.0 ** -32).log_().mul_(-2.0).sqrt_()
        angle = low_half.add_(0.5).mul_(2.0 * math.pi * 2.0 ** -32)
        torch.mul(radius, torch.cos(angle), out=values[:, 0])
        torch.mul(radius, angle.sin_(), out=values[:, 1])
        return values.view(-1).mul_(high).add_(low)
    values[:, 0] = high_half
    values[:, 1] = low_half
    uniform = values.view(-1).add_(0.5).mul_(2.0 ** -32)  # in (0, 1), both ends excluded
    if kind == "uniform":
        return uniform.mul_(high - low).add_(low)
    # truncated normal: the quantile of a uniform between Phi(-2) and Phi(2)
    lower = 0.5 * math.erfc(_TRUNCATION / math.sqrt(2.0))
    p = uniform.mul_(1.0 - 2.0 * lower).add_(lower)
    standard = torch.special.erfinv(p.mul_(2.0).sub_(1.0)).mul_(math.sqrt(2.0))
    return standard.mul_(high).add_(low)

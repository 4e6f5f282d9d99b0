"""The position-keyed generator: any box of a tensor drawn alone equals the same box of the whole draw, on even
and uneven pieces, every torch.chunk split of every dim, 0-dim and empty tensors; the values follow their
distributions; the stream is NumPy's Philox read at any position."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from keras_dtensor_mixfix._keras.backend import position_draws


@pytest.mark.parametrize("kind", position_draws.KINDS)
def test_any_box_drawn_alone_equals_that_box_of_the_whole(kind):
    shape = (7, 9, 5)
    whole = position_draws.draw(kind, 42, shape, (), torch.float32, 0.0, 1.0)
    for pieces in itertools.product((1, 2, 3, 4), repeat=3):  # every torch.chunk split of every dim, uneven ones
        chunks = [torch.arange(size).chunk(count) for size, count in zip(shape, pieces)]
        for parts in itertools.product(*chunks):
            box = tuple(slice(int(p[0]), int(p[-1]) + 1) for p in parts)
            piece = position_draws.draw(kind, 42, shape, box, torch.float32, 0.0, 1.0)
            assert torch.equal(piece, whole[box]), (pieces, box)


def test_boxes_that_cross_the_transform_chunk_and_philox_blocks_agree():
    shape = (3, 70000)  # a row longer than one transform step; boxes starting inside a Philox block
    whole = position_draws.draw("normal", 7, shape, (), torch.float64, 0.0, 1.0)
    for box in [(slice(None), slice(1, 69999)), (slice(1, 3), slice(3, 65541)), (slice(2, 3),)]:
        assert torch.equal(position_draws.draw("normal", 7, shape, box, torch.float64, 0.0, 1.0), whole[box])


def test_zero_dim_and_empty_tensors():
    scalar = position_draws.draw("uniform", 3, (), (), torch.float32, 0.0, 1.0)
    assert scalar.shape == () and 0.0 <= float(scalar) < 1.0
    assert float(scalar) == float(position_draws.draw("uniform", 3, (1,), (), torch.float32, 0.0, 1.0)[0])
    assert position_draws.draw("normal", 3, (4, 0), (), torch.float32).shape == (4, 0)
    assert position_draws.draw("normal", 3, (4, 6), (slice(2, 2),), torch.float32).shape == (0, 6)


def test_the_words_are_numpys_philox_stream_read_at_any_position():
    seed = 2 ** 40 + 17
    stream = np.random.Philox(key=seed).random_raw(64)
    reader = position_draws.Stream(seed)
    for start, count in [(0, 64), (1, 3), (5, 20), (63, 1), (8, 0)]:
        np.testing.assert_array_equal(reader.words(start, count), stream[start:start + count])
    # a negative Keras seed is a key too, distinct from its absolute value
    assert position_draws.key_of(-1) == 2 ** 64 - 1
    assert not np.array_equal(position_draws.Stream(-5).words(0, 8), position_draws.Stream(5).words(0, 8))


def test_values_follow_their_distributions_and_seeds_give_other_values():
    n = 200_000
    normal = position_draws.draw("normal", 1, (n,), (), torch.float64, 0.5, 2.0).numpy()
    assert abs(normal.mean() - 0.5) < 0.02 and abs(normal.std() - 2.0) < 0.02
    uniform = position_draws.draw("uniform", 1, (n,), (), torch.float64, -3.0, 5.0).numpy()
    assert uniform.min() >= -3.0 and uniform.max() < 5.0 and abs(uniform.mean() - 1.0) < 0.03
    truncated = position_draws.draw("truncated_normal", 1, (n,), (), torch.float64, 0.0, 1.0).numpy()
    assert np.abs(truncated).max() < 2.0
    # the standard deviation of a standard normal truncated to two deviations: what VarianceScaling divides by
    assert abs(truncated.std() - 0.87962566103423978) < 0.005
    # the empirical distribution function against the normal's (Kolmogorov-Smirnov distance)
    ordered = np.sort(position_draws.draw("normal", 9, (n,), (), torch.float64, 0.0, 1.0).numpy())
    expected = np.array([0.5 * math.erfc(-x / math.sqrt(2.0)) for x in ordered[::100]])
    assert np.abs(expected - np.arange(0, n, 100) / n).max() < 0.01
    assert not torch.equal(position_draws.draw("normal", 1, (64,), (), torch.float32),
                           position_draws.draw("normal", 2, (64,), (), torch.float32))


def test_narrow_dtypes_are_the_float64_values_rounded_once():
    wide = position_draws.draw("normal", 11, (1000,), (), torch.float64, 0.0, 0.02)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(position_draws.draw("normal", 11, (1000,), (), dtype, 0.0, 0.02), wide.to(dtype))


def test_an_unknown_kind_is_refused_with_the_kinds():
    with pytest.raises(ValueError, match="'gamma'.*uniform"):
        position_draws.draw("gamma", 1, (3,), (), torch.float32)

"""Which initializers are drawn by position, and what a drawn piece is: the same values as the whole drawn at once,
scaled as Keras scales its own draw; an initializer that draws otherwise is left to Keras."""

from __future__ import annotations

import numpy as np
import pytest
import torch

keras = pytest.importorskip("keras")

from keras_dtensor_mixfix._keras.backend import initial_values  # noqa: E402


@pytest.mark.parametrize("initializer", [
    keras.initializers.RandomNormal(0.5, 0.02, seed=1), keras.initializers.TruncatedNormal(stddev=0.2, seed=1),
    keras.initializers.RandomUniform(-1.0, 2.0, seed=1), keras.initializers.GlorotUniform(seed=1),
    keras.initializers.HeNormal(seed=1), keras.initializers.LecunNormal(seed=1),
    keras.initializers.VarianceScaling(2.0, "fan_out", "untruncated_normal", seed=1),
], ids=lambda initializer: type(initializer).__name__)
def test_keras_elementwise_initializers_are_drawn_by_position_in_pieces(initializer):
    assert initial_values.draws_by_position(initializer)
    shape = (12, 10)
    whole = initial_values.drawn_piece(initializer, shape, "float32", ())
    assert whole.shape == shape and whole.dtype == torch.float32
    piece = initial_values.drawn_piece(initializer, shape, "float32", (slice(3, 7), slice(5, 10)))
    assert torch.equal(piece, whole[3:7, 5:10])
    # Keras' scale, not Keras' values: the same distribution's statistics as Keras' own draw of a large tensor
    big = (400, 300)
    ours = initial_values.drawn_piece(initializer, big, "float32", ()).numpy()
    keras_own = np.asarray(initializer(big, dtype="float32"))
    assert abs(ours.std() - keras_own.std()) < 0.03 * keras_own.std() + 1e-6
    assert abs(ours.mean() - keras_own.mean()) < 0.05 * keras_own.std() + 1e-6
    assert not np.array_equal(ours, keras_own)


def test_other_initializers_are_left_to_keras():
    class Mine(keras.initializers.GlorotUniform):  # a user's class: it may draw as it likes
        pass

    assert not initial_values.draws_by_position(Mine(seed=1))
    assert not initial_values.draws_by_position(keras.initializers.Orthogonal(seed=1))  # a QR of the whole draw
    assert not initial_values.draws_by_position(keras.initializers.GlorotUniform(seed=keras.random.SeedGenerator(1)))
    assert not initial_values.draws_by_position(keras.initializers.Zeros())


def test_an_initializer_that_draws_another_shape_or_twice_is_drawn_as_keras_does(monkeypatch):
    initializer = keras.initializers.RandomNormal(seed=3)
    random = initial_values.keras_modules.random_package()

    def twice(self, shape, dtype=None):
        return random.normal(shape, seed=self.seed, dtype=dtype) + random.normal(shape, seed=self.seed, dtype=dtype)

    def other_shape(self, shape, dtype=None):
        return random.normal((shape[0] * shape[1],), seed=self.seed, dtype=dtype).reshape(shape)

    for call in (twice, other_shape):
        monkeypatch.setattr(type(initializer), "__call__", call)
        assert initial_values.drawn_piece(initializer, (4, 5), "float32", ()) is None
    monkeypatch.undo()
    assert random.normal is not None and initial_values.drawn_piece(initializer, (4, 5), "float32", ()) is not None


def test_the_context_is_per_thread_and_nests():
    import threading

    assert not initial_values.sharding_independent()
    seen = []
    with initial_values.sharding_independent_initial_values():
        with initial_values.sharding_independent_initial_values():
            assert initial_values.sharding_independent()
        assert initial_values.sharding_independent()
        thread = threading.Thread(target=lambda: seen.append(initial_values.sharding_independent()))
        thread.start()
        thread.join()
    assert seen == [False] and not initial_values.sharding_independent()

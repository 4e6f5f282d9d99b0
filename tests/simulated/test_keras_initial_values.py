"""A Keras model built under ``ModelParallel`` on 8 and 64 simulated ranks: every simulated rank draws exactly its own
pieces of each random initial value (no more elements than it holds), and every rank's values equal one process's
built within ``sharding_independent_initial_values()``: the same initial weights on every mesh."""

from __future__ import annotations

import math

import numpy as np
import pytest

import _simulator

MESHES = [(1, 8), (2, 4), (8, 8)]


def _model():
    import keras

    keras.utils.set_random_seed(5)
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, name="wide", bias_initializer=keras.initializers.Constant(0.5)),
        keras.layers.LayerNormalization(name="norm"),
        keras.layers.Dense(24, name="mid", kernel_initializer=keras.initializers.TruncatedNormal(stddev=0.1)),
        keras.layers.Dense(4, name="head", kernel_initializer=keras.initializers.HeNormal()),
    ], name="net")


def _layout_map(mesh):
    import keras

    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*wide/kernel"] = (None, "model")
    layout_map[".*wide/bias"] = ("model",)
    layout_map[".*mid/kernel"] = ("model", "batch")  # 16 rows over the model axis: uneven and empty pieces at 8x8
    layout_map[".*table/embeddings"] = ("batch", "model")
    return layout_map


def _built():
    """The model's weights and an embedding table (built alone), as the process holds them."""
    import keras

    model = _model()
    table = keras.layers.Embedding(40, 24, name="table")
    table.build((None,))
    return model.weights + table.weights


@pytest.fixture()
def integration():
    import keras

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix._keras.backend import distribution_lib

    from _keras_releases import KERAS_RELEASE

    if KERAS_RELEASE >= (3, 16):
        pytest.skip("Keras 3.16's own variables draw each initial value whole on every rank (Keras' choice)")
    assert keras_integration.install()
    try:
        with keras_integration.sharding_independent_initial_values():
            reference = [np.array(v.numpy()) for v in _built()]
        yield reference
    finally:
        keras.distribution.set_distribution(None)
        distribution_lib._MESHES.clear()  # meshes of the fake groups, gone with them
        keras_integration.uninstall()


@pytest.mark.parametrize("mesh_shape", MESHES, ids=["x".join(map(str, shape)) for shape in MESHES])
def test_every_simulated_rank_draws_its_pieces_alone_and_they_are_the_one_process_values(mesh_shape, integration,
                                                                                        monkeypatch):
    import keras
    from torch.distributed.tensor import DTensor

    from keras_dtensor_mixfix._keras.backend import position_draws

    ranks = math.prod(mesh_shape)
    drawn = []
    real_draw = position_draws.draw

    def recording_draw(kind, seed, shape, box, *args, **kwargs):
        drawn.append((tuple(shape), tuple((s.start, s.stop) for s in box)))  # one call per simulated rank
        return real_draw(kind, seed, shape, box, *args, **kwargs)

    monkeypatch.setattr(position_draws, "draw", recording_draw)
    with _simulator.fake_process_group(ranks), _simulator.simulated_mesh(mesh_shape):
        mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"], keras.distribution.list_devices())
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=_layout_map(mesh)))
        variables = _built()
        checked = 0
        for variable, want in zip(variables, integration):
            value = variable.value
            assert isinstance(value, DTensor), variable.path
            by_rank = value.full_tensor()._local_tensors  # every simulated rank's global value
            assert sorted(by_rank) == list(range(ranks))
            for rank, got in by_rank.items():
                np.testing.assert_array_equal(got.detach().numpy(), want, err_msg=f"{variable.path} rank {rank}")
            checked += 1
        pieces = {v.path: v.value for v in variables}
        keras.distribution.set_distribution(None)
    assert checked == len(integration)
    # four random weights, each drawn once per simulated rank, each draw exactly that rank's piece
    random_shapes = [(8, 16), (16, 24), (24, 4), (40, 24)]
    assert sorted({shape for shape, _ in drawn}) == sorted(random_shapes)
    for path, shape in zip(["net/wide/kernel", "net/mid/kernel", "net/head/kernel", "table/embeddings"], random_shapes):
        boxes = [box for drawn_shape, box in drawn if drawn_shape == shape]
        assert len(boxes) == ranks, (path, len(boxes))
        local = pieces[path]._local_tensor._local_tensors
        for rank, box in enumerate(boxes):
            assert tuple(stop - start for start, stop in box) == tuple(local[rank].shape), (path, rank, box)
        held = sum(math.prod(stop - start for start, stop in box) for box in boxes)
        assert held == sum(local[rank].numel() for rank in range(ranks)), path

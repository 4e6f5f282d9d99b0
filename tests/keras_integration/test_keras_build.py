"""Building under ``ModelParallel``: no whole initial value on more than one rank; large weights left whole named.

Zeros, ones and constants (biases, norm scales, every optimizer slot) are made by each rank for its own piece,
with no whole tensor and no scatter; Keras' element-wise random initializers (Glorot, He, the normals, the
uniform) are drawn by each rank for its own piece alone, with values keyed by position: the same initial weights
on every mesh, equal to one process's built within ``sharding_independent_initial_values()``. Another random
initializer (Orthogonal) is drawn on rank 0 alone, which sends each rank its piece. A large weight no rule of the
layout map matches is named in a warning with a rule that shards it; the rule, followed, shards it and the warning
stops.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from keras_dtensor_mixfix.testing import run_on_ranks

from test_keras import KERAS_OWN_DISTRIBUTION


def _mesh(world_size, shape=None):
    import keras

    shape = shape or ((1, world_size) if world_size == 2 else (world_size // 2, 2))
    return keras.distribution.DeviceMesh(shape, ["batch", "model"], keras.distribution.list_devices())


def _model():
    import keras

    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, name="wide", bias_initializer=keras.initializers.Constant(0.5)),
        keras.layers.LayerNormalization(name="norm"),
        keras.layers.Dense(6, name="mid", kernel_initializer=keras.initializers.TruncatedNormal(stddev=0.1)),
        keras.layers.Dense(4, name="head", kernel_initializer=keras.initializers.RandomUniform(-0.3, 0.3)),
    ], name="net")


def _built(model, optimizer):
    # paths without the first name (the model's; the optimizer's, which Keras numbers per process: adam_1)
    return [(v.path.split("/", 1)[-1], np.array(v.numpy())) for v in model.variables + optimizer.variables]


def build_on_ranks(mesh_shape):
    """The model and Adam built under ModelParallel on ``mesh_shape``: the non-scalar tensors torch's
    ``distribute_tensor`` was given, the boxes each position-keyed draw drew, every variable's placements and
    value."""
    import keras
    import torch.distributed as dist
    import torch.distributed.tensor as dtensor_module
    from torch.distributed.tensor import DTensor

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix._keras.backend import position_draws

    keras_integration.install()
    scattered = []
    drawn = []
    real_distribute = dtensor_module.distribute_tensor
    real_draw = position_draws.draw

    def recording_distribute(tensor, *args, **kwargs):
        scattered.append(tuple(tensor.shape))
        return real_distribute(tensor, *args, **kwargs)

    def recording_draw(kind, seed, shape, box, *args, **kwargs):
        drawn.append((kind, tuple(shape), tuple((s.start, s.stop) for s in box)))
        return real_draw(kind, seed, shape, box, *args, **kwargs)

    try:
        layout_map = keras.distribution.LayoutMap(_mesh(dist.get_world_size(), mesh_shape))
        layout_map[".*wide/kernel"] = (None, "model")
        layout_map[".*wide/bias"] = ("model",)
        layout_map[".*norm/gamma"] = ("model",)
        layout_map[".*norm/beta"] = ("model",)
        layout_map[".*mid/kernel"] = ("model", "batch")
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
        keras.utils.set_random_seed(5)
        dtensor_module.distribute_tensor = recording_distribute
        position_draws.draw = recording_draw
        try:
            model = _model()
            optimizer = keras.optimizers.Adam()
            optimizer.build(model.trainable_variables)
        finally:
            dtensor_module.distribute_tensor = real_distribute
            position_draws.draw = real_draw
        placements = {v.path: str(tuple(v.value.placements)) if isinstance(v.value, DTensor) else "plain"
                      for v in model.variables + optimizer.variables}
        values = _built(model, optimizer)
    finally:
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
    return scattered, drawn, placements, values


def one_process_build(mesh_shape):
    """The same model built in this process: with a ``mesh_shape`` distribution (a mesh of one device), or, with
    None, without one within ``sharding_independent_initial_values()``."""
    import keras

    from keras_dtensor_mixfix import keras_integration

    keras_integration.install()
    try:
        if mesh_shape is not None:
            keras.distribution.set_distribution(keras.distribution.ModelParallel(
                layout_map=keras.distribution.LayoutMap(_mesh(1, mesh_shape))))
        with keras_integration.sharding_independent_initial_values():
            keras.utils.set_random_seed(5)
            model = _model()
            optimizer = keras.optimizers.Adam()
            optimizer.build(model.trainable_variables)
        return _built(model, optimizer)
    finally:
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()


def _own_piece(shape, mesh_shape, rank, split):
    """The box of a 2-D ``shape`` on ``rank`` of a row-major (batch, model) mesh, ``split`` naming each dim's mesh
    axis (None, "batch" or "model"): torch.chunk's pieces."""
    coordinate = {"batch": rank // mesh_shape[1], "model": rank % mesh_shape[1]}
    count = {"batch": mesh_shape[0], "model": mesh_shape[1]}
    box = []
    for size, axis in zip(shape, split):
        if axis is None:
            box.append((0, size))
            continue
        chunk = -(-size // count[axis])
        start = min(coordinate[axis] * chunk, size)
        box.append((start, min(start + chunk, size)))
    return tuple(box)


@pytest.mark.skipif(KERAS_OWN_DISTRIBUTION, reason="Keras 3.16 makes its own layout-aware variables "
                    "(_initialize_distributed); the integration leaves them as Keras makes them")
@pytest.mark.parametrize("mesh_shape", [(1, 2), (2, 2), (1, 4)], ids=["1x2", "2x2", "1x4"])
def test_each_rank_draws_only_its_pieces_and_the_initial_values_do_not_depend_on_the_mesh(mesh_shape):
    world_size = mesh_shape[0] * mesh_shape[1]
    results = run_on_ranks(build_on_ranks, mesh_shape, world_size=world_size, timeout=600)
    for rank, (scattered, drawn, _, _) in enumerate(results):
        # each random kernel drawn once, as this rank's piece alone (the head, replicated, whole on every rank);
        # biases, gamma, beta and Adam's slots are filled in pieces, and nothing but Adam's scalars (its step and
        # learning rate, more before Keras 3.13) goes through torch's distribute_tensor
        assert drawn == [("uniform", (8, 16), _own_piece((8, 16), mesh_shape, rank, (None, "model"))),
                         ("truncated_normal", (16, 6), _own_piece((16, 6), mesh_shape, rank, ("model", "batch"))),
                         ("uniform", (6, 4), ((0, 6), (0, 4)))], (rank, drawn)
        assert [shape for shape in scattered if shape] == [], (rank, scattered)
    _, _, placements, values = results[0]
    assert placements["net/wide/bias"] == placements["net/norm/gamma"] == placements["net/wide/kernel"].replace(
        "Shard(dim=1)", "Shard(dim=0)")
    assert any("wide_bias_momentum" in path and "Shard(dim=0)" in p for path, p in placements.items())
    for _, _, _, other in results[1:]:  # every rank reads the same global values
        for (path, got), (_, want) in zip(other, values):
            np.testing.assert_array_equal(got, want, err_msg=path)
    # the same values on a mesh of one device and without a distribution, within sharding_independent_initial_values
    # (the one-device mesh in a process of its own: building it starts a process group, which the pytest process keeps)
    one_device = run_on_ranks(one_process_build, (1, 1), world_size=1, timeout=300)[0]
    for reference in (one_device, one_process_build(None)):
        assert [path for path, _ in values] == [path for path, _ in reference]
        for (path, got), (_, want) in zip(values, reference):
            np.testing.assert_array_equal(got, want, err_msg=path)
    np.testing.assert_array_equal(dict(values)["wide/bias"], np.full((16,), 0.5, dtype="float32"))


@pytest.mark.skipif(KERAS_OWN_DISTRIBUTION, reason="Keras 3.16 draws every initial value as Keras does, "
                    "distributed or not: the context changes nothing there")
def test_without_a_distribution_keras_draws_as_it_does_unless_asked_to_draw_by_position():
    import keras

    from keras_dtensor_mixfix import KerasIntegrationNotInstalledError, keras_integration

    def kernels():
        keras.utils.set_random_seed(5)
        return [np.array(w) for w in _model().get_weights()[::2]]

    without_package = kernels()
    keras_integration.install()
    try:
        installed = kernels()
        by_position = one_process_build(None)
    finally:
        keras_integration.uninstall()
    for got, want in zip(installed, without_package):
        np.testing.assert_array_equal(got, want)
    # drawn by position: other values of the same distribution (a uniform kernel stays within its limits)
    assert not np.array_equal(dict(by_position)["wide/kernel"], without_package[0])
    limit = np.sqrt(6 / (8 + 16))
    assert np.abs(dict(by_position)["wide/kernel"]).max() <= limit
    # not installed, the context would not draw by position: it says so, and how to install
    with pytest.raises(KerasIntegrationNotInstalledError, match=r"keras_integration.install\(\) first"):
        keras_integration.sharding_independent_initial_values()


def warnings_on_ranks(world_size, rule):
    import keras
    from torch.distributed.tensor import DTensor

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix._keras.layout_maps import whole_weights

    messages = []

    class Recorder(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Recorder(logging.WARNING)
    logger = logging.getLogger("keras_dtensor_mixfix")
    logger.addHandler(handler)
    keras_integration.install()
    threshold, whole_weights.LARGE_WEIGHT_ELEMENTS = whole_weights.LARGE_WEIGHT_ELEMENTS, 100
    whole_weights._warned.clear()
    try:
        layout_map = keras.distribution.LayoutMap(_mesh(world_size))
        if rule is not None:
            layout_map[".*wide/kernel"] = rule
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
        model = _model()
        kernel = model.get_layer("wide").kernel.value
        placements = str(tuple(kernel.placements)) if isinstance(kernel, DTensor) else "plain"
    finally:
        whole_weights.LARGE_WEIGHT_ELEMENTS = threshold
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
        logger.removeHandler(handler)
    return [m for m in messages if "matches no rule" in m], placements


def test_a_large_weight_left_whole_is_named_with_a_rule_that_shards_it():
    (warned, placements), _ = run_on_ranks(warnings_on_ranks, 2, None, world_size=2, timeout=600)
    # the (8, 16) kernel is over the (lowered) threshold; the (16, 4) head and (16,) vectors are not
    assert len(warned) == 1 and "net/wide/kernel 8x16" in warned[0], warned
    assert "layout_map['net/wide/kernel'] = (None, 'model') would shard both" in warned[0], warned[0]
    whole = "plain" if KERAS_OWN_DISTRIBUTION else "(Replicate(), Replicate())"  # 3.16 keeps a whole one plain
    assert placements == whole
    # the advice, followed: sharded, and nothing to say
    (warned, placements), _ = run_on_ranks(warnings_on_ranks, 2, (None, "model"), world_size=2, timeout=600)
    assert warned == [] and placements == "(Replicate(), Shard(dim=1))"
    # whole by the map's own choice: nothing to say either
    (warned, placements), _ = run_on_ranks(warnings_on_ranks, 2, (None, None), world_size=2, timeout=600)
    assert warned == [] and placements == whole


def failing_draw_on_ranks():
    """Rank 0's draw of a sharded initial value it draws alone (an Orthogonal kernel) raises: what each rank
    raises."""
    import keras
    import torch.distributed as dist

    from keras_dtensor_mixfix import keras_integration

    keras_integration.install()
    real_draw = keras.initializers.Orthogonal.__call__

    def failing_draw(self, shape, *args, **kwargs):
        raise ValueError(f"cannot draw {tuple(shape)}")

    try:
        layout_map = keras.distribution.LayoutMap(_mesh(2))
        layout_map[".*wide/kernel"] = (None, "model")
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
        if dist.get_rank() == 0:
            keras.initializers.Orthogonal.__call__ = failing_draw
        try:
            keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="wide", kernel_initializer="orthogonal")],
                             name="net")
            raised = None
        except Exception as error:  # noqa: BLE001  # what each rank raises is the result
            raised = (type(error).__name__, str(error))
    finally:
        keras.initializers.Orthogonal.__call__ = real_draw
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
    return raised


@pytest.mark.skipif(KERAS_OWN_DISTRIBUTION, reason="Keras 3.16 makes its own layout-aware variables "
                    "(_initialize_distributed): every rank draws, as Keras does")
def test_a_draw_that_fails_on_rank_zero_stops_every_rank_with_the_reason():
    raised_0, raised_1 = run_on_ranks(failing_draw_on_ranks, world_size=2, timeout=300)
    assert raised_0 == ("ValueError", "cannot draw (8, 16)"), raised_0
    assert raised_1 is not None and raised_1[0] == "RankZeroStopped", raised_1
    assert "rank 0 raised while drawing the initial value of net/wide/kernel" in raised_1[1], raised_1

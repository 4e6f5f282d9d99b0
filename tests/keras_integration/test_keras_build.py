"""Building under ``ModelParallel``: no whole initial value on more than one rank; large weights left whole named.

Zeros, ones and constants (biases, norm scales, every optimizer slot) are made by each rank for its own piece,
with no whole tensor and no scatter; a sharded random initial value is drawn on rank 0 alone, which sends each
rank its piece; the values equal one process's. A large weight no rule of the layout map
matches is named in a warning with a rule that shards it; the rule, followed, shards it and the warning stops.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from keras_dtensor_mixfix.testing import run_on_ranks

from test_keras import KERAS_OWN_DISTRIBUTION


def _mesh(world_size):
    import keras

    shape = (1, world_size) if world_size == 2 else (world_size // 2, 2)
    return keras.distribution.DeviceMesh(shape, ["batch", "model"], keras.distribution.list_devices())


def _model():
    import keras

    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, name="wide", bias_initializer=keras.initializers.Constant(0.5)),
        keras.layers.LayerNormalization(name="norm"),
        keras.layers.Dense(4, name="head"),
    ], name="net")


def build_on_ranks(world_size):
    import keras
    import torch.distributed.tensor as dtensor_module
    from torch.distributed.tensor import DTensor

    from keras_dtensor_mixfix import keras_integration

    keras_integration.install()
    scattered = []
    drawn = []
    real_distribute = dtensor_module.distribute_tensor
    real_draw = keras.initializers.GlorotUniform.__call__

    def recording_distribute(tensor, *args, **kwargs):
        scattered.append(tuple(tensor.shape))
        return real_distribute(tensor, *args, **kwargs)

    def recording_draw(self, shape, *args, **kwargs):
        drawn.append(tuple(shape))
        return real_draw(self, shape, *args, **kwargs)

    try:
        layout_map = keras.distribution.LayoutMap(_mesh(world_size))
        layout_map[".*wide/kernel"] = (None, "model")
        layout_map[".*wide/bias"] = ("model",)
        layout_map[".*norm/gamma"] = ("model",)
        layout_map[".*norm/beta"] = ("model",)
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
        keras.utils.set_random_seed(5)
        dtensor_module.distribute_tensor = recording_distribute
        keras.initializers.GlorotUniform.__call__ = recording_draw
        try:
            model = _model()
            optimizer = keras.optimizers.Adam()
            optimizer.build(model.trainable_variables)
        finally:
            dtensor_module.distribute_tensor = real_distribute
            keras.initializers.GlorotUniform.__call__ = real_draw
        placements = {v.path: str(tuple(v.value.placements)) if isinstance(v.value, DTensor) else "plain"
                      for v in model.variables + optimizer.variables}
        values = [(v.path.split("/", 1)[-1], np.array(v.numpy())) for v in model.variables + optimizer.variables]
    finally:
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
    return scattered, drawn, placements, values


@pytest.mark.skipif(KERAS_OWN_DISTRIBUTION, reason="Keras 3.16 makes its own layout-aware variables "
                    "(_initialize_distributed); the integration leaves them as Keras makes them")
@pytest.mark.parametrize("world_size", [2, 4])
def test_constant_initial_values_are_made_in_pieces(world_size):
    import keras

    results = run_on_ranks(build_on_ranks, world_size, world_size=world_size, timeout=600)
    for rank, (scattered, drawn, _, _) in enumerate(results):
        # the random kernel sharded over the processes is drawn whole on rank 0 alone, which sends each rank its
        # piece; the replicated one (every rank holds it whole anyway) is drawn everywhere and distributed by
        # torch, as are the scalars Adam makes from values (its step and learning rate, more before Keras 3.13);
        # biases, gamma, beta and Adam's slots are made in pieces
        assert drawn == ([(8, 16), (16, 4)] if rank == 0 else [(16, 4)]), (rank, drawn)
        assert [shape for shape in scattered if shape] == [(16, 4)], (rank, scattered)
    _, _, placements, values = results[0]
    assert placements["net/wide/bias"] == placements["net/norm/gamma"] == placements["net/wide/kernel"].replace(
        "Shard(dim=1)", "Shard(dim=0)")
    assert any("wide_bias_momentum" in path and "Shard(dim=0)" in p for path, p in placements.items())
    keras.utils.set_random_seed(5)
    model = _model()
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    # paths without the first name (the model's; the optimizer's, which Keras numbers per process: adam_1)
    single = [(v.path.split("/", 1)[-1], np.array(v.numpy())) for v in model.variables + optimizer.variables]
    assert [path for path, _ in values] == [path for path, _ in single]
    for (path, got), (_, want) in zip(values, single):
        np.testing.assert_array_equal(got, want, err_msg=path)
    np.testing.assert_array_equal(dict(values)["wide/bias"], np.full((16,), 0.5, dtype="float32"))


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
    """Rank 0's draw of a sharded initial value raises: what each rank raises."""
    import keras
    import torch.distributed as dist

    from keras_dtensor_mixfix import keras_integration

    keras_integration.install()
    real_draw = keras.initializers.GlorotUniform.__call__

    def failing_draw(self, shape, *args, **kwargs):
        raise ValueError(f"cannot draw {tuple(shape)}")

    try:
        layout_map = keras.distribution.LayoutMap(_mesh(2))
        layout_map[".*wide/kernel"] = (None, "model")
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
        if dist.get_rank() == 0:
            keras.initializers.GlorotUniform.__call__ = failing_draw
        try:
            _model()
            raised = None
        except Exception as error:  # noqa: BLE001  # what each rank raises is the result
            raised = (type(error).__name__, str(error))
    finally:
        keras.initializers.GlorotUniform.__call__ = real_draw
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

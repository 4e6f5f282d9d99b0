"""A ``keras.distribution`` mesh of one device in a one-process job (a ModelParallel script run on one GPU): its
variables, batches and outputs are Keras' own plain tensors on that device, so ``fit``, ``evaluate``, ``predict``,
``save_weights``/``load_weights`` and the ``.keras`` file give exactly what the same program gives without a
distribution from the same initial weights (bit for bit), with none of DTensor's host time per op (BENCHMARKS.md
"What a GPU will see"); ``KERAS_DTENSOR_MIXFIX_DTENSORS_ON_ONE_DEVICE=1`` keeps DTensors there (what
``benchmarks/gpu_check.py`` checks on one GPU), with the same values to float tolerance.

On Keras 3.16, whose own torch ``distribution_lib`` the integration keeps, Keras' module decides what a one-device
mesh holds: these tests run on 3.12 to 3.15.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

from _keras_releases import KERAS_RELEASE, drawing_as_distributed_jobs
from keras_dtensor_mixfix.testing import run_on_ranks

pytestmark = pytest.mark.skipif(
    KERAS_RELEASE is not None and KERAS_RELEASE >= (3, 16),
    reason="Keras 3.16 keeps its own torch distribution_lib, which decides what a one-device mesh holds")


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, 6)).astype("float32"), (np.arange(8) % 4).astype("int64")


def one_device_program(folder, distributed, dtensors):
    """A small model trained with ``fit`` (2 epochs), evaluated, predicted, saved and loaded: every value it reads,
    and the type of its variables' values; under ModelParallel on a (1, 1) mesh when ``distributed``, with
    ``KERAS_DTENSOR_MIXFIX_DTENSORS_ON_ONE_DEVICE`` set to ``dtensors``."""
    import keras
    import torch

    from keras_dtensor_mixfix import keras_integration

    os.environ["KERAS_DTENSOR_MIXFIX_DTENSORS_ON_ONE_DEVICE"] = "1" if dtensors else "0"
    if distributed:
        assert keras_integration.install()
        mesh = keras.distribution.DeviceMesh((1, 1), ["batch", "model"], keras.distribution.list_devices())
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*hidden.kernel"] = (None, "model")
        layout_map[".*logits.kernel"] = ("model", None)
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                             batch_dim_name="batch"))
    try:
        keras.utils.set_random_seed(0)
        # without a distribution: the initial values a distributed job draws (docs/keras.md "Building")
        with contextlib.nullcontext() if distributed else drawing_as_distributed_jobs():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu", name="hidden"),
                                      keras.layers.Dense(4, name="logits")])
        model.compile(optimizer=keras.optimizers.Adam(0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x, y = _data()
        history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history["loss"]
        evaluated = model.evaluate(x, y, batch_size=4, verbose=0)
        predicted = model.predict(x, batch_size=4, verbose=0)
        kinds = sorted({type(v.value).__name__ for v in model.weights + model.optimizer.variables})
        weights_file = os.path.join(folder, f"{distributed}-{dtensors}.weights.h5")
        model_file = os.path.join(folder, f"{distributed}-{dtensors}.keras")
        model.save_weights(weights_file)
        model.save(model_file)
        trained = [np.asarray(w) for w in model.get_weights()]
        model.set_weights([np.zeros_like(w) for w in trained])
        model.load_weights(weights_file)
        loaded = [np.asarray(w) for w in model.get_weights()]
        reloaded = [np.asarray(w) for w in keras.saving.load_model(model_file).get_weights()]
        return {"history": history, "evaluate": evaluated, "predict": predicted, "kinds": kinds,
                "weights": trained, "loaded": loaded, "reloaded": reloaded,
                "device": str(model.weights[0].value.device), "torch_device": str(torch.empty(0).device)}
    finally:
        if distributed:
            keras.distribution.set_distribution(None)
            keras_integration.uninstall()


def _run(tmp_path, distributed, dtensors=False):
    return run_on_ranks(one_device_program, str(tmp_path), distributed, dtensors, world_size=1, timeout=300)[0]


def _assert_values(got, want, exact):
    def same(a, b, what):
        if exact:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)
        else:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=what)

    same(got["history"], want["history"], "fit's losses")
    same(got["evaluate"], want["evaluate"], "evaluate")
    same(got["predict"], want["predict"], "predict")
    for key in ("weights", "loaded", "reloaded"):
        for index, (a, b) in enumerate(zip(got[key], want[key])):
            same(a, b, f"{key}[{index}]")


def test_a_one_device_mesh_holds_keras_own_plain_tensors_and_changes_no_value(tmp_path):
    plain = _run(tmp_path, distributed=False)
    one_device = _run(tmp_path, distributed=True)
    assert one_device["kinds"] == plain["kinds"] == ["Parameter"], (one_device["kinds"], plain["kinds"])
    assert one_device["device"] == plain["device"]
    _assert_values(one_device, plain, exact=True)
    for got, want in zip(one_device["loaded"], one_device["weights"]):
        np.testing.assert_array_equal(got, want)


def test_dtensors_on_one_device_when_asked_give_the_same_values(tmp_path):
    plain = _run(tmp_path, distributed=False)
    kept = _run(tmp_path, distributed=True, dtensors=True)
    assert "DTensor" in kept["kinds"], kept["kinds"]
    _assert_values(kept, plain, exact=False)

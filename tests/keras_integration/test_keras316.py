"""Keras 3.16 (keras-nightly), which ships its own torch distribution, composed with the package.

Keras' own distribution_lib, variables, data distribution and global values are kept; while
patched, our promotion replaces Keras' ``KerasDTensorPromotionMode`` (a per-thread dispatch mode),
so ``jit_compile=True`` compiles under ``ModelParallel``; saving writes from rank 0 only. Every
test compares 2 gloo ranks with a single-process reference (values and trained weights).
"""

from __future__ import annotations

import importlib
import logging
import os

import numpy as np
import pytest

from keras_dtensor_mixfix.testing import run_on_ranks

keras = pytest.importorskip("keras")
if getattr(importlib.import_module("keras.src.backend"), "distribution_lib", None) is None:
    pytest.skip(f"needs a Keras with its own torch distribution (keras-nightly 3.16, "
                f"pip install keras-nightly==3.16.0.dev2026102704); this is Keras {keras.__version__}",
                allow_module_level=True)


def _model(prefix=""):
    import keras

    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(32, activation="relu", name="d1"),
        keras.layers.Dense(8, name="d2"),
    ], name=f"{prefix}mlp")


def _data(rows=32):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 16)).astype("float32")
    y = rng.normal(size=(rows, 8)).astype("float32")
    return x, y


def _set_model_parallel():
    import keras

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((1, len(devices)), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*d1/kernel"] = (None, "model")
    layout_map[".*d1/bias"] = ("model",)
    layout_map[".*d2/kernel"] = ("model", None)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    distribution.auto_shard_dataset = False  # Keras 3.16: every process feeds its batch (the whole one here)
    keras.distribution.set_distribution(distribution)
    return distribution


def _keras_mode_on():
    import torch
    from keras.src.backend.torch.ops import core

    return any(isinstance(mode, core.KerasDTensorPromotionMode)
               for mode in torch.utils._python_dispatch._get_current_dispatch_mode_stack())


def _compile(model, jit):
    import keras

    model.compile(optimizer=keras.optimizers.AdamW(0.01), loss="mse", metrics=["mae"], jit_compile=jit)


def _reference(initial, jit=False, epochs=2):
    """Single process, no distribution: the same initial weights and data."""
    x, y = _data()
    model = _model("ref_")
    _compile(model, False)
    model.set_weights(initial)
    history = model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    return (model.get_weights(), history.history, model.evaluate(x, y, batch_size=8, verbose=0),
            model.predict(x, batch_size=8, verbose=0))


# --------------------------------------------------------------------------- training


def fit_model_parallel(plugin, jit, epochs=2, kind="model_parallel"):
    import keras
    import torch
    from torch._dynamo.utils import counters
    from torch.distributed.tensor import DTensor

    from keras_dtensor_mixfix import keras_integration

    if plugin:
        assert keras_integration.install()
    out = {}
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("keras_dtensor_mixfix").addHandler(handler)
    try:
        keras.utils.set_random_seed(5)
        if kind == "model_parallel":
            _set_model_parallel()
        else:  # each process feeds its own shard: the same rows on both, so the mean gradient is one process's
            keras.distribution.set_distribution(keras.distribution.DataParallel(auto_shard_dataset=False))
        out["keras_mode_on"] = _keras_mode_on()
        model = _model()
        _compile(model, jit)
        out["initial"] = model.get_weights()  # global values
        out["placements"] = {v.path: str(tuple(v.value.placements)) for v in model.weights
                             if isinstance(v.value, DTensor)}
        x, y = _data()
        counters.clear()
        history = model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
        out["compiled_graphs"] = counters["stats"]["unique_graphs"]
        out["history"] = history.history
        out["trained"] = model.get_weights()
        out["evaluated"] = model.evaluate(x, y, batch_size=8, verbose=0)
        out["predicted"] = model.predict(x, batch_size=8, verbose=0)
        out["warnings"] = warnings
        if jit:  # after the values above were read
            out["one_more_step"] = _one_more_step(model, x[:8], y[:8])
    finally:
        logging.getLogger("keras_dtensor_mixfix").removeHandler(handler)
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
        keras.backend.clear_session()
        torch._dynamo.reset()
    return out


def _one_more_step(model, x, y):
    """One more training step after another (evaluate and predict ran since fit; the first step after them may
    compile again): the graphs TorchDynamo added, the graph breaks it met, and the collectives the step ran (as
    the profiler saw them: compiled code calls them through the dispatcher too)."""
    import collections

    import torch
    from torch._dynamo.utils import counters

    model.train_on_batch(x, y)
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        model.train_on_batch(x, y)
    collectives = collections.Counter(event.name.split("::")[-1] for event in profile.events()
                                      if event.name.startswith(("_c10d_functional::", "c10d::"))
                                      and "wait" not in event.name)
    return {"new_graphs": counters["stats"]["unique_graphs"] - graphs,
            "graph_breaks": sum(counters["graph_break"].values()) - breaks, "collectives": dict(collectives)}


def _check_against_reference(out, rtol=1e-5, sharded=True):
    weights, history, evaluated, predicted = _reference(out["initial"])
    for got, want in zip(out["trained"], weights):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-6)
    for key in ("loss", "mae"):
        np.testing.assert_allclose(out["history"][key], history[key], rtol=rtol, atol=1e-7)
    np.testing.assert_allclose(out["evaluated"], evaluated, rtol=rtol, atol=1e-7)
    np.testing.assert_allclose(out["predicted"], predicted, rtol=rtol, atol=1e-6)
    if not sharded:
        return
    assert out["placements"]["mlp/d1/kernel"] == "(Replicate(), Shard(dim=1))", out["placements"]
    assert out["placements"]["mlp/d2/kernel"] == "(Replicate(), Shard(dim=0))", out["placements"]


def test_model_parallel_fit_with_our_promotion_equals_single_process():
    results = run_on_ranks(fit_model_parallel, True, False, world_size=2, timeout=600)
    out = results[0]
    assert not out["keras_mode_on"]  # replaced by the dispatch rules while patched
    # nothing to say: the model is sharded under the distribution it was built under (it once warned that no
    # distribution was set, from the check that keeps DistributedDataParallel off DTensor weights)
    assert out["warnings"] == [], out["warnings"]
    _check_against_reference(out)
    assert results[1]["history"] == out["history"]


def test_keras_alone_is_unchanged_and_equals_single_process():
    # The reference for "keep Keras' public behaviour": the same run without the integration.
    out = run_on_ranks(fit_model_parallel, False, False, world_size=2, timeout=600)[0]
    assert out["keras_mode_on"]
    _check_against_reference(out)


def test_jit_compile_really_compiles_under_model_parallel():
    out = run_on_ranks(fit_model_parallel, True, True, world_size=2, timeout=600)[0]
    assert out["compiled_graphs"] >= 1, out["compiled_graphs"]  # Keras alone: 0 (it refuses, runs eagerly)
    _check_against_reference(out)
    # a later step runs the compiled graph as it is: nothing recompiled, no graph break; and it gathers nothing
    # (every gradient has its weight's layout; the optimizer once gathered every sharded gradient whole because
    # the unmapped d2/bias keeps plain slots: 8 all-gathers per step, the compiled step slower than eager)
    step = out["one_more_step"]
    assert step["new_graphs"] == 0 and step["graph_breaks"] == 0, step
    assert step["collectives"] and not any("gather" in name for name in step["collectives"]), step


@pytest.mark.parametrize("plugin", [False, True], ids=["keras_alone", "with_package"])
def test_data_parallel_is_keras_own_with_or_without_the_package(plugin):
    out = run_on_ranks(fit_model_parallel, plugin, False, 2, "data_parallel", world_size=2, timeout=600)[0]
    assert not out["keras_mode_on"]  # Keras enters no mode for DataParallel
    _check_against_reference(out, sharded=False)


def test_auto_activation_installs_into_keras_316():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("KERAS_DTENSOR_MIXFIX")}  # auto-activation on
    env["KERAS_BACKEND"] = "torch"
    code = ("import keras; from keras_dtensor_mixfix import _autoload, keras_integration; "
            "print(_autoload.keras_state); print(keras_integration.report()[-1])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-2] == "installed" and "KerasDTensorPromotionMode" in lines[-1], result.stdout


# --------------------------------------------------------------------------- saving


def save_and_load(directory):
    import keras
    import torch
    from torch.distributed.tensor import DTensor

    from keras_dtensor_mixfix import keras_integration

    assert keras_integration.install()
    try:
        keras.utils.set_random_seed(3)
        _set_model_parallel()
        model = _model()
        _compile(model, False)
        x, y = _data()
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        weights = model.get_weights()
        model.save_weights(os.path.join(directory, "sharded.weights.h5"))
        model.save(os.path.join(directory, "sharded.keras"))
        # a single-device checkpoint loads into the sharded model and keeps its layout
        model.load_weights(os.path.join(directory, "single.weights.h5"))
        loaded = model.get_weights()
        kernel = model.layers[0].kernel.value
        placements = str(tuple(kernel.placements)) if isinstance(kernel, DTensor) else "plain"
        reloaded = keras.saving.load_model(os.path.join(directory, "sharded.keras"))
        reloaded_kernel = reloaded.layers[0].kernel.value
        reloaded_placements = (str(tuple(reloaded_kernel.placements)) if isinstance(reloaded_kernel, DTensor)
                               else "plain")
        reloaded_weights = reloaded.get_weights()
        reloaded_prediction = reloaded.predict(x, batch_size=8, verbose=0)
    finally:
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
        keras.backend.clear_session()
        torch._dynamo.reset()
    return dict(weights=weights, loaded=loaded, placements=placements, reloaded_placements=reloaded_placements,
                reloaded_weights=reloaded_weights, reloaded_prediction=reloaded_prediction)


def test_save_and_load_hold_global_values(tmp_path):
    import keras

    x, y = _data()
    single = _model("single_")
    _compile(single, False)
    single.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    single.save_weights(str(tmp_path / "single.weights.h5"))

    out = run_on_ranks(save_and_load, str(tmp_path), world_size=2, timeout=600)[0]
    for got, want in zip(out["loaded"], single.get_weights()):
        np.testing.assert_array_equal(got, want)
    assert out["placements"] == out["reloaded_placements"] == "(Replicate(), Shard(dim=1))"
    for got, want in zip(out["reloaded_weights"], out["weights"]):
        np.testing.assert_array_equal(got, want)
    # what rank 0 wrote are GLOBAL values: they load into a single-device model
    fresh = _model("fresh_")
    fresh.load_weights(str(tmp_path / "sharded.weights.h5"))
    for got, want in zip(fresh.get_weights(), out["weights"]):
        np.testing.assert_array_equal(got, want)
    whole = keras.saving.load_model(str(tmp_path / "sharded.keras"))
    for got, want in zip(whole.get_weights(), out["weights"]):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(out["reloaded_prediction"], whole.predict(x, batch_size=8, verbose=0), rtol=1e-5,
                               atol=1e-6)
    assert sorted(os.listdir(tmp_path)) == ["sharded.keras", "sharded.weights.h5", "single.weights.h5"]


# --------------------------------------------------------------------------- lifecycle


def mode_lifecycle():
    import keras
    from keras.src.backend.torch.ops import core

    import keras_dtensor_mixfix as mf
    from keras_dtensor_mixfix import keras_integration

    keras_activate = core.activate_dtensor_promotion
    seen = {}
    _set_model_parallel()
    seen["keras alone"] = _keras_mode_on()
    assert keras_integration.install()  # installed after the distribution: the mode comes off here
    seen["installed"] = _keras_mode_on()
    mf.unpatch()
    seen["unpatched"] = _keras_mode_on()
    mf.patch()
    seen["patched again"] = _keras_mode_on()
    keras.distribution.set_distribution(None)
    seen["no distribution"] = _keras_mode_on()
    _set_model_parallel()
    seen["distribution set while patched"] = _keras_mode_on()
    keras_integration.uninstall()
    seen["uninstalled"] = _keras_mode_on()
    seen["keras' activate back"] = core.activate_dtensor_promotion is keras_activate
    keras.distribution.set_distribution(None)
    seen["keras alone, no distribution"] = _keras_mode_on()
    return seen


def test_keras_mode_is_back_whenever_not_patched_or_uninstalled():
    assert run_on_ranks(mode_lifecycle, world_size=2, timeout=600)[0] == {
        "keras alone": True, "installed": False, "unpatched": True, "patched again": False,
        "no distribution": False, "distribution set while patched": False, "uninstalled": True,
        "keras' activate back": True, "keras alone, no distribution": False,
    }

"""keras.distribution on the torch backend: sharded training equals single-device training.

Written for Keras 3.15.1, where the package brings the torch distribution; on Keras 3.16, which
brings its own (``KERAS_OWN_DISTRIBUTION``), the same training runs with Keras' semantics where they
differ: each process feeds its own shard of the batch (every process feeds the same rows here, so
the mean over the global batch is one process's), a variable whose layout shards nothing stays a
plain tensor, and a layout is kept as given (see ``_distribution``).
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest

from keras_dtensor_mixfix.testing import run_on_ranks

from _keras_releases import OPS_TRACE_IN_ONE_GRAPH

KERAS_OWN_DISTRIBUTION = getattr(importlib.import_module("keras.src.backend"), "distribution_lib", None) is not None
"""Keras 3.16 and later: its own torch distribution_lib, layout-aware variables and data distribution."""

OPTIMIZERS = ["sgd_nesterov", "adam", "adamw", "adagrad", "adadelta", "adamax", "nadam", "rmsprop", "lion",
              "adafactor", "lamb", "ftrl"]


def _optimizer(name):
    import keras

    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.9)
    return {
        "sgd_nesterov": lambda: keras.optimizers.SGD(schedule, momentum=0.9, nesterov=True, clipnorm=1.0),
        "adam": lambda: keras.optimizers.Adam(schedule, amsgrad=True, clipvalue=0.5),
        "adamw": lambda: keras.optimizers.AdamW(0.02, weight_decay=0.01, global_clipnorm=1.0),
        "adagrad": lambda: keras.optimizers.Adagrad(0.05),
        "adadelta": lambda: keras.optimizers.Adadelta(1.0),
        "adamax": lambda: keras.optimizers.Adamax(0.02),
        "nadam": lambda: keras.optimizers.Nadam(0.02),
        "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
        "lion": lambda: keras.optimizers.Lion(0.005),
        "adafactor": lambda: keras.optimizers.Adafactor(0.05),
        "lamb": lambda: keras.optimizers.Lamb(0.02),
        "ftrl": lambda: keras.optimizers.Ftrl(0.05),
    }[name]()


def _model(name_prefix=""):
    import keras

    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu", name="dense_a"),
        keras.layers.Dense(6, name="dense_b"),  # 6 over the model axis: even on 2, uneven on 4
        keras.layers.Dense(1, name="dense_c"),  # a size-1 dim asked to be sharded
    ], name=f"{name_prefix}net")


def _data(rows=24):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1).astype("float32")
    return x, y


def _inputs(kind, x, y, batch_size):
    import keras
    import torch

    if kind == "numpy":
        return dict(x=x, y=y, batch_size=batch_size)
    if kind == "dataloader":
        dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        return dict(x=torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False))
    if kind == "pydataset":
        class Batches(keras.utils.PyDataset):
            def __len__(self):
                return len(x) // batch_size

            def __getitem__(self, index):
                part = slice(index * batch_size, (index + 1) * batch_size)
                return x[part], y[part]

        return dict(x=Batches())
    if kind == "generator":
        def batches():
            while True:
                for start in range(0, len(x), batch_size):
                    yield x[start:start + batch_size], y[start:start + batch_size]

        return dict(x=batches(), steps_per_epoch=len(x) // batch_size)
    raise ValueError(kind)


def _distribution(kind, world_size):
    import keras

    devices = keras.distribution.list_devices()
    # keras.distribution.get_device_count: Keras 3.13 and later
    count = getattr(keras.distribution, "get_device_count", lambda: len(keras.distribution.list_devices()))
    assert len(devices) == world_size == count()
    if kind == "data_parallel":
        distribution = keras.distribution.DataParallel()
    elif kind == "data_parallel_devices":
        distribution = keras.distribution.DataParallel(devices=devices)
    else:
        shape = (1, world_size) if kind == "model_parallel" else (world_size // 2, 2)
        mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*dense_a/kernel"] = (None, "model")  # column-wise
        layout_map[".*dense_a/bias"] = ("model",)
        layout_map[".*dense_b.*kernel"] = ("model", None)  # row-wise, regex key
        if not KERAS_OWN_DISTRIBUTION:
            # Keras 3.16 shards the size-1 dim unevenly (one rank holds (6, 0)), and then its optimizer's
            # in-place update of dense_c/bias (plain) by a sharded gradient fails, with Keras alone too
            layout_map[".*dense_c/kernel"] = (None, "model")  # size-1 dim: replicated with a warning
        layout_map[".*dense_b/output"] = ("batch", None)  # a layer-output layout
        distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    if KERAS_OWN_DISTRIBUTION:
        # Keras 3.16: NumPy, DataLoader and generator inputs on several processes need this, and each
        # process then feeds its own shard: the same rows on every process, so the mean is one process's
        distribution.auto_shard_dataset = False
    return distribution


def _expected_placements(kind, world_size):
    """The DTensor placements of the variables (by path); on Keras 3.16 the unsharded ones are plain."""
    from torch.distributed.tensor import Replicate, Shard

    if kind.startswith("data_parallel"):
        expected = {path: (Replicate(),)
                    for path in ("dense_a/kernel", "dense_a/bias", "dense_b/kernel", "dense_c/kernel")}
    else:
        expected = {
            "dense_a/kernel": (Replicate(), Shard(1)),
            "dense_a/bias": (Replicate(), Shard(0)),
            "dense_b/kernel": (Replicate(), Shard(0)),
            "dense_b/bias": (Replicate(), Replicate()),
            "dense_c/kernel": (Replicate(), Replicate()),
        }
    if KERAS_OWN_DISTRIBUTION:
        expected = {path: want if any(isinstance(p, Shard) for p in want) else None for path, want in expected.items()}
    return expected


def keras_fit(world_size, kind, optimizer, input_kind="numpy", jit=False, epochs=2):
    import keras
    from torch.distributed.tensor import DTensor

    from keras_dtensor_mixfix import keras_integration

    assert keras_integration.install()
    x, y = _data()
    batch_size = 8
    try:
        keras.utils.set_random_seed(7)
        distribution = _distribution(kind, world_size)
        keras.distribution.set_distribution(distribution)
        model = _model()
        model.compile(optimizer=_optimizer(optimizer), loss="mse", metrics=["mae"], jit_compile=jit)
        initial = model.get_weights()  # global values
        placements = {v.path.split("/", 1)[1]: tuple(v.value.placements) for v in model.weights
                      if isinstance(v.value, DTensor)}
        history = model.fit(**_inputs(input_kind, x, y, batch_size), epochs=epochs, shuffle=False, verbose=0)
        # optimizer slots are built at the first step and inherit their variable's layout
        slot_placements = {tuple(v.value.placements) for v in model.optimizer.variables
                           if isinstance(v.value, DTensor) and "dense_a_kernel" in v.path}
        trained = model.get_weights()
        evaluated = model.evaluate(x, y, batch_size=batch_size, verbose=0)
        predicted = model.predict(x, batch_size=batch_size, verbose=0)
        keras.distribution.set_distribution(None)
        # the sharded model used with no distribution in force, every process feeding the same rows; compiled
        # again, so its steps are made anew: Keras 3.16 alone would then wrap it in DistributedDataParallel,
        # whose broadcast fails on DTensor weights
        model.compile(optimizer=_optimizer(optimizer), loss="mse", metrics=["mae"], jit_compile=jit)
        without_distribution = (model.evaluate(x, y, batch_size=batch_size, verbose=0),
                                keras.ops.convert_to_numpy(model.predict(x, batch_size=batch_size, verbose=0)))
    finally:
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()

    # single-device reference: same initial weights, same data, plain tensors
    reference = _model("ref_")
    reference.compile(optimizer=_optimizer(optimizer), loss="mse", metrics=["mae"])
    reference.set_weights(initial)
    ref_history = reference.fit(**_inputs(input_kind, x, y, batch_size), epochs=epochs, shuffle=False, verbose=0)
    for got, want in zip(trained, reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for key in ("loss", "mae"):
        assert all(type(v) is float for v in history.history[key]), history.history
        np.testing.assert_allclose(history.history[key], ref_history.history[key], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(evaluated, reference.evaluate(x, y, batch_size=batch_size, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(predicted, reference.predict(x, batch_size=batch_size, verbose=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(without_distribution[0], evaluated, rtol=1e-5)
    np.testing.assert_allclose(without_distribution[1], predicted, rtol=1e-5, atol=1e-6)
    expected = _expected_placements(kind, world_size)
    for path, want in expected.items():  # None: a plain tensor
        assert placements.get(path) == want, (path, placements.get(path), want)
    if optimizer not in ("ftrl", "adafactor"):  # factored / differently shaped slots
        want = set() if expected["dense_a/kernel"] is None else {expected["dense_a/kernel"]}
        assert slot_placements == want, (optimizer, slot_placements)
    return history.history["loss"]


@pytest.mark.parametrize("world_size, kind", [(2, "model_parallel"), (4, "model_parallel_2d"),
                                              (2, "data_parallel"), (4, "data_parallel_devices")])
def test_fit_equals_single_device_training(world_size, kind):
    losses = run_on_ranks(keras_fit, world_size, kind, "adam", world_size=world_size, timeout=600)
    assert all(loss == losses[0] for loss in losses)  # every rank reports the same global History


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_every_optimizer_trains_sharded_weights(optimizer):
    run_on_ranks(keras_fit, 2, "model_parallel", optimizer, world_size=2, timeout=600)


@pytest.mark.parametrize("input_kind", ["dataloader", "pydataset", "generator"])
def test_every_input_kind(input_kind):
    run_on_ranks(keras_fit, 2, "model_parallel", "sgd_nesterov", input_kind, world_size=2, timeout=600)


def keras_fit_compiled(world_size, kind):
    """``keras_fit`` with ``jit_compile=True``; returns what dynamo compiled and with which backend."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    backends = []
    real_compile = torch.compile

    def recording_compile(*args, **kwargs):  # Keras' own call, as the integration passes it on
        backends.append((kwargs.get("backend", "inductor"), kwargs.get("dynamic")))
        return real_compile(*args, **kwargs)

    torch._dynamo.reset()
    counters.clear()
    torch.compile = recording_compile
    try:
        keras_fit(world_size, kind, "adam", "numpy", True)
    finally:
        torch.compile = real_compile
    return backends, counters["stats"]["unique_graphs"], sum(counters["inductor"].values())


# compiled by Keras' own backend (inductor), with static shapes, equal to one process (keras_fit) on both meshes;
# DataParallel on 2 ranks only: 4 ranks run the same code path. On Keras 3.15 and later only: before 3.15
# TorchDynamo breaks the graph at every Keras op (repros/keras_ops_fullgraph.py), and compiling hundreds of small
# graphs for the train, test and predict steps (with and without the distribution) costs minutes on 2 cores; the
# integration's compile code is the same on 3.12-3.15 (the forked train step). Where CI runs each case: the skip
# reason. Per-block compiles run on every Keras (test_keras_layer_compile.py).
_COMPILES_OP_BY_OP = pytest.mark.skipif(not OPS_TRACE_IN_ONE_GRAPH, reason=(
    "Keras before 3.15 compiles op by op (minutes on 2 cores); CI runs these cases on Keras 3.15.1 (ModelParallel on "
    "(1, 2), DataParallel) and 3.16 (DataParallel), ModelParallel on (2, 2) by hand (CONTRIBUTING.md)"))


@pytest.mark.parametrize("world_size, kind", [
    pytest.param(2, "model_parallel", marks=_COMPILES_OP_BY_OP),
    pytest.param(4, "model_parallel_2d", marks=_COMPILES_OP_BY_OP),
    pytest.param(2, "data_parallel", marks=_COMPILES_OP_BY_OP)])
def test_jit_compile(world_size, kind):
    backends, graphs, inductor_events = run_on_ranks(keras_fit_compiled, world_size, kind, world_size=world_size,
                                                     timeout=600)[0]
    assert backends and set(backends) <= {("inductor", False), ("inductor", None)}, backends
    # ours, with static shapes, except DataParallel on Keras 3.16, which compiles as Keras alone does
    ours = not KERAS_OWN_DISTRIBUTION or not kind.startswith("data_parallel")
    assert ("inductor", False if ours else None) in backends, backends
    assert graphs >= 3 and inductor_events > 0, (graphs, inductor_events)  # train, test, predict steps


# --------------------------------------------------------------------------- save / load across world sizes


def save_sharded(world_size, directory):
    import keras

    from keras_dtensor_mixfix import keras_integration

    keras_integration.install()
    try:
        keras.utils.set_random_seed(3)
        keras.distribution.set_distribution(_distribution("model_parallel", world_size))
        model = _model()
        model.compile(optimizer="adam", loss="mse")
        x, y = _data()
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        model.save_weights(os.path.join(directory, "sharded.weights.h5"))
        model.save(os.path.join(directory, "sharded.keras"))
        weights = model.get_weights()
        # load a single-device checkpoint into the sharded model
        single = np.load(os.path.join(directory, "single.npz"))
        model.load_weights(os.path.join(directory, "single.weights.h5"))
        loaded = model.get_weights()
        placements = str(tuple(model.layers[0].kernel.value.placements))
        reloaded = keras.saving.load_model(os.path.join(directory, "sharded.keras"))
        reloaded_placements = str(tuple(reloaded.layers[0].kernel.value.placements))
        reloaded_weights = reloaded.get_weights()
    finally:
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
    for got, want in zip(loaded, [single[f"w{i}"] for i in range(len(single.files))]):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(reloaded_weights, weights):
        np.testing.assert_array_equal(got, want)
    return [w.tolist() for w in weights], placements, reloaded_placements


def test_save_on_two_ranks_loads_on_one_device_and_back(tmp_path):
    import keras

    x, y = _data()
    single_model = _model("single_")
    single_model.compile(optimizer="adam", loss="mse")
    single_model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    single_model.save_weights(str(tmp_path / "single.weights.h5"))
    np.savez(tmp_path / "single.npz", **{f"w{i}": w for i, w in enumerate(single_model.get_weights())})

    results = run_on_ranks(save_sharded, 2, str(tmp_path), world_size=2, timeout=600)
    weights, placements, reloaded_placements = results[0]
    assert "Shard(dim=1)" in placements and placements == reloaded_placements
    # the file rank 0 wrote holds GLOBAL values: it loads into a single-device model
    fresh = _model("fresh_")
    fresh.load_weights(str(tmp_path / "sharded.weights.h5"))
    for got, want in zip(fresh.get_weights(), weights):
        np.testing.assert_array_equal(got, np.asarray(want, dtype=got.dtype))
    whole = keras.saving.load_model(str(tmp_path / "sharded.keras"))
    for got, want in zip(whole.get_weights(), weights):
        np.testing.assert_array_equal(got, np.asarray(want, dtype=got.dtype))
    # the files asked for and nothing else (no per-rank or temporary files left behind)
    assert sorted(os.listdir(tmp_path)) == ["sharded.keras", "sharded.weights.h5", "single.npz", "single.weights.h5"]


# --------------------------------------------------------------------------- API and errors


def distribution_api(world_size):
    import keras
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from keras_dtensor_mixfix import keras_integration

    keras_integration.install()
    out = {}
    keras.distribution.initialize()  # the group exists already: agrees on a seed only
    mesh = keras.distribution.DeviceMesh((world_size,), ["batch"])  # no explicit devices
    out["devices"] = list(mesh.devices.flatten())
    layout = keras.distribution.TensorLayout(["batch", None], mesh)
    value = torch.arange(8.0 * 3).reshape(8, 3)
    distributed = keras.distribution.distribute_tensor(value, layout)
    assert isinstance(distributed, DTensor) and distributed.placements == (Shard(0),)
    assert torch.equal(distributed.full_tensor(), value)
    with keras.distribution.DataParallel().scope():
        variable = keras.Variable(np.ones((4, 2), "float32"))
        if KERAS_OWN_DISTRIBUTION:  # Keras 3.16 keeps a variable whose layout shards nothing a plain tensor
            assert not isinstance(variable.value, DTensor)
        else:
            assert isinstance(variable.value, DTensor) and variable.value.placements == (Replicate(),)
        variable.assign(np.full((4, 2), 3.0, "float32"))
        assert isinstance(variable.value, DTensor) is not KERAS_OWN_DISTRIBUTION
        assert float(variable.numpy().sum()) == 24.0
        out["repr"] = repr(variable)
    try:
        keras.distribution.TensorLayout(["nope", None], mesh).backend_layout
        out["bad_axis"] = "no error"
    except ValueError as exc:
        out["bad_axis"] = str(exc)
    keras_integration.uninstall()
    return out


def test_distribution_api(world_size):
    out = run_on_ranks(distribution_api, world_size, world_size=world_size, timeout=600)[0]
    assert out["devices"] == [f"cpu:{r}" for r in range(world_size)]
    if not KERAS_OWN_DISTRIBUTION:  # ours: printing a DTensor variable does not gather (3.16's is plain here)
        assert "values not gathered" in out["repr"]
    assert "nope" in out["bad_axis"] and "batch" in out["bad_axis"]  # names the bad axis and the mesh's axes


def _replaced_targets():
    """Every ``(owner, name)`` the integration replaces on this Keras, from its recorder (installed, then
    uninstalled)."""
    from keras_dtensor_mixfix import keras_integration

    keras_integration.uninstall()
    assert keras_integration.install()
    replaced = keras_integration._replaced_attributes()
    keras_integration.uninstall()
    assert keras_integration._replaced_attributes() == []
    return replaced, {(id(owner), name): (owner, name) for _, owner, name in replaced}


def _changed(targets, before):
    """The targets whose value (their owner's own, or its absence) is no longer the very one of ``before``."""
    from keras_dtensor_mixfix._lifecycle.recorder import current_value

    return sorted(f"{getattr(owner, '__name__', type(owner).__name__)}.{name}" for key, (owner, name) in targets.items()
                  if current_value(owner, name) is not before[key])


def test_install_and_uninstall_restore_every_replaced_attribute_exactly():
    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix._lifecycle.recorder import current_value

    replaced, targets = _replaced_targets()
    before = {key: current_value(owner, name) for key, (owner, name) in targets.items()}  # MISSING where absent
    assert keras_integration.install() and keras_integration.install()  # the second one changes nothing
    again = keras_integration._replaced_attributes()
    first_records = {}
    for record in keras_integration._STATE.recorder.records():  # what each target held before install()'s first change
        first_records.setdefault((id(record.owner), record.name), record.previous)
    assert [key for key in targets if first_records[key] is not before[key]] == []
    assert [(o, id(owner), name) for o, owner, name in again] == [(o, id(owner), name) for o, owner, name in replaced]
    assert len(_changed(targets, before)) == len(targets)  # every recorded attribute was replaced
    declared = {override.name: override.attributes for override in keras_integration.OVERRIDES}
    assert [(o, name) for o, _, name in again if name not in declared[o]] == []  # each one its override declares
    # Keras 3.16's own convert_to_numpy gathers DTensors already: kept
    assert any(name == "convert_to_numpy" for _, _, name in again) is not KERAS_OWN_DISTRIBUTION
    keras_integration.uninstall()
    keras_integration.uninstall()
    assert _changed(targets, before) == []


def test_the_restore_comparison_sees_an_attribute_left_replaced(caplog):
    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix._keras.boundary import keras_modules
    from keras_dtensor_mixfix._lifecycle.recorder import MISSING, current_value

    _, targets = _replaced_targets()
    before = {key: current_value(owner, name) for key, (owner, name) in targets.items()}
    assert keras_integration.install()
    owner, name = keras_modules.trainer_class(), "make_train_function"
    theirs = lambda self, force=False: None  # noqa: E731 - someone else's patch on top of ours
    setattr(owner, name, theirs)
    try:
        keras_integration.uninstall()  # leaves theirs in place, with a warning
        assert "make_train_function was replaced by someone else" in caplog.text
        assert _changed(targets, before) == [f"{owner.__name__}.{name}"]
    finally:
        previous = before[(id(owner), name)]
        if previous is MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, previous)
    assert _changed(targets, before) == []



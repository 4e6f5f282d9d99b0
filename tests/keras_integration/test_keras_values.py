"""Values user code reads from a distributed Keras program, as keras.io's "Writing a training loop from scratch in
PyTorch" logs them (``loss.detach().numpy()``), and the optimizer's step counter (with gradient accumulation), on 2
ranks under ModelParallel against one process; and the layout map checks: a key that matches no variable, a map
that splits nothing, and ``layouts.sharding_report``.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import pytest

from _keras_releases import KERAS_RELEASE, drawing_as_distributed_jobs, for_this_process
from keras_dtensor_mixfix.testing import run_on_ranks

STEPS = 3


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, 6)).astype("float32"), (np.arange(8) % 4).astype("int64")


def torch_loop(mesh_shape):
    """The guide's loop: a Keras model, its loss, torch's backward and a Keras optimizer; each step's loss read
    four ways, the optimizer's counters read as NumPy; on a ``mesh_shape`` ModelParallel mesh, or one process when
    ``mesh_shape`` is None."""
    import keras
    import torch

    from keras_dtensor_mixfix import keras_integration

    distributed = mesh_shape is not None
    if distributed:
        assert keras_integration.install()
        mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"], keras.distribution.list_devices())
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*hidden.kernel"] = (None, "model")
        layout_map[".*logits.kernel"] = ("model", None)
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                             batch_dim_name="batch"))
    try:
        keras.utils.set_random_seed(0)
        with contextlib.nullcontext() if distributed else drawing_as_distributed_jobs():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu", name="hidden"),
                                      keras.layers.Dense(4, name="logits")])
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        optimizer = keras.optimizers.Adam(0.05, gradient_accumulation_steps=2)
        optimizer.build(model.trainable_variables)
        x, y = (torch.tensor(a) for a in _data())  # a DataLoader's plain tensors
        read = []
        for _ in range(STEPS):
            logits = model(x)
            loss = loss_fn(y, logits)
            model.zero_grad()
            loss.backward()
            optimizer.apply([v.value.grad for v in model.trainable_weights], model.trainable_weights)
            read.append((loss.detach().numpy(), float(loss), loss.item(), keras.ops.convert_to_numpy(loss),
                         optimizer.iterations.numpy(), np.asarray(optimizer.iterations)))
        return read, [np.asarray(w) for w in model.get_weights()]
    finally:
        if distributed:
            keras.distribution.set_distribution(None)
            keras_integration.uninstall()


@pytest.mark.parametrize("mesh_shape", [(1, 2), (2, 2)], ids=["1x2", "2x2"])
def test_the_pytorch_loop_guide_reads_its_loss_and_counters_as_in_one_process(mesh_shape):
    expected_reads, expected_weights = run_on_ranks(torch_loop, None, world_size=1, timeout=300)[0]
    world_size = mesh_shape[0] * mesh_shape[1]
    for reads, weights in run_on_ranks(torch_loop, mesh_shape, world_size=world_size, timeout=300):
        for got, want in zip(reads, expected_reads):
            for got_value, want_value in zip(got, want):
                np.testing.assert_allclose(np.asarray(got_value, "float64"), np.asarray(want_value, "float64"),
                                           rtol=1e-5, atol=1e-6)
        for got, want in zip(weights, expected_weights):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def layout_checks(keys):
    """A Sequential model under a ModelParallel map of ``keys`` on this rank: the warnings logged while its step
    function is made, and its sharding report."""
    import keras

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix.layouts import sharding_report

    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Collect()
    logging.getLogger("keras_dtensor_mixfix").addHandler(handler)
    assert keras_integration.install()
    try:
        mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], keras.distribution.list_devices())
        layout_map = keras.distribution.LayoutMap(mesh)
        for key, axes in keys:
            layout_map[key] = axes
        distribution, (x, y), batch_size = for_this_process(
            keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"),
            [np.ones((4, 6), "float32"), np.ones((4, 4), "float32")], 4)
        keras.distribution.set_distribution(distribution)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="d1"),
                                  keras.layers.Dense(4, name="d2")], name="net")
        model.compile(optimizer="adam", loss="mse")
        model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
        model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)  # warned once
        report = sharding_report(model)
        return ([r for r in records if "layout map" in r], str(report), report.sharded_count,
                report.bytes_on_this_rank, report.bytes_in_one_process,
                [(v.path, v.role, v.axes, v.local_shape) for v in report.variables])
    finally:
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
        logging.getLogger("keras_dtensor_mixfix").removeHandler(handler)


def test_a_layout_map_key_that_matches_no_variable_is_named_once_with_the_paths_it_meant():
    # the distribution guide's keys: relative paths, which re.fullmatch does not match on Keras 3.15 and later
    # (before 3.15 Keras matched keys with re.search: they split the model there, and nothing is to warn about)
    for warnings, table, sharded, here, whole, _ in run_on_ranks(
            layout_checks, [("d1/kernel", (None, "model")), ("d2/kernel", ("model", None))], world_size=2, timeout=300):
        if KERAS_RELEASE < (3, 15):
            assert warnings == [] and sharded == 2 + 4, (warnings, table)
            continue
        unmatched = [w for w in warnings if "matches no variable" in w]
        assert len(unmatched) == 2, warnings
        assert "'d1/kernel'" in unmatched[0] and "'.*d1/kernel'" in unmatched[0] and "re.fullmatch" in unmatched[0]
        assert sum("splits no variable" in w for w in warnings) == 1, warnings
        assert sharded == 0 and here == whole, table


def test_the_sharding_report_lists_every_variable_with_its_layout_and_this_ranks_bytes():
    keys = [(".*d1/kernel", (None, "model")), (".*d2/kernel", ("model", None))]
    for warnings, table, sharded, here, whole, rows in run_on_ranks(layout_checks, keys, world_size=2, timeout=300):
        assert warnings == [], warnings
        by_path = {(path, role): (axes, local) for path, role, axes, local in rows}
        assert by_path[("net/d1/kernel", "model")] == (((), ("model",)), (6, 4))
        assert by_path[("net/d2/kernel", "model")] == ((("model",), ()), (4, 4))
        assert by_path[("net/d1/bias", "model")] == (((),), (8,))
        # Adam's two slots per variable, laid out as their variables
        slots = [axes for (path, role), (axes, _) in by_path.items() if role == "optimizer" and "d1_kernel" in path]
        assert slots == [((), ("model",))] * 2, by_path
        assert sharded == 2 + 4  # two kernels and their four slots
        kernels = 6 * 8 + 8 * 4
        assert whole - here == (kernels // 2) * 4 * 3  # float32: each kernel and its two slots, half here
        assert "net/d1/kernel" in table and " here" in table and "rank" in table

"""Keras' callbacks that write files, on several ranks sharing one folder, as in one process.

``BackupAndRestore`` interrupted and resumed, with ``ModelCheckpoint`` (weights and ``.keras``) and ``CSVLogger``
in the same runs; ``OrbaxCheckpoint`` saving and loading (where Keras has it and orbax-checkpoint is installed);
``TensorBoard`` with weight histograms (where TensorFlow is installed): on 2 ranks ((1, 2), ModelParallel) and on a
(2, 2) mesh of 4 ranks, against one process doing the same — the trained weights, the epochs run, the files left on
disk and what they hold. A user's own callback that writes through ``file_utils`` writes once with
``keras_integration.writes_once``.
"""

from __future__ import annotations

import contextlib
import csv
import os

import numpy as np
import pytest

from _keras_releases import drawing_as_distributed_jobs, for_this_process
from keras_dtensor_mixfix.testing import run_on_ranks

EPOCHS, INTERRUPTED_AT = 4, 2


def _model_and_data(distributed=False):
    """The model, and the data this process feeds (``distributed``: as the active distribution wants it)."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu", name="hidden"),
                              keras.layers.Dense(3, name="head")], name="net")
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6)).astype("float32")
    y = (x[:, :3].argmax(axis=1)).astype("int64")
    if distributed:
        _, (x, y), _ = for_this_process(keras.distribution.distribution(), [x, y], 8)
    return model, x, y


@contextlib.contextmanager
def _distributed(mesh_shape, batch_size=8):
    """Installs the integration and sets a ModelParallel distribution splitting both kernels on a ``mesh_shape``
    mesh (None: no distribution, Keras' initializers drawing what a distributed job draws) for the block, which gets
    the batch size this process feeds; both undone after it."""
    import keras

    from keras_dtensor_mixfix import keras_integration

    if mesh_shape is None:
        with drawing_as_distributed_jobs():
            yield batch_size
        return
    assert keras_integration.install()
    try:
        mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"], keras.distribution.list_devices())
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*hidden/kernel"] = (None, "model")
        layout_map[".*head/kernel"] = ("model", None)
        distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
        distribution, _, batch_size = for_this_process(distribution, [np.zeros((16, 1))], batch_size)
        keras.distribution.set_distribution(distribution)
        yield batch_size
    finally:
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()


def interrupted_then_resumed(folder, mesh_shape):
    """Fit with BackupAndRestore, ModelCheckpoint (weights and .keras) and CSVLogger into ``folder``, interrupted
    after epoch ``INTERRUPTED_AT``, then fit again to resume; ``mesh_shape`` None: one process, no distribution.
    Returns the epochs each run reported, the trained weights and what was in ``folder`` after each run."""
    import keras

    with _distributed(mesh_shape) as batch_size:
        class Interrupt(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if epoch + 1 == INTERRUPTED_AT:
                    raise RuntimeError("interrupted")

        def callbacks(*extra):
            return [keras.callbacks.BackupAndRestore(os.path.join(folder, "backup")),
                    keras.callbacks.ModelCheckpoint(os.path.join(folder, "best.weights.h5"), save_weights_only=True),
                    keras.callbacks.ModelCheckpoint(os.path.join(folder, "model.keras")),
                    keras.callbacks.CSVLogger(os.path.join(folder, "log.csv"), append=True), *extra]

        model, x, y = _model_and_data(mesh_shape)
        epochs = []
        record = keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: epochs.append(epoch))
        try:
            model.fit(x, y, batch_size=batch_size, epochs=EPOCHS, verbose=0, shuffle=False,
                      callbacks=callbacks(record, Interrupt()))
        except RuntimeError as error:
            assert "interrupted" in str(error)
        after_interruption = sorted(os.listdir(folder)), sorted(os.listdir(os.path.join(folder, "backup")))
        model, x, y = _model_and_data(mesh_shape)  # a new process would start from its initial weights
        model.fit(x, y, batch_size=batch_size, epochs=EPOCHS, verbose=0, shuffle=False, callbacks=callbacks(record))
        after = sorted(os.listdir(folder))
        if mesh_shape is not None:
            import torch.distributed as dist

            dist.barrier()  # every rank has listed the folder before any extracts the archive beside it to load it
        checkpoint = keras.saving.load_model(os.path.join(folder, "model.keras"))
        return dict(epochs=epochs, weights=[np.asarray(w) for w in model.get_weights()],
                    after_interruption=after_interruption, after=after,
                    checkpoint=[np.asarray(w) for w in checkpoint.get_weights()])


def _csv_rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.parametrize("mesh_shape", [(1, 2), (2, 2)], ids=["1x2", "2x2"])
def test_backup_and_restore_resumes_and_file_callbacks_write_as_in_one_process(mesh_shape, tmp_path):
    alone = tmp_path / "one_process"
    shared = tmp_path / "ranks"
    alone.mkdir()
    shared.mkdir()
    expected = run_on_ranks(interrupted_then_resumed, str(alone), None, world_size=1, timeout=300)[0]
    assert expected["epochs"] == [0, 1, *range(INTERRUPTED_AT, EPOCHS)]  # resumed where it stopped
    for got in run_on_ranks(interrupted_then_resumed, str(shared), mesh_shape, world_size=mesh_shape[0] * mesh_shape[1],
                            timeout=300):
        assert got["epochs"] == expected["epochs"]
        assert got["after_interruption"] == expected["after_interruption"]
        assert got["after"] == expected["after"]  # the backup folder deleted at the end, the rest kept
        for name, want in (("weights", expected["weights"]), ("checkpoint", expected["checkpoint"])):
            for got_weight, want_weight in zip(got[name], want):
                np.testing.assert_allclose(got_weight, want_weight, rtol=1e-5, atol=1e-6, err_msg=name)
    rows, expected_rows = _csv_rows(shared / "log.csv"), _csv_rows(alone / "log.csv")
    assert [row["epoch"] for row in rows] == [row["epoch"] for row in expected_rows]  # each epoch once
    for row, expected_row in zip(rows, expected_rows):
        assert row.keys() == expected_row.keys()
        for key in row:
            if "NA" in (row[key], expected_row[key]):  # Keras' mark for a value the epoch did not log
                assert row[key] == expected_row[key], (key, row, expected_row)
            else:
                np.testing.assert_allclose(float(row[key]), float(expected_row[key]), rtol=1e-5, err_msg=key)


def orbax_saved_and_loaded(folder, mesh_shape):
    """Fit with OrbaxCheckpoint (every epoch and every 3 batches, in the background, the 2 latest kept) into
    ``folder``, then load the latest into a new model under the same distribution; returns the trained and the
    loaded weights, the loaded kernel's layout and the checkpoints on disk."""
    import keras

    with _distributed(mesh_shape) as batch_size:
        model, x, y = _model_and_data(mesh_shape)
        model.fit(x, y, batch_size=batch_size, epochs=EPOCHS, verbose=0, shuffle=False,
                  callbacks=[keras.callbacks.OrbaxCheckpoint(os.path.join(folder, "epochs"), max_to_keep=2),
                             keras.callbacks.OrbaxCheckpoint(os.path.join(folder, "batches"), save_freq=3)])
        saved = {name: sorted(os.listdir(os.path.join(folder, name))) for name in ("epochs", "batches")}
        loaded, _, _ = _model_and_data(mesh_shape)
        loaded.load_weights(os.path.join(folder, "epochs"))
        kernel = loaded.get_layer("hidden").kernel.value
        layout = [p.is_shard(dim=1) for p in kernel.placements] if hasattr(kernel, "placements") else None
        return dict(weights=[np.asarray(w) for w in model.get_weights()], saved=saved, layout=layout,
                    loaded=[np.asarray(w) for w in loaded.get_weights()])


@pytest.mark.parametrize("mesh_shape", [(1, 2), (2, 2)], ids=["1x2", "2x2"])
def test_orbax_checkpoint_saves_once_and_loads_as_in_one_process(mesh_shape, tmp_path):
    pytest.importorskip("orbax.checkpoint", reason="OrbaxCheckpoint needs orbax-checkpoint (CI's keras_hub "
                                                    "environment installs it)")
    import keras

    if not hasattr(keras.callbacks, "OrbaxCheckpoint"):
        pytest.skip(f"Keras {keras.__version__} has no OrbaxCheckpoint (3.15 and later have it)")
    alone, shared = tmp_path / "one_process", tmp_path / "ranks"
    alone.mkdir()
    shared.mkdir()
    expected = run_on_ranks(orbax_saved_and_loaded, str(alone), None, world_size=1, timeout=300)[0]
    for got in run_on_ranks(orbax_saved_and_loaded, str(shared), mesh_shape, world_size=mesh_shape[0] * mesh_shape[1],
                            timeout=300):
        assert got["saved"] == expected["saved"]
        assert got["layout"] == [False, True], got["layout"]  # loaded into its layout: split on "model"
        for name in ("weights", "loaded"):
            for got_weight, want_weight in zip(got[name], expected[name]):
                np.testing.assert_allclose(got_weight, want_weight, rtol=1e-5, atol=1e-6, err_msg=name)


def tensorboard_logged(folder, mesh_shape):
    """Fit with TensorBoard (every batch, weight histograms and images each epoch) into ``folder``; returns, per
    folder under it, each event file's values as ``(step, tag, value)``."""
    import glob

    import keras
    import tensorflow as tf

    with _distributed(mesh_shape) as batch_size:
        model, x, y = _model_and_data(mesh_shape)
        model.fit(x, y, batch_size=batch_size, epochs=2, verbose=0, shuffle=False, validation_data=(x, y),
                  callbacks=[keras.callbacks.TensorBoard(folder, histogram_freq=1, write_images=True, update_freq=1)])
        logged = {}
        for path in sorted(glob.glob(os.path.join(folder, "**", "events*"), recursive=True)):
            events = [(event.step, value.tag, tf.make_ndarray(value.tensor))
                      for event in tf.compat.v1.train.summary_iterator(path) for value in event.summary.value
                      if value.HasField("tensor")]
            logged.setdefault(os.path.relpath(os.path.dirname(path), folder), []).append(events)
        return logged


@pytest.mark.parametrize("mesh_shape", [(1, 2), (2, 2)], ids=["1x2", "2x2"])
def test_tensorboard_writes_one_event_file_per_folder_as_in_one_process(mesh_shape, tmp_path):
    pytest.importorskip("tensorflow", reason="TensorBoard writes through tf.summary: TensorFlow and tensorboard are "
                                             "not in CI's environments (1.3 GB); CONTRIBUTING.md gives the command")
    alone, shared = tmp_path / "one_process", tmp_path / "ranks"
    expected = run_on_ranks(tensorboard_logged, str(alone), None, world_size=1, timeout=300)[0]
    assert sorted(expected) == ["train", "validation"] and all(len(files) == 1 for files in expected.values())
    for got in run_on_ranks(tensorboard_logged, str(shared), mesh_shape, world_size=mesh_shape[0] * mesh_shape[1],
                            timeout=300):
        assert sorted(got) == sorted(expected)
        for folder, files in got.items():
            assert len(files) == 1, (folder, len(files))  # rank 0's event file, no other rank's
            events, want = files[0], expected[folder][0]
            assert [(step, tag) for step, tag, _ in events] == [(step, tag) for step, tag, _ in want]
            for (step, tag, value), (_, _, want_value) in zip(events, want):
                if value.dtype != object:  # text and images are encoded bytes
                    np.testing.assert_allclose(value, want_value, rtol=1e-4, atol=1e-5, err_msg=f"{tag} {step}")


def own_callback_writing(folder, wrapped):
    """A user's callback appending a line per epoch through Keras' file_utils, on 2 ranks (``wrapped``: given
    ``keras_integration.writes_once``); returns the file's lines as every rank reads them after each epoch."""
    import keras
    from keras.src.utils import file_utils

    from keras_dtensor_mixfix import keras_integration

    assert keras_integration.install()
    distribution, _, batch_size = for_this_process(keras.distribution.DataParallel(), [np.zeros((16, 1))], 8)
    keras.distribution.set_distribution(distribution)
    seen = []
    path = os.path.join(folder, "epochs.txt")

    class AppendLine(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            with file_utils.File(path, "a") as handle:
                handle.write(f"epoch {epoch}\n")

    class Read(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            with open(path) as handle:
                seen.append(handle.read().splitlines())

    try:
        model, x, y = _model_and_data(distributed=True)
        writer = keras_integration.writes_once(AppendLine()) if wrapped else AppendLine()
        model.fit(x, y, batch_size=batch_size, epochs=2, verbose=0, callbacks=[writer, Read()])
        return seen
    finally:
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()


def test_a_users_own_callback_writes_once_with_writes_once(tmp_path):
    expected = [["epoch 0"], ["epoch 0", "epoch 1"]]
    for seen in run_on_ranks(own_callback_writing, str(tmp_path), True, world_size=2, timeout=300):
        assert seen == expected  # every rank reads rank 0's lines, each written once

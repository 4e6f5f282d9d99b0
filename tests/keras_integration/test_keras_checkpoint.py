"""Sharded checkpoints (``keras_dtensor_mixfix.checkpoint``) and Keras' own files under a distribution.

Every round trip compares every variable, the optimizer's included, with what was saved: equal, bit for bit. A
checkpoint written on 2 ranks with a (1, 2) mesh loads on 4 ranks with a (2, 2) mesh, that one in a process
without a distribution, and that one back on 2 ranks.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from _keras_releases import drawing_as_distributed_jobs
from keras_dtensor_mixfix.testing import run_on_ranks

from test_keras import _data, _distribution, _model


def _trained(name_prefix=""):
    import keras

    keras.utils.set_random_seed(3)
    model = _model(name_prefix)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model


def _fresh(name_prefix=""):
    """The same model, other initial values, its optimizer not built: a checkpoint must fill all of it."""
    import keras

    keras.utils.set_random_seed(11)
    model = _model(name_prefix)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _state(model):
    """Every variable's global value by checkpoint key (model and optimizer)."""
    from keras_dtensor_mixfix._keras.files.sharded_checkpoint import keyed_variables

    return {key: np.array(variable.numpy()) for key, variable in keyed_variables(model, True).items()}


def _placements(model):
    from torch.distributed.tensor import DTensor

    value = model.layers[0].kernel.value
    return str(tuple(value.placements)) if isinstance(value, DTensor) else "plain"


def dcp_on_ranks(world_size, kind, load_from, save_to, train):
    """Under a distribution: load ``load_from`` into a fresh model (or train one), then save to ``save_to``."""
    import keras

    from keras_dtensor_mixfix import checkpoint, keras_integration

    keras_integration.install()
    try:
        keras.distribution.set_distribution(_distribution(kind, world_size))
        if train:
            model = _trained()
        else:
            model = _fresh()
            model.build((None, 8))
            checkpoint.load(model, load_from)
        state = _state(model)
        placements = _placements(model)
        if save_to:
            checkpoint.save(model, save_to)
    finally:
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
    return state, placements


def _assert_same_state(got, want, what):
    assert list(got) == list(want), what
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=f"{what}: {key}")


def test_checkpoint_round_trip_across_world_sizes_and_mesh_shapes(tmp_path):
    from keras_dtensor_mixfix import checkpoint

    two, four, one = (str(tmp_path / name) for name in ("two-ranks", "four-ranks", "one-process"))
    results = run_on_ranks(dcp_on_ranks, 2, "model_parallel", None, two, True, world_size=2, timeout=600)
    saved, placements = results[0]
    assert all(_state_equal(result[0], saved) for result in results)  # every rank sees the same global values
    assert "Shard(dim=1)" in placements
    assert any(key.startswith("optimizer/") for key in saved) and any("iteration" in key for key in saved)

    results = run_on_ranks(dcp_on_ranks, 4, "model_parallel_2d", two, four, False, world_size=4, timeout=600)
    loaded, placements = results[0]
    assert placements == "(Replicate(), Shard(dim=1))", placements  # the (2, 2) mesh's own layout
    _assert_same_state(loaded, saved, "2 ranks (1, 2) -> 4 ranks (2, 2)")

    model = _fresh()
    model.build((None, 8))
    checkpoint.load(model, four)
    _assert_same_state(_state(model), saved, "4 ranks (2, 2) -> one process")
    checkpoint.save(model, one)

    results = run_on_ranks(dcp_on_ranks, 2, "model_parallel", one, None, False, world_size=2, timeout=600)
    _assert_same_state(results[0][0], saved, "one process -> 2 ranks (1, 2)")
    # each rank wrote its own file; nothing else is left beside the checkpoints
    assert sorted(os.listdir(tmp_path)) == ["four-ranks", "one-process", "two-ranks"]


def _state_equal(got, want):
    return list(got) == list(want) and all(np.array_equal(got[key], want[key]) for key in want)


def test_checkpoint_continues_training_as_one_process(tmp_path):
    """Saved after one epoch on 2 ranks, loaded into a fresh model in one process: the next epoch equals the
    epoch of a process that never stopped (the optimizer's step count and slots came back too)."""
    from keras_dtensor_mixfix import checkpoint

    path = str(tmp_path / "ckpt")
    run_on_ranks(dcp_on_ranks, 2, "model_parallel", None, path, True, world_size=2, timeout=600)
    x, y = _data()
    with drawing_as_distributed_jobs():  # the initial weights the 2 ranks started from
        reference = _trained("reference_")
    reference.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    resumed = _fresh()
    resumed.build((None, 8))
    checkpoint.load(resumed, path)
    resumed.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_checkpoint_refuses_another_model_naming_what_differs(tmp_path):
    import keras

    from keras_dtensor_mixfix import InvalidArgumentError, checkpoint

    model = _trained()
    path = str(tmp_path / "ckpt")
    written = checkpoint.save(model, path)
    assert "model/dense_a/kernel" in written

    other = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="dense_a"),
                              keras.layers.Dense(3, name="dense_z")], name="net")
    with pytest.raises(InvalidArgumentError, match=r"not in the checkpoint.*dense_z.*strict=False"):
        checkpoint.load(other, path)
    read = checkpoint.load(other, path, strict=False)  # the advice, followed: what the checkpoint has is read
    assert "model/dense_a/kernel" in read and not any("dense_z" in key for key in read)
    np.testing.assert_array_equal(other.get_layer("dense_a").kernel.numpy(), model.get_layer("dense_a").kernel.numpy())

    wider = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, name="dense_a")], name="net")
    with pytest.raises(InvalidArgumentError, match=r"dense_a/kernel.*\(8, 32\) in the model but \(8, 16\)"):
        checkpoint.load(wider, path, strict=False)

    unbuilt = keras.Sequential([keras.layers.Dense(4, name="dense_a")], name="net")
    with pytest.raises(InvalidArgumentError, match=r"not built.*model.build"):
        checkpoint.save(unbuilt, str(tmp_path / "unbuilt"))
    assert not os.path.exists(tmp_path / "unbuilt")


def test_checkpoint_without_optimizer_leaves_the_optimizer_alone(tmp_path):
    from keras_dtensor_mixfix import checkpoint

    model = _trained()
    path = str(tmp_path / "weights-only")
    written = checkpoint.save(model, path, include_optimizer=False)
    assert written and not any(key.startswith("optimizer/") for key in written)
    fresh = _fresh()
    fresh.build((None, 8))
    read = checkpoint.load(fresh, path)
    assert read == written and not fresh.optimizer.built  # nothing to read: not built for nothing


# --------------------------------------------------------------------------- Keras' own files


def _loaded(path, name_prefix=""):
    """The state of a fresh model (its optimizer built) after ``load_weights(path)``."""
    fresh = _fresh(name_prefix)
    fresh.build((None, 8))
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(path)
    return _state(fresh)


def keras_files_on_ranks(world_size, kind, directory):
    """Save Keras' three files under a distribution and load them back; what each rank gathered, wrote and read."""
    import keras
    from torch.distributed.tensor import DTensor

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix._keras.files import rank_zero_gather, slice_loading

    import h5py

    keras_integration.install()
    gathers = []
    read_shapes = []
    h5_written = []
    assembled = []
    real_full_tensor, real_read_slice = DTensor.full_tensor, slice_loading.StoredWeight.read_slice
    real_h5_init = h5py.File.__init__

    def recording_h5_init(self, name, mode="r", *args, **kwargs):
        if mode != "r":
            h5_written.append(os.path.basename(str(getattr(name, "name", name))))
        return real_h5_init(self, name, mode, *args, **kwargs)

    def counting_full_tensor(self, *args, **kwargs):
        gathers.append(tuple(self.shape))
        return real_full_tensor(self, *args, **kwargs)

    def recording_read_slice(self, index):
        values = real_read_slice(self, index)
        read_shapes.append((self.shape, values.shape))
        return values

    try:
        keras.distribution.set_distribution(_distribution(kind, world_size))
        model = _trained()
        before = os.listdir(directory)
        DTensor.full_tensor, h5py.File.__init__ = counting_full_tensor, recording_h5_init
        real_assemble = rank_zero_gather._assemble
        rank_zero_gather._assemble = lambda value: assembled.append(tuple(value.shape)) or real_assemble(value)
        try:
            model.save_weights(os.path.join(directory, "m.weights.h5"))
        finally:
            rank_zero_gather._assemble = real_assemble
        try:
            model.save(os.path.join(directory, "m.keras"))
            model.save_weights(os.path.join(directory, "m.weights.json"), max_shard_size=0.000002)
        finally:
            DTensor.full_tensor, h5py.File.__init__ = real_full_tensor, real_h5_init
        written = sorted(set(os.listdir(directory)) - set(before))
        state = _state(model)
        slice_loading.StoredWeight.read_slice = recording_read_slice
        try:
            for name in ("m.weights.h5", "m.keras", "m.weights.json"):
                _assert_same_state(_loaded(os.path.join(directory, name)), state, name)  # the optimizer's too
            reloaded = keras.saving.load_model(os.path.join(directory, "m.keras"))
            _assert_same_state(_state(reloaded), state, "load_model")
            placements = _placements(reloaded)
        finally:
            slice_loading.StoredWeight.read_slice = real_read_slice
    finally:
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
    return state, gathers, written, read_shapes, placements, h5_written, assembled


@pytest.mark.parametrize("world_size, kind", [(2, "model_parallel"), (4, "model_parallel_2d")])
def test_keras_files_gather_on_rank_zero_only_and_load_by_slices(tmp_path, world_size, kind):
    import keras

    results = run_on_ranks(keras_files_on_ranks, world_size, kind, str(tmp_path), world_size=world_size,
                           timeout=600)
    state = results[0][0]
    written = results[0][2]
    assert written == ["m.keras", "m.weights.h5", "m.weights.json"] + [f"m_{i:05d}.weights.h5" for i in
                                                                        range(len(written) - 3)], written
    assert len(written) > 4  # max_shard_size split the weights over several files
    for rank, (_, gathers, _, read_shapes, placements, h5_written, assembled) in enumerate(results):
        # no rank all-gathers a weight to save it; rank 0 alone writes weights (the h5 files it opens for writing);
        # in a .weights.h5 file rank 0 writes each sharded weight (dense_a's kernel and bias, dense_b's kernel),
        # the optimizer's slots too, piece by piece: it never assembles one whole
        assert gathers == [] and not {(8, 16), (16,), (16, 6)} & set(assembled), (rank, gathers, assembled)
        assert (h5_written == [] if rank else len(h5_written) == len(written) - 1), (rank, h5_written)
        assert "Shard(dim=1)" in placements
        # the sharded kernels were read by slices: a (8, 16) kernel split in 2 reads (8, 8) on each rank
        assert ((8, 16), (8, 8)) in read_shapes, (rank, read_shapes)
        assert ((8, 16), (8, 16)) not in read_shapes, (rank, read_shapes)
    # the files hold global values: one process loads them
    for name in ("m.weights.h5", "m.keras", "m.weights.json"):
        _assert_same_state(_loaded(str(tmp_path / name), "single_"), state, name)
    _assert_same_state(_state(keras.saving.load_model(str(tmp_path / "m.keras"))), state, "load_model")


def load_keras_files_on_ranks(world_size, kind, directory):
    """The states Keras' files in ``directory`` load into, under a distribution (``load_weights``, ``load_model``)."""
    import keras

    from keras_dtensor_mixfix import keras_integration

    keras_integration.install()
    try:
        keras.distribution.set_distribution(_distribution(kind, world_size))
        states = {name: _loaded(os.path.join(directory, name)) for name in ("m.weights.h5", "m.keras")}
        reloaded = keras.saving.load_model(os.path.join(directory, "m.keras"))
        states["load_model"], placements = _state(reloaded), _placements(reloaded)
    finally:
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
    return states, placements


def test_keras_files_saved_on_two_ranks_load_on_a_two_by_two_mesh(tmp_path):
    saved = run_on_ranks(keras_files_on_ranks, 2, "model_parallel", str(tmp_path), world_size=2, timeout=600)[0][0]
    for states, placements in run_on_ranks(load_keras_files_on_ranks, 4, "model_parallel_2d", str(tmp_path),
                                           world_size=4, timeout=600):
        assert placements == "(Replicate(), Shard(dim=1))", placements
        for name, state in states.items():
            _assert_same_state(state, saved, f"(1, 2) -> (2, 2): {name}")


def failing_save_on_ranks(directory):
    """Rank 0's write fails in the middle of save_weights: what each rank raises, and whether training goes on."""
    import keras
    import torch.distributed as dist

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix._keras.files import rank_zero_gather

    keras_integration.install()
    real_stream = rank_zero_gather.PendingWhole.stream_into

    def full_disk(self, write):
        raise OSError(28, "No space left on device")

    try:
        keras.distribution.set_distribution(_distribution("model_parallel", 2))
        model = _trained()
        if dist.get_rank() == 0:
            rank_zero_gather.PendingWhole.stream_into = full_disk
        try:
            model.save_weights(os.path.join(directory, "m.weights.h5"))
            raised = None
        except Exception as error:  # noqa: BLE001  # what each rank raises is the result
            raised = (type(error).__name__, str(error))
        finally:
            rank_zero_gather.PendingWhole.stream_into = real_stream
        x, y = _data()
        loss = model.train_on_batch(x[:8], y[:8])  # the ranks are still in step: the collectives match
    finally:
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
    return raised, float(loss)


def test_a_save_that_fails_on_rank_zero_stops_every_rank_with_the_reason(tmp_path):
    (raised_0, loss_0), (raised_1, loss_1) = run_on_ranks(failing_save_on_ranks, str(tmp_path), world_size=2,
                                                          timeout=300)
    assert raised_0 is not None and raised_0[0] == "OSError" and "No space left" in raised_0[1], raised_0
    assert raised_1 is not None and raised_1[0] == "RankZeroStopped", raised_1
    assert "rank 0 raised while saving" in raised_1[1], raised_1
    assert loss_0 == loss_1


def _bfloat16_model(seed):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="dense_a", dtype="bfloat16"),
                             keras.layers.Dense(6, name="dense_b", dtype="bfloat16")], name="net")


def bfloat16_files_on_ranks(directory):
    """bfloat16 weights (stored as opaque 2-byte values in h5) saved and loaded by slices on 2 ranks."""
    import keras

    from keras_dtensor_mixfix import keras_integration

    keras_integration.install()
    try:
        keras.distribution.set_distribution(_distribution("model_parallel", 2))
        model = _bfloat16_model(3)
        model.save_weights(os.path.join(directory, "bf16.weights.h5"))
        fresh = _bfloat16_model(11)
        fresh.load_weights(os.path.join(directory, "bf16.weights.h5"))
        saved = [w.astype("float32") for w in model.get_weights()]
        loaded = [w.astype("float32") for w in fresh.get_weights()]
        placements = _placements(fresh)
    finally:
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
    return saved, loaded, placements


def test_bfloat16_weights_round_trip_by_slices(tmp_path):
    saved, loaded, placements = run_on_ranks(bfloat16_files_on_ranks, str(tmp_path), world_size=2, timeout=300)[0]
    assert "Shard(dim=1)" in placements
    for got, want in zip(loaded, saved):
        np.testing.assert_array_equal(got, want)
    single = _bfloat16_model(5)
    single.load_weights(str(tmp_path / "bf16.weights.h5"))
    for got, want in zip(single.get_weights(), saved):
        assert str(got.dtype) == "bfloat16"
        np.testing.assert_array_equal(got.astype("float32"), want)


# --------------------------------------------------------------------------- a model larger than a rank's memory


def _data_segment_bytes():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def capped_checkpoint_round_trip(directory, budget):
    """Under a cap on this process's data segment (RLIMIT_DATA: ``budget`` bytes more than it uses now), build and
    train a model whose whole state does not fit the cap, save and load a checkpoint; then show the whole does not
    fit."""
    import ctypes
    import resource

    import keras
    import torch

    from keras_dtensor_mixfix import checkpoint, keras_integration

    # freed blocks of 1 MB or more go back to the system at once (glibc otherwise keeps them in the heap, which the
    # cap counts): the cap then measures what is held
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    keras_integration.install()
    limits = resource.getrlimit(resource.RLIMIT_DATA)
    try:
        mesh = keras.distribution.DeviceMesh((1, 4), ["batch", "model"], keras.distribution.list_devices())
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*kernel"] = (None, "model")
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map))
        keras.utils.set_random_seed(1)
        resource.setrlimit(resource.RLIMIT_DATA, (_data_segment_bytes() + budget, limits[1]))
        model = keras.Sequential([keras.Input((2048,))] + [keras.layers.Dense(2048, use_bias=False,
                                                                                name=f"d{i}") for i in range(6)])
        model.compile(optimizer="adam", loss="mse")
        x = np.ones((4, 2048), dtype="float32")
        model.train_on_batch(x, x)
        variables = model.variables + model.optimizer.variables
        whole_bytes = sum(int(np.prod(v.shape)) * 4 for v in variables)

        def fingerprints():
            return [float(torch.as_tensor(v.value.to_local() if hasattr(v.value, "to_local") else v.value).detach()
                          .double().square().sum()) for v in variables]

        before = fingerprints()
        checkpoint.save(model, directory)
        with torch.no_grad():
            for v in variables:
                (v.value.to_local() if hasattr(v.value, "to_local") else v.value).zero_()
        checkpoint.load(model, directory)
        after = fingerprints()
        # the whole state, as one process would hold it (allocated here: gathering it would leave the ranks out of
        # step when the cap stops one of them before a collective the others already entered)
        try:
            whole = np.ones(whole_bytes // 4, dtype=np.float32)
            fits = whole.nbytes >= whole_bytes
            del whole
        except MemoryError:
            fits = False
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, limits)
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
    return whole_bytes, before, after, fits


def test_checkpoint_of_a_model_larger_than_a_rank_memory_cap(tmp_path):
    # each of 4 ranks holds 72 MB of state, and its gradients; the whole state (6 kernels of 16 MB, Adam's 2 slots
    # each: 288 MB) does not fit the cap: allocating it fails
    budget = 260 * 2**20
    results = run_on_ranks(capped_checkpoint_round_trip, str(tmp_path / "ckpt"), budget, world_size=4, timeout=600)
    for rank, (whole_bytes, before, after, fits) in enumerate(results):
        assert whole_bytes > budget, whole_bytes
        assert after == before, rank  # every piece came back from the checkpoint
        assert any(before) and not fits, (rank, fits)  # and the cap bites: the whole state cannot be held

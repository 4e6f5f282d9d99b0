"""A rank killed at any point of a save: the next job reads the previous complete state or the new one, never a mix.

Every save path the package performs under a distribution, on 2 ranks ((1, 2), ModelParallel), into a folder that
already holds the previous save (the usual pattern: one folder per run, saved every N steps):

- ``keras_dtensor_mixfix.checkpoint.save`` (torch's DCP): killed before a rank's first file, after rank 0's data file,
  after all the data and before DCP's ``.metadata``, and during the commit (after its record and one rename);
- ``model.save_weights`` and ``model.save`` (rank 0 assembles and writes): rank 1 killed while it sends its pieces,
  rank 0 killed in the middle of the file, and after the file before its commit;
- ``BackupAndRestore`` (its weights and ``training_metadata.json``, with and without ``double_checkpoint``), killed in
  the third epoch's backup: inside the weights, between the weights and the metadata, before the commit, during the
  commit, and rank 1 killed while it sends its pieces.

Each kill is an ``os._exit`` injected at that point (the function there replaced in the rank's process). Then a fresh
job (new processes) loads or resumes: the values must equal, bit for bit, the previous save's or the new one's as an
uninterrupted job made them — the previous one wherever the kill came before the commit's record — and a load in one
process must equal them too. A resumed ``fit`` must end with the uninterrupted run's weights, bit for bit, having run
the epochs after the last complete backup (Keras' resume is per epoch), and equal one process's run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile

import numpy as np
import pytest

from keras_dtensor_mixfix.testing import RankError, run_on_ranks

from test_keras import KERAS_OWN_DISTRIBUTION
from test_keras_callbacks import _distributed, _model_and_data

REPROS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "repros")
ours_initialize = pytest.mark.skipif(
    KERAS_OWN_DISTRIBUTION, reason="Keras 3.16 creates the process group itself (its own initialize): the package's "
                                   "timeout and restart store apply to the group keras.distribution.initialize() "
                                   "makes on Keras 3.12 to 3.15")

KILLED = 86
"""The exit code of a rank killed by a test."""

EPOCHS = 4
KILLED_IN_EPOCH = 2
"""The epoch (0-based) whose end-of-epoch backup is killed."""


def _exit_at(owner, name, rank, call=1, run_first=False, armed=None, counts=None):
    """``owner.name`` ends this process (``os._exit(KILLED)``) at its ``call``-th call on rank ``rank`` (counted
    while ``armed()`` is true, and where ``counts(args)`` is true), after running once more with ``run_first``."""
    import torch.distributed as dist

    original = getattr(owner, name)
    seen = [0]

    def killing(*args, **kwargs):
        if dist.get_rank() == rank and (armed is None or armed()) and (counts is None or counts(args)):
            seen[0] += 1
            if seen[0] == call:
                if run_first:
                    original(*args, **kwargs)
                os._exit(KILLED)
        return original(*args, **kwargs)

    setattr(owner, name, killing)


def _state(model):
    """Every variable's global value, the optimizer's included, by checkpoint key."""
    from keras_dtensor_mixfix._keras.files.sharded_checkpoint import keyed_variables

    return {key: np.array(variable.numpy()) for key, variable in keyed_variables(model, True).items()}


def _assert_state(got, want, what):
    assert list(got) == list(want), what
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=f"{what}: {key}")


# ----------------------------------------------------------------------------- checkpoint.save and Keras' own files

FILES = {"dcp": "ckpt", "weights": "model.weights.h5", "keras": "model.keras"}


def _save(model, kind, folder):
    from keras_dtensor_mixfix import checkpoint

    path = os.path.join(folder, FILES[kind])
    if kind == "dcp":
        checkpoint.save(model, path)
    elif kind == "weights":
        model.save_weights(path)
    else:
        model.save(path)


def _kill(kind, point):
    """Arm the kill of save ``kind`` at ``point``."""
    import h5py
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    from keras_dtensor_mixfix._keras.files import commits, rank_zero_gather

    committing = lambda args: commits.STAGING in str(args[0]) or commits.RECORD in str(args[0])  # noqa: E731
    if point == "dcp_before_first_file":
        _exit_at(dcp_filesystem.FileSystemWriter, "write_data", rank=1)
    elif point == "dcp_between_files":
        _exit_at(dcp_filesystem.FileSystemWriter, "write_data", rank=0, run_first=True)
    elif point == "dcp_before_metadata":
        _exit_at(dcp_filesystem.FileSystemWriter, "finish", rank=0)
    elif point in ("dcp_during_commit", "backup_during_commit"):
        _exit_at(commits.os, "replace", rank=0, call=3, counts=committing)  # the record, one file, then killed
    elif point == "sending_pieces":
        _exit_at(rank_zero_gather, "send_piece", rank=1, call=2)
    elif point == "inside_the_file":
        _exit_at(h5py.Group, "create_dataset", rank=0, call=3)
    elif point == "before_the_commit":
        _exit_at(commits, "commit", rank=0)
    else:
        raise AssertionError(point)


@contextlib.contextmanager
def _scratch_beside(folder):
    """Temporary files of this rank (a save's own scratch folders) in a folder beside ``folder`` while the job runs:
    a rank killed with ``os._exit`` skips the cleanup that would remove them, and they stay with the test's files,
    not in the machine's /tmp."""
    scratch = f"{folder.rstrip(os.sep)}-scratch"
    os.makedirs(scratch, exist_ok=True)
    previous, tempfile.tempdir = tempfile.tempdir, scratch
    try:
        yield
    finally:
        tempfile.tempdir = previous


def saved_then_saved_again(folder, kind, point):
    """Train an epoch and save (the previous save), train another and save again into the same place, killed at
    ``point`` (None: not killed). Returns both states (only an uninterrupted job returns)."""
    import keras

    with _scratch_beside(folder), _distributed((1, 2)) as batch_size:
        model, x, y = _model_and_data(True)
        model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, shuffle=False)
        _save(model, kind, folder)
        previous = _state(model)
        model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, shuffle=False)
        if point is not None:
            _kill(kind, point)
        _save(model, kind, folder)
        del keras
        return previous, _state(model)


def loaded(folder, kind):
    """The state of a fresh model loaded from the save (a fresh job, or one process when no distribution is set)."""
    import keras

    from keras_dtensor_mixfix import checkpoint

    path = os.path.join(folder, FILES[kind])
    model, _, _ = _model_and_data()
    if kind == "dcp":
        checkpoint.load(model, path)
    elif kind == "weights":
        model.optimizer.build(model.trainable_variables)
        model.load_weights(path)
    else:
        model = keras.saving.load_model(path)
    return _state(model)


def loaded_on_ranks(folder, kind):
    with _distributed((1, 2)):
        return loaded(folder, kind)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The states an uninterrupted job saves, per kind: (previous, new)."""
    folder = str(tmp_path_factory.mktemp("uninterrupted"))
    states = {}
    for kind in FILES:
        states[kind] = run_on_ranks(saved_then_saved_again, folder, kind, None, timeout=300)[0]
    return states


KILLS = [
    ("dcp", "dcp_before_first_file", "previous"),
    ("dcp", "dcp_between_files", "previous"),
    ("dcp", "dcp_before_metadata", "previous"),
    ("dcp", "dcp_during_commit", "new"),
    ("weights", "sending_pieces", "previous"),
    ("weights", "inside_the_file", "previous"),
    ("weights", "before_the_commit", "previous"),
    ("keras", "inside_the_file", "previous"),
]


def _killed(function, *args):
    with pytest.raises(RankError) as raised:
        run_on_ranks(function, *args, timeout=300)
    assert raised.value.exc_type == "WorkerDied" and f"exited with code {KILLED}" in str(raised.value), raised.value


@pytest.mark.parametrize("kind, point, expected", KILLS, ids=[f"{kind}-{point}" for kind, point, _ in KILLS])
def test_a_save_killed_at_any_point_loads_the_previous_save_or_the_new_one(tmp_path, uninterrupted, kind, point,
                                                                           expected):
    folder = str(tmp_path)
    _killed(saved_then_saved_again, folder, kind, point)
    previous, new = uninterrupted[kind]
    want = previous if expected == "previous" else new
    what = f"{kind} killed at {point}"
    for got in run_on_ranks(loaded_on_ranks, folder, kind, timeout=300):  # a fresh job on 2 ranks
        _assert_state(got, want, what)
    _assert_state(loaded(folder, kind), want, what + ", loaded in one process")


def saved_into_a_new_folder(folder):
    from keras_dtensor_mixfix import checkpoint

    with _distributed((1, 2)) as batch_size:
        model, x, y = _model_and_data(True)
        model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, shuffle=False)
        checkpoint.save(model, os.path.join(folder, "step-1"))
        model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0, shuffle=False)
        _kill("dcp", "dcp_before_metadata")
        checkpoint.save(model, os.path.join(folder, "step-2"))


def test_a_checkpoint_killed_in_a_new_folder_is_refused_naming_the_last_complete_one(tmp_path):
    import keras_dtensor_mixfix as mf
    from keras_dtensor_mixfix import checkpoint

    _killed(saved_into_a_new_folder, str(tmp_path))
    model, _, _ = _model_and_data()
    with pytest.raises(mf.IncompleteCheckpointError) as raised:
        checkpoint.load(model, str(tmp_path / "step-2"))
    message = str(raised.value)
    assert "is incomplete: a save into it began and did not finish" in message, message
    assert f"the complete checkpoints beside it, newest first: {tmp_path / 'step-1'}" in message, message
    assert isinstance(raised.value, FileNotFoundError)
    checkpoint.load(model, str(tmp_path / "step-1"))  # the advice, followed, works


# ----------------------------------------------------------------------------- BackupAndRestore


def _backup_kill(point, armed):
    import h5py
    import keras

    from keras_dtensor_mixfix._keras.files import commits, rank_zero_gather

    committing = lambda args: commits.STAGING in str(args[0]) or commits.RECORD in str(args[0])  # noqa: E731
    if point == "backup_inside_the_weights":
        _exit_at(h5py.Group, "create_dataset", rank=0, call=3, armed=armed)
    elif point == "backup_between_weights_and_metadata":
        module = keras.src.callbacks.backup_and_restore
        json = module.json

        class KilledAtDumps:
            loads = staticmethod(json.loads)
            dumps = staticmethod(json.dumps)

        module.json = KilledAtDumps
        _exit_at(KilledAtDumps, "dumps", rank=0, armed=armed)
    elif point == "backup_before_the_commit":
        _exit_at(commits, "commit", rank=0, armed=armed)
    elif point == "backup_during_commit":
        _exit_at(commits.os, "replace", rank=0, call=3, armed=armed, counts=committing)
    elif point == "backup_sending_pieces":
        _exit_at(rank_zero_gather, "send_piece", rank=1, armed=armed)
    else:
        raise AssertionError(point)


def fit_with_backup(folder, point, double, mesh_shape=(1, 2)):
    """Fit ``EPOCHS`` epochs with BackupAndRestore into ``folder``, killed at ``point`` in the backup at the end of
    epoch ``KILLED_IN_EPOCH`` (None: not killed); resumes from a backup there. Returns the epochs run and the
    weights."""
    import keras

    with _scratch_beside(folder), _distributed(mesh_shape) as batch_size:
        model, x, y = _model_and_data(mesh_shape is not None)
        epochs = []
        armed = [False]

        class Arm(keras.callbacks.Callback):  # listed before BackupAndRestore: its on_epoch_end runs first
            def on_epoch_end(self, epoch, logs=None):
                armed[0] = epoch == KILLED_IN_EPOCH

        if point is not None:
            _backup_kill(point, lambda: armed[0])
        record = keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: epochs.append(epoch))
        backup = keras.callbacks.BackupAndRestore(os.path.join(folder, "backup"), double_checkpoint=double,
                                                  delete_checkpoint=False)
        model.fit(x, y, batch_size=batch_size, epochs=EPOCHS, verbose=0, shuffle=False,
                  callbacks=[record, Arm(), backup])
        return epochs, [np.asarray(weight) for weight in model.get_weights()]


BACKUP_KILLS = [
    ("backup_inside_the_weights", False, KILLED_IN_EPOCH),
    ("backup_between_weights_and_metadata", False, KILLED_IN_EPOCH),
    ("backup_before_the_commit", False, KILLED_IN_EPOCH),
    ("backup_during_commit", False, KILLED_IN_EPOCH + 1),
    ("backup_during_commit", True, KILLED_IN_EPOCH + 1),
    ("backup_sending_pieces", False, KILLED_IN_EPOCH),
]


@pytest.fixture(scope="module")
def uninterrupted_fit(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("uninterrupted-fit"))
    epochs, weights = run_on_ranks(fit_with_backup, folder, None, False, timeout=300)[0]
    assert epochs == list(range(EPOCHS))
    one_process = fit_with_backup(str(tmp_path_factory.mktemp("one-process")), None, False, None)[1]
    for got, want in zip(weights, one_process):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    return weights


@pytest.mark.parametrize("point, double, resumed_at", BACKUP_KILLS,
                         ids=[point + ("-double_checkpoint" if double else "") for point, double, _ in BACKUP_KILLS])
def test_a_backup_killed_at_any_point_resumes_from_the_last_complete_one(tmp_path, uninterrupted_fit, point, double,
                                                                          resumed_at):
    folder = str(tmp_path)
    _killed(fit_with_backup, folder, point, double)
    names = sorted(os.listdir(os.path.join(folder, "backup")))
    for epochs, weights in run_on_ranks(fit_with_backup, folder, None, double, timeout=300):  # the job restarted
        assert epochs == list(range(resumed_at, EPOCHS)), (point, epochs, names)
        for got, want in zip(weights, uninterrupted_fit):
            np.testing.assert_array_equal(got, want, err_msg=point)
    left = sorted(os.listdir(os.path.join(folder, "backup")))
    expected = ["latest.weights.h5", "training_metadata.json"]
    if double:
        expected += ["latest.weights.h5.bkp", "training_metadata.json.bkp"]
    assert left == sorted(expected), left  # no staging folder, no record
    shutil.rmtree(folder)


# ----------------------------------------------------------------------------- a rank that stalls

STALL_TIMEOUT_S = 5
"""The collective timeout the stall tests set (``KERAS_DTENSOR_MIXFIX_COLLECTIVE_TIMEOUT``)."""


def stalled_rank(mode):
    """One rank of a 2-rank job started by ``keras.distribution.initialize()`` (torchrun's environment): rank 1 stops
    taking part without exiting (it catches its error and waits, as a program that logs and writes a report does);
    rank 0 reports how long it waited before its collective raised."""
    import time

    import keras
    import torch.distributed as dist

    from keras_dtensor_mixfix import keras_integration

    keras_integration.install()
    keras.distribution.initialize()
    rank = dist.get_rank()
    waited_since = [time.monotonic()]
    try:
        if mode == "barrier":  # the barrier after a callback's writes, a save's end
            from keras_dtensor_mixfix._keras.ranks import agreement

            if rank == 1:
                raise RuntimeError("rank 1 failed")
            waited_since[0] = time.monotonic()
            agreement.barrier()
        else:
            with _distributed((1, 2)) as batch_size:
                model, x, y = _model_and_data(True)

                class Fails(keras.callbacks.Callback):
                    def on_train_batch_begin(self, batch, logs=None):
                        waited_since[0] = time.monotonic()
                        if rank == 1 and batch == 1:
                            raise RuntimeError("rank 1 failed")

                model.fit(x, y, batch_size=batch_size, epochs=20, verbose=0, shuffle=False, callbacks=[Fails()])
    except RuntimeError as error:
        if rank == 1:
            print("rank 1 caught its error and waits", flush=True)
            time.sleep(300)
            return
        print(f"rank 0 waited {time.monotonic() - waited_since[0]:.1f} s: {type(error).__name__}: {error}", flush=True)
        raise SystemExit(3)


def _stalled_job(mode):
    import re
    import subprocess
    import sys

    from keras_dtensor_mixfix._loopback_ports import free_port as _free_port

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               GLOO_SOCKET_IFNAME="lo", KERAS_DTENSOR_MIXFIX_COLLECTIVE_TIMEOUT=str(STALL_TIMEOUT_S),
               PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    program = f"import test_keras_faults as faults; faults.stalled_rank({mode!r})"
    ranks = [subprocess.Popen([sys.executable, "-c", program], env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        output, _ = ranks[0].communicate(timeout=180)
    finally:
        for process in ranks:
            process.kill()
            process.wait()
    assert ranks[0].returncode == 3, output[-3000:]
    waited = float(re.search(r"rank 0 waited ([0-9.]+) s", output).group(1))
    return waited, output


@ours_initialize
@pytest.mark.parametrize("mode", ["fit", "barrier"])
def test_a_rank_that_stalls_ends_the_job_within_the_collective_timeout(mode):
    """Without the timeout the other rank waits torch's gloo default, 30 minutes; the test's own limit is 3."""
    waited, output = _stalled_job(mode)
    assert STALL_TIMEOUT_S - 1 <= waited <= STALL_TIMEOUT_S + 20, output[-3000:]
    if mode == "barrier":  # torch's monitored barrier names the rank that did not arrive
        assert "Rank 1 failed to pass monitoredBarrier" in output, output[-3000:]


# ----------------------------------------------------------------------------- torchrun's restarts


@ours_initialize
def test_a_torchrun_restart_rejoins_through_keras_distribution_initialize():
    """The torch repro's restarted job (rank 1 dies, its new incarnation starts late), with the group made by
    ``keras.distribution.initialize()``: the new workers connect, where torch's ``init_process_group`` alone reads the
    dead worker's address (``tests/patterns/test_torch_repros.py``)."""
    sys.path.insert(0, REPROS)
    try:
        import torch_elastic_restart_stale_gloo_address as repro
    finally:
        sys.path.remove(REPROS)
    call = 'dist.init_process_group("gloo")'
    assert call in repro.PROGRAM
    program = repro.PROGRAM.replace(call, "import keras; from keras_dtensor_mixfix import keras_integration; "
                                          "keras_integration.install(); keras.distribution.initialize()")
    worked, output = repro.restarted(program=program, env={"KERAS_BACKEND": "torch"})
    assert worked, output[-3000:]

"""The commit of staged files (``_keras.files.commits``): a save stopped at any step of its commit leaves its folder
as the previous save left it, or (after a reader finishes it) as the new save made it — never a mix.

Each case writes a previous state, stages a new one, and stops the commit at its k-th file-system step (a rename or
a deletion raising, as a killed process stops there), for every k. A reader that knows nothing of the package and
opens the entry file first finds the old state whole, no entry, or the new state whole; ``finish_interrupted`` then
gives the new state exactly. With no step stopped the commit leaves no record and no staging folder.
"""

from __future__ import annotations

import os
import shutil

import pytest

from keras_dtensor_mixfix._keras.files import commits


class Stop(Exception):
    """Where the process was killed."""


def _write(path, text):
    with open(path, "w") as handle:
        handle.write(text)


def _state(folder):
    """Every file under ``folder`` but the package's own (records, staging), with its content."""
    found = {}
    for root, folders, files in os.walk(folder):
        folders[:] = [name for name in folders if name != commits.STAGING]
        for name in files:
            if name == commits.RECORD:
                continue
            path = os.path.join(root, name)
            with open(path) as handle:
                found[os.path.relpath(path, folder)] = handle.read()
    return found


@pytest.fixture
def stop_at(monkeypatch):
    """``stop_at(k)``: the k-th rename or deletion from now raises :class:`Stop` (None: none does); returns the
    count of steps taken so far as a one-item list."""
    taken = [0]
    limit = [None]
    real_replace, real_remove, real_rmtree = os.replace, os.remove, shutil.rmtree

    def counted(real):
        def step(*args, **kwargs):
            if limit[0] is not None and taken[0] == limit[0]:
                raise Stop()
            taken[0] += 1
            return real(*args, **kwargs)
        return step

    monkeypatch.setattr(commits.os, "replace", counted(real_replace))
    monkeypatch.setattr(commits.os, "remove", counted(real_remove))
    monkeypatch.setattr(commits.shutil, "rmtree", counted(real_rmtree))

    def arm(k):
        taken[0] = 0
        limit[0] = k
        return taken

    return arm


def _backup_unit(folder, epoch, double):
    """A BackupAndRestore-like save: weights and metadata (and the previous pair, copied) as one unit."""
    unit = commits.Unit()
    if double:
        for name in ("weights", "metadata"):
            shutil.copy(os.path.join(folder, name), unit.stage_on_disk(os.path.join(folder, name + ".bkp")))
    _write(unit.stage_on_disk(os.path.join(folder, "weights")), f"weights {epoch}")
    _write(unit.stage_on_disk(os.path.join(folder, "metadata")), f"epoch {epoch}")
    return unit


def _same_epoch(state, weights, metadata):
    """Whether a weights file and its metadata are of one epoch."""
    return state[weights].split()[-1] == state[metadata].split()[-1]


@pytest.mark.parametrize("double", [False, True], ids=["single", "double_checkpoint"])
def test_a_backup_pair_stopped_at_any_commit_step_is_the_old_pair_or_the_new_one(tmp_path, stop_at, double):
    folder = str(tmp_path)
    old = {"weights": "weights 1", "metadata": "epoch 1", "weights.bkp": "weights 0", "metadata.bkp": "epoch 0"}
    new = {"weights": "weights 2", "metadata": "epoch 2", **({"weights.bkp": "weights 1", "metadata.bkp": "epoch 1"}
                                                          if double else {"weights.bkp": "weights 0",
                                                                          "metadata.bkp": "epoch 0"})}
    steps = None
    for k in range(0, 32):
        shutil.rmtree(folder)
        os.mkdir(folder)
        for name, text in old.items():
            _write(os.path.join(folder, name), text)
        unit = _backup_unit(folder, 2, double)
        taken = stop_at(k)
        try:
            commits.commit(unit)
        except Stop:
            recorded = os.path.exists(os.path.join(folder, commits.RECORD))
            seen = _state(folder)
            if not recorded:  # before its commit point the folder is as it was; after the record's removal, new
                assert seen in (old, new), f"stopped at step {k}: {seen}"
            stop_at(None)
            # what the package's readers do first: once the record is in place the save is complete
            assert commits.finish_interrupted(folder) == recorded
            after = _state(folder)
            assert after == (new if recorded else seen), f"stopped at step {k}, then finished"
            assert _same_epoch(after, "weights", "metadata") and _same_epoch(after, "weights.bkp", "metadata.bkp")
            continue
        steps = taken[0]
        break
    assert steps is not None and steps >= 2, steps
    assert _state(folder) == new
    assert sorted(os.listdir(folder)) == sorted(new), "no record and no staging folder left"


def _dcp_like(folder, files, entry_text):
    """A checkpoint in ``folder``'s staging folder: data files and an entry that names them."""
    staging = commits.prepare_staging(folder)
    for name, text in files.items():
        _write(os.path.join(staging, name), text)
    _write(os.path.join(staging, ".metadata"), entry_text)
    unit = commits.Unit()
    unit.stage(os.path.join(folder, ".metadata"))
    unit.entries[folder] = ".metadata"
    return unit


def test_an_entry_file_is_removed_first_and_replaced_last_so_a_plain_reader_never_meets_a_mix(tmp_path, stop_at):
    """DCP's pattern: ``.metadata`` names the data files. A reader that opens it first finds the old checkpoint
    whole, no ``.metadata`` (torch's own clear error), or the new checkpoint whole, at every step; an old data file
    the new checkpoint does not write (it had more ranks) is deleted."""
    folder = str(tmp_path)
    old = {".metadata": "old: __0_0 __1_0 __2_0", "__0_0.distcp": "old 0", "__1_0.distcp": "old 1",
           "__2_0.distcp": "old 2"}
    new = {".metadata": "new: __0_0 __1_0", "__0_0.distcp": "new 0", "__1_0.distcp": "new 1"}
    for k in range(0, 32):
        shutil.rmtree(folder)
        os.mkdir(folder)
        for name, text in old.items():
            _write(os.path.join(folder, name), text)
        unit = _dcp_like(folder, {name: text for name, text in new.items() if name != ".metadata"}, new[".metadata"])
        unit.delete(os.path.join(folder, "__2_0.distcp"))
        stop_at(k)
        try:
            commits.commit(unit)
        except Stop:
            seen = _state(folder)
            if ".metadata" in seen:
                want = old if seen[".metadata"].startswith("old") else new
                named = seen[".metadata"].split(": ")[1].split()
                assert {name: seen[name + ".distcp"] for name in named} == {
                    name: want[name + ".distcp"] for name in named}, f"stopped at step {k}: a mix: {seen}"
            stop_at(None)
            commits.finish_interrupted(folder)
            assert _state(folder) in (old, new), f"stopped at step {k}, then finished"
            continue
        break
    assert _state(folder) == new
    assert sorted(os.listdir(folder)) == sorted(new)


def test_a_save_stopped_before_its_record_leaves_the_folder_and_the_next_save_clears_its_staging(tmp_path):
    folder = str(tmp_path)
    _write(os.path.join(folder, "model.keras"), "old")
    unit = commits.Unit()
    _write(unit.stage_on_disk(os.path.join(folder, "model.keras")), "half writ")  # killed while writing
    assert not commits.finish_interrupted(folder)  # no record: nothing to finish
    assert _state(folder) == {"model.keras": "old"}
    assert commits.unfinished_save(folder)
    unit = commits.Unit()
    _write(unit.stage_on_disk(os.path.join(folder, "model.keras")), "new")
    commits.commit(unit)
    assert _state(folder) == {"model.keras": "new"}
    assert os.listdir(folder) == ["model.keras"]


def test_a_deletion_with_writes_and_a_folder_deleted_whole(tmp_path, stop_at):
    """Keras' restore of the previous backup removes the metadata it lacks; BackupAndRestore's end deletes its
    folder, which is renamed away first, so that a kill during the deletion leaves no half-deleted backup."""
    folder = tmp_path / "backup"
    folder.mkdir()
    _write(folder / "weights", "w")
    _write(folder / "metadata", "m")
    stopped = 0
    for k in range(0, 4):
        unit = commits.Unit()
        unit.delete(str(folder))
        stop_at(k)
        try:
            commits.commit(unit)
        except Stop:
            stopped += 1
            # whole, or gone: never one file of the pair without the other
            assert not folder.exists() or sorted(os.listdir(folder)) == ["metadata", "weights"], k
            continue
        break
    assert stopped >= 2 and not folder.exists()
    stop_at(None)
    commits.remove_leftovers(str(tmp_path))  # what a stopped deletion left, renamed away, goes at the next save
    assert os.listdir(tmp_path) == []


def test_touches_names_the_paths_a_unit_changes(tmp_path):
    unit = commits.Unit()
    unit.stage(str(tmp_path / "backup" / "weights.h5"))
    unit.delete(str(tmp_path / "old"))
    assert unit.touches(str(tmp_path / "backup" / "weights.h5"))
    assert unit.touches(str(tmp_path / "backup"))  # its folder: a listing would see it
    assert unit.touches(str(tmp_path / "old" / "inner"))
    assert not unit.touches(str(tmp_path / "backup" / "metadata.json"))
    assert unit.folders() == [str(tmp_path / "backup"), str(tmp_path)]

"""Saves a reader sees whole or not at all: files staged beside their targets, committed by renames.

A save writes each file it makes into a staging folder inside its target's folder (:data:`STAGING`, on the same file
system, so that a rename moves it), while the targets keep their previous content. Its commit is one
``os.replace`` where the save made one file and deletes nothing. Where it made several, or deletes besides, the
commit first writes a commit record (:data:`RECORD`, itself put in place by one ``os.replace``): the renames and
deletions in order. From the moment the record is in place the save is complete: a reader that finds one
(:func:`finish_interrupted`) carries out what is left of it before reading, and any step done twice gives the same
files. A save stopped before its record leaves its targets as they were, and its staging folder, which the next save
into that folder removes.

Within a record, a move that replaces an *entry* file (what a reader opens first: DCP's ``.metadata``) is preceded by
the removal of the old entry and done last, so that a reader without this module, stopped in the middle of a commit,
finds no entry (a clear "file not found") rather than an entry beside files of another save.

Files are ``fsync``-ed before the renames that publish them, and folders after, so that a machine that loses power
keeps the old state or the new one too. Only this module's own names are touched: a folder with other files keeps
them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from typing import Dict, List, Optional, Sequence, Tuple

log = logging.getLogger("keras_dtensor_mixfix")

STAGING = ".mixfix-staging"
"""The staging folder a save writes into, inside its targets' folder."""
RECORD = ".mixfix-commit.json"
"""The commit record of a save that moves or deletes more than one file, in its targets' folder."""
DELETING = ".mixfix-deleting-"
"""Prefix of a folder renamed away before it is deleted (its deletion is then one rename, seen whole)."""
_RECORD_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of a commit, paths relative to the folder of the record: ``move`` (``source`` in the staging folder
    onto ``target``) or ``delete`` (``target``, a file or a folder)."""

    kind: str
    target: str
    source: str = ""


class Unit:
    """The files one save writes and deletes, kept identically on every rank (each runs the same code); only the
    rank that writes (:func:`commit`) touches the file system.

    ``stage(target)`` is where a write to ``target`` goes instead; ``delete(target)`` defers a deletion to the commit;
    ``touches(path)`` says whether a look at or a read of ``path`` would see this unit's effects (then commit first).
    ``entries`` names, per folder, the file a reader opens first: it is replaced last, after the old one is removed.
    """

    def __init__(self) -> None:
        self._steps: List[Tuple[str, str]] = []  # (kind, absolute target), in the order the save made them
        self.entries: Dict[str, str] = {}  # folder -> the entry file's name there (moved last), where one is named
        self._prepared: List[str] = []  # the staging folders made for this unit (on the rank that writes)

    def stage(self, target: str) -> str:
        target = os.path.abspath(os.fspath(target))
        self._steps = [step for step in self._steps if step[1] != target]
        self._steps.append(("move", target))
        return staged_path(target)

    def stage_on_disk(self, target: str) -> str:
        """:meth:`stage`, with the staging folder made, and emptied of what an earlier save left there, the first
        time this unit stages into it: on the rank that writes."""
        staged = self.stage(target)
        folder = os.path.dirname(os.path.dirname(staged))
        if folder not in self._prepared:
            prepare_staging(folder)
            self._prepared.append(folder)
        return staged

    def delete(self, target: str) -> None:
        target = os.path.abspath(os.fspath(target))
        self._steps = [step for step in self._steps if not _within(step[1], target)]
        self._steps.append(("delete", target))

    @property
    def prepared(self) -> Tuple[str, ...]:
        """The folders whose staging folder this unit made (:meth:`stage_on_disk`)."""
        return tuple(self._prepared)

    @property
    def pending(self) -> bool:
        return bool(self._steps)

    def touches(self, path: str) -> bool:
        path = os.path.abspath(os.fspath(path))
        return any(_within(path, target) or _within(target, path) for _, target in self._steps)

    def folders(self) -> List[str]:
        """The folders whose files this unit changes, each once, in order."""
        found: List[str] = []
        for _, target in self._steps:
            folder = os.path.dirname(target)
            if folder not in found:
                found.append(folder)
        return found

    def steps_in(self, folder: str) -> List[Tuple[str, str]]:
        return [step for step in self._steps if os.path.dirname(step[1]) == folder]

    def clear(self) -> None:
        self._steps.clear()
        self.entries.clear()
        self._prepared.clear()


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def staged_path(target: str) -> str:
    """Where a save writes ``target``'s new content: the same name, in the staging folder beside it."""
    folder, name = os.path.split(os.path.abspath(os.fspath(target)))
    return os.path.join(folder, STAGING, name)


def prepare_staging(folder: str) -> str:
    """The staging folder of ``folder``, empty: what an earlier save left there (stopped before its commit) is
    removed, and a commit a reader has not finished yet is finished first."""
    finish_interrupted(folder)
    remove_leftovers(folder)
    staging = os.path.join(folder, STAGING)
    os.mkdir(staging)  # in a folder that exists: a save into a missing folder fails as it would without this
    return staging


def remove_leftovers(folder: str) -> None:
    """Remove what saves stopped before their commit left in ``folder`` (a staging folder), and folders a stopped
    deletion had renamed away (deleted already, as a reader sees them)."""
    if not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        if name == STAGING or name.startswith(DELETING):
            log.info("keras_dtensor_mixfix: removing %s, left by a save that did not finish",
                     os.path.join(folder, name))
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def commit(unit: Unit) -> None:
    """Carry out ``unit`` on the file system: each folder's files put in place, atomically as seen by a reader (one
    rename, or a commit record); every file the save made in a folder's staging folder moves, a staged file the save
    never made is skipped."""
    for folder in unit.folders():
        steps = _steps_of(folder, unit.steps_in(folder), unit.entries.get(folder))
        if len(steps) == 1:
            _carry_out(folder, steps)
        elif steps:
            _write_record(folder, steps)
            _carry_out(folder, steps)
            _remove_record(folder)
        _remove_staging(folder)
        _sync_folder(folder)
    unit.clear()


def discard(unit: Unit) -> None:
    """Forget ``unit`` without committing it (its save raised): the staging folders it made are removed, the targets
    are as they were."""
    for folder in unit.prepared:
        _remove_staging(folder)
    unit.clear()


def _steps_of(folder: str, steps: Sequence[Tuple[str, str]], entry: Optional[str]) -> List[Step]:
    """The steps of one folder's commit: the old entry removed first, the moves of what the save made (the files
    it named in its order, any others it made beside them first), its deletions, the new entry last."""
    staging = os.path.join(folder, STAGING)
    made = set(os.listdir(staging)) if os.path.isdir(staging) else set()
    named = [os.path.relpath(target, folder) for kind, target in steps if kind == "move"]
    moves = [name for name in sorted(made) if name not in named] + [name for name in named if name in made]
    moves = [name for name in moves if os.path.isfile(os.path.join(staging, name))]
    for name in moves:
        _sync_file(os.path.join(staging, name))
    found = [Step("move", name, os.path.join(STAGING, name)) for name in moves if name != entry]
    found += [Step("delete", os.path.relpath(target, folder)) for kind, target in steps if kind == "delete"]
    if entry is not None and entry in moves:
        if found and os.path.lexists(os.path.join(folder, entry)):
            found.insert(0, Step("delete", entry))  # no reader meets the old entry beside this save's files
        found.append(Step("move", entry, os.path.join(STAGING, entry)))
    return found


def _carry_out(folder: str, steps: Sequence[Step]) -> None:
    """The steps from the first not yet done: a move is done once its source is gone, and every step before a done
    move is done too (a deletion cannot tell: done again, it finds nothing, unless a later move made its target,
    and then it is not done again)."""
    start = 0
    for index, step in enumerate(steps):
        if step.kind == "move" and not os.path.lexists(os.path.join(folder, step.source)):
            start = index + 1
    for step in steps[start:]:
        target = os.path.join(folder, step.target)
        if step.kind == "move":
            source = os.path.join(folder, step.source)
            if os.path.lexists(source):
                os.replace(source, target)
        else:
            _delete(target)
            _sync_folder(folder)


def _delete(target: str) -> None:
    if os.path.isdir(target) and not os.path.islink(target):
        parent, name = os.path.split(target.rstrip(os.sep))
        away = os.path.join(parent, DELETING + name)
        try:
            os.replace(target, away)  # gone whole at once; its files go after
        except OSError:
            away = target  # a mount point or a folder that cannot be renamed: deleted in place, as Keras does
        shutil.rmtree(away, ignore_errors=True)
    elif os.path.lexists(target):
        os.remove(target)


def _record_path(folder: str) -> str:
    return os.path.join(folder, RECORD)


def _write_record(folder: str, steps: Sequence[Step]) -> None:
    record = {"version": _RECORD_VERSION, "steps": [dataclasses.asdict(step) for step in steps]}
    path = _record_path(folder)
    partial = os.path.join(folder, STAGING, RECORD)
    os.makedirs(os.path.dirname(partial), exist_ok=True)
    with open(partial, "w") as handle:
        json.dump(record, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)  # the commit point
    _sync_folder(folder)


def _remove_record(folder: str) -> None:
    os.remove(_record_path(folder))


def _remove_staging(folder: str) -> None:
    staging = os.path.join(folder, STAGING)
    if os.path.isdir(staging):
        shutil.rmtree(staging, ignore_errors=True)


def read_record(folder: str) -> Optional[dict]:
    """The commit record in ``folder``, if a commit there did not finish; None if there is none."""
    path = _record_path(folder)
    try:
        with open(path) as handle:
            return json.load(handle)
    except FileNotFoundError:  # put in place by one rename: there whole, or not at all
        return None


def finish_interrupted(folder: str) -> bool:
    """Finish a commit in ``folder`` that was stopped after its record (a rank killed during it); True if there was
    one. Without a record nothing is done: a save stopped before its record left the folder as it was."""
    if not os.path.isdir(folder):
        return False
    record = read_record(folder)
    if record is None:
        return False
    steps = [Step(**step) for step in record["steps"]]
    log.warning("keras_dtensor_mixfix: finishing the commit of a save in %s that was stopped during its commit "
                "(%d steps)", folder, len(steps))
    _carry_out(folder, steps)
    _remove_record(folder)
    _remove_staging(folder)
    _sync_folder(folder)
    return True


def unfinished_save(folder: str) -> bool:
    """Whether ``folder`` holds what a save that never reached its commit left (its staging folder)."""
    return os.path.isdir(os.path.join(folder, STAGING))


def _sync_file(path: str) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _sync_folder(folder: str) -> None:
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:  # some file systems refuse fsync on a folder; the renames are made all the same
        pass
    finally:
        os.close(descriptor)

"""Every Keras callback of the installed Keras that takes a file or folder is one the integration makes write once
(``FILE_CALLBACKS``) or one it declares writes no file (``WRITES_NO_FILE``, with why): a callback a new Keras adds
fails here until it is one or the other."""

from __future__ import annotations

import inspect

import pytest

keras = pytest.importorskip("keras")

from keras_dtensor_mixfix._keras.files import callback_files  # noqa: E402

PATH_ARGUMENTS = {"filepath", "filename", "log_dir", "backup_dir", "directory", "path", "root_dir", "save_dir"}
"""Names Keras gives an argument that names a file or a folder."""


def _callbacks_taking_paths():
    taking = {}
    for name, cls in vars(keras.callbacks).items():
        if inspect.isclass(cls) and issubclass(cls, keras.callbacks.Callback):
            arguments = set(inspect.signature(cls.__init__).parameters) & PATH_ARGUMENTS
            if arguments:
                taking[name] = sorted(arguments)
    return taking


def test_every_keras_callback_that_takes_a_path_writes_once_or_is_declared_to_write_no_file():
    taking = _callbacks_taking_paths()
    assert {"ModelCheckpoint", "BackupAndRestore", "CSVLogger", "TensorBoard"} <= set(taking), taking
    unhandled = {name: arguments for name, arguments in taking.items()
                 if name not in callback_files.FILE_CALLBACKS and name not in callback_files.WRITES_NO_FILE}
    assert not unhandled, (f"Keras callbacks that take a path the integration neither writes once nor declares to "
                           f"write no file: {unhandled}")


def test_every_declared_callback_is_one_keras_has_or_had():
    # the declarations name Keras' own callbacks (a release may lack one: OrbaxCheckpoint before 3.13)
    known = set(callback_files.FILE_CALLBACKS) | set(callback_files.WRITES_NO_FILE)
    present = {name for name in known if hasattr(keras.callbacks, name)}
    assert {"ModelCheckpoint", "BackupAndRestore", "CSVLogger", "TensorBoard", "RemoteMonitor"} <= present
    assert all(reason.strip() for reason in callback_files.WRITES_NO_FILE.values())

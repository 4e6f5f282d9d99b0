"""Sharded checkpoints of a Keras model, written with torch's own ``torch.distributed.checkpoint`` (DCP).

Under ``keras.distribution.ModelParallel`` on the torch backend each rank writes only the pieces of each variable
it holds, and reads only the pieces it needs: no rank ever holds a whole variable it does not own. A checkpoint
loads into any mesh shape and world size (saved on 2 ranks, loaded on 4, on a (2, 2) mesh, or in one process
without a distribution) and back; plain (unsharded) variables are written once.

The checkpoint is a directory in DCP's format, so torch tools read it too
(``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` makes one ``torch.save`` file of it). Keys are
``model/<variable path>`` and ``optimizer/<variable path>``.

Call both functions on every rank (they are collective), after the model is built. A save is atomic to a reader: a
rank killed at any point of it leaves the previous checkpoint in the directory, or the new one, never a mix (the
files are staged and committed by renames once every rank has written; docs/keras.md, "Faults and restarts").

Example::

    import keras_dtensor_mixfix.checkpoint as checkpoint

    model.fit(...)
    checkpoint.save(model, "ckpt/step-1000")      # every rank writes its own pieces
    ...
    checkpoint.load(model, "ckpt/step-1000")      # any world size, any mesh shape
"""

from __future__ import annotations

import os
from typing import Any, List, Union

from ._keras.files import sharded_checkpoint

__all__ = ["save", "load"]

PathLike = Union[str, "os.PathLike[str]"]


def save(model: Any, path: PathLike, *, include_optimizer: bool = True) -> List[str]:
    """Write ``model``'s variables (and its optimizer's, once built) as a sharded checkpoint in directory ``path``.

    Args:
        model: a built Keras model (torch backend), sharded by a ``keras.distribution`` or not.
        path: the checkpoint directory, seen by every rank (a shared file system); created if missing. A checkpoint
            already there is replaced as a whole once the new one is complete; other files in it are left alone.
        include_optimizer: also write the optimizer's variables (its step count and slots), as Keras'
            ``save_weights`` does.

    Returns:
        The checkpoint keys written, in the model's order.

    Raises:
        InvalidArgumentError: the backend is not torch, or a variable has no value yet (the model is not built).
    """
    return sharded_checkpoint.save(model, os.fspath(path), include_optimizer)


def load(model: Any, path: PathLike, *, include_optimizer: bool = True, strict: bool = True) -> List[str]:
    """Read a checkpoint written by :func:`save` into ``model``'s variables, in place, each rank its own pieces.

    The model may be laid out differently from the one saved (another mesh, another world size, no distribution):
    each variable keeps its own layout and receives the values of its pieces.

    Args:
        model: a built Keras model (torch backend) with the same variables as the one saved.
        path: the checkpoint directory.
        include_optimizer: also read the optimizer's variables when the checkpoint has them (the optimizer is
            built first if it is not yet).
        strict: refuse a model with variables the checkpoint lacks; with ``False`` they keep their values
            (logged as a warning).

    Returns:
        The checkpoint keys read.

    Raises:
        InvalidArgumentError: a variable is missing from the checkpoint (``strict``), or has another shape there.
        IncompleteCheckpointError: ``path`` holds no complete checkpoint (a save into it did not finish, or none was
            made there); the message names the complete checkpoints beside it. A save into a directory that already
            held a checkpoint, stopped before its commit, leaves that checkpoint, which loads (with a warning).
    """
    return sharded_checkpoint.load(model, os.fspath(path), include_optimizer, strict)

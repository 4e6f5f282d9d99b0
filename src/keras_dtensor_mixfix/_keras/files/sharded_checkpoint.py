"""A Keras model's state as a torch.distributed.checkpoint (DCP) state dict, saved and loaded in place.

Each variable is keyed by its Keras path (``model/<path>``, ``optimizer/<path>``) and stands in the state dict as
the tensor it holds: a DTensor under a layout, so that every rank writes and reads only its own pieces and DCP
reshards on load (another mesh shape, another world size, one process), or a plain tensor, which DCP writes once.
Loading copies into those very tensors, so the optimizer and the layers keep the objects they hold.

A save is atomic to a reader (:mod:`.commits`): DCP writes into the checkpoint folder's staging folder, and once it
has returned on every rank (its ``.metadata``, written last, is there) rank 0 moves the files into the folder, the old
``.metadata`` removed first and the new one moved last, after a commit record that a later load finishes if the
commit was stopped. A rank killed at any point leaves the previous checkpoint, the new one, or (in a folder that held
none) no ``.metadata``, which ``load`` reports as :class:`~keras_dtensor_mixfix.IncompleteCheckpointError`, naming the
complete checkpoints beside it. The folder must be one every rank sees (a shared file system), as DCP's own loads
need.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Any, Callable, Dict, Iterator, List

from ..._rules.errors import IncompleteCheckpointError, InvalidArgumentError
from ..boundary import keras_modules, keras_private
from ..ranks import agreement
from . import commits
from .memory import return_freed_memory

log = logging.getLogger("keras_dtensor_mixfix")

MODEL_PREFIX = "model/"
OPTIMIZER_PREFIX = "optimizer/"
METADATA = ".metadata"
"""DCP's metadata file: what a reader opens first, written last."""


def keyed_variables(model: Any, include_optimizer: bool) -> Dict[str, Any]:
    """The model's variables (and its built optimizer's) by checkpoint key, in the model's own order.

    Keys leave out the names Keras numbers per process (the model's, as in ``net_1``, and the optimizer's, as in
    ``adam_2``), so that the same model built in another process, or built twice, has the same keys.
    """
    keyed: Dict[str, Any] = {}
    model_name = getattr(model, "name", "")
    _add_variables(keyed, MODEL_PREFIX, model.variables, lambda path: _without_prefix(path, model_name + "/"))
    optimizer = getattr(model, "optimizer", None)
    if include_optimizer and optimizer is not None and getattr(optimizer, "built", False):
        # "adam_2/net_1_dense_kernel_momentum": a slot is named after its model variable's path
        _add_variables(keyed, OPTIMIZER_PREFIX, optimizer.variables,
                       lambda path: _without_prefix(path.split("/", 1)[-1], model_name + "_"))
    return keyed


def _without_prefix(path: str, prefix: str) -> str:
    return path[len(prefix):] if prefix and path.startswith(prefix) and len(path) > len(prefix) else path


def _add_variables(keyed: Dict[str, Any], prefix: str, variables: List[Any], relative: Callable[[str], str]) -> None:
    taken = {id(variable) for variable in keyed.values()}
    for variable in variables:
        if id(variable) in taken:
            continue
        taken.add(id(variable))
        key = base = prefix + relative(variable.path)
        copies = 1
        while key in keyed:  # two variables under one path (layers given the same name): keyed in order
            copies += 1
            key = f"{base}#{copies}"
        keyed[key] = variable


def _require_built(model: Any) -> None:
    if not getattr(model, "built", True):
        raise InvalidArgumentError(f"keras_dtensor_mixfix.checkpoint: model {getattr(model, 'name', model)!r} is not "
                                   "built, so it has no variables yet; build it first (call it on a batch, or "
                                   "model.build(input_shape)), as Keras' save_weights and load_weights ask")


def _tensor_of(key: str, variable: Any) -> Any:
    tensor = keras_private.variable_storage(variable)
    if tensor is None:
        raise InvalidArgumentError(f"keras_dtensor_mixfix.checkpoint: variable {key!r} holds no value yet; build the "
                                   "model (call it once, or model.build(input_shape)) before saving or loading")
    return tensor.detach()  # the same storage, without the Parameter's autograd identity


def save(model: Any, path: str, include_optimizer: bool) -> List[str]:
    import torch.distributed.checkpoint as dcp

    _require_torch_backend()
    _require_built(model)
    keyed = keyed_variables(model, include_optimizer)
    state = {key: _tensor_of(key, variable) for key, variable in keyed.items()}
    folder = os.path.abspath(path)
    distributed = _distributed()
    writes = not distributed or _rank() == 0
    if writes:
        os.makedirs(folder, exist_ok=True)
        commits.prepare_staging(folder)
    if distributed:
        agreement.barrier()  # the staging folder is empty before any rank writes into it
    with _one_process_said():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(folder, commits.STAGING)),
                 no_dist=not distributed)
    # DCP returns on every rank once its coordinator has written .metadata: every file is in the staging folder
    if writes:
        unit = commits.Unit()
        unit.stage(os.path.join(folder, METADATA))
        unit.entries[folder] = METADATA
        written = set(os.listdir(os.path.join(folder, commits.STAGING)))
        for name in _dcp_files(folder):
            if name not in written:
                unit.delete(os.path.join(folder, name))  # the previous checkpoint's, which this one replaces
        commits.commit(unit)
    if distributed:
        agreement.barrier()  # no rank returns before the checkpoint is in place
    return_freed_memory()
    return list(keyed)


def _dcp_files(folder: str) -> List[str]:
    """The files of a DCP checkpoint in ``folder`` (its metadata and its ranks' data files)."""
    return sorted(name for name in os.listdir(folder)
                  if name == METADATA or (name.startswith("__") and name.endswith(".distcp")))


def load(model: Any, path: str, include_optimizer: bool, strict: bool) -> List[str]:
    import torch
    import torch.distributed.checkpoint as dcp

    _require_torch_backend()
    _require_built(model)
    _require_complete(os.path.abspath(path))
    reader = dcp.FileSystemReader(str(path))
    saved = reader.read_metadata().state_dict_metadata
    keyed = keyed_variables(model, include_optimizer=False)
    optimizer = getattr(model, "optimizer", None)
    if include_optimizer and optimizer is not None and any(key.startswith(OPTIMIZER_PREFIX) for key in saved):
        if not getattr(optimizer, "built", False):
            optimizer.build(model.trainable_variables)  # its slots exist only once built
        keyed = keyed_variables(model, include_optimizer=True)
    missing = [key for key in keyed if key not in saved]
    if missing and strict:
        raise InvalidArgumentError(
            f"keras_dtensor_mixfix.checkpoint.load: {len(missing)} of the model's {len(keyed)} variables are not in "
            f"the checkpoint at {path!s} (first: {', '.join(missing[:5])}); the checkpoint holds "
            f"{len(saved)} entries (first: {', '.join(list(saved)[:5])}). Load the checkpoint into the model it was "
            "saved from (the same layer names), or pass strict=False to load the variables it has")
    state = {}
    for key, variable in keyed.items():
        if key not in saved:
            continue
        saved_shape = tuple(getattr(saved[key], "size", ()))
        if saved_shape != tuple(variable.shape):
            raise InvalidArgumentError(
                f"keras_dtensor_mixfix.checkpoint.load: variable {key!r} has shape {tuple(variable.shape)} in the "
                f"model but {saved_shape} in the checkpoint at {path!s}: the model was built with another "
                "configuration")
        state[key] = _tensor_of(key, variable)
    with torch.no_grad(), _one_process_said():
        dcp.load(state, storage_reader=reader, no_dist=not _distributed())
    return_freed_memory()
    if missing:
        log.warning("keras_dtensor_mixfix.checkpoint.load: %d variables not in the checkpoint kept their values "
                    "(first: %s)", len(missing), ", ".join(missing[:5]))
    return list(state)


def _require_complete(folder: str) -> None:
    """Finish a commit stopped in ``folder`` (rank 0, the others waiting), then refuse a folder without a complete
    checkpoint; note a later save there that did not finish."""
    distributed = _distributed()
    if not distributed or _rank() == 0:
        commits.finish_interrupted(folder)
    if distributed:
        agreement.barrier()
    if not os.path.isfile(os.path.join(folder, METADATA)):
        raise IncompleteCheckpointError(_incomplete_message(folder))
    if commits.unfinished_save(folder):
        log.warning("keras_dtensor_mixfix.checkpoint.load: a later save into %s did not finish (it left %s); "
                    "loading the complete checkpoint saved there before it", folder, commits.STAGING)


def _incomplete_message(folder: str) -> str:
    if not os.path.isdir(folder):
        what = f"there is no checkpoint at {folder}: the folder does not exist"
    elif commits.unfinished_save(folder):
        what = (f"the checkpoint at {folder} is incomplete: a save into it began and did not finish (a rank stopped "
                f"during it; what it wrote is in {os.path.join(folder, commits.STAGING)}, without the {METADATA} "
                "DCP writes last), and the folder held no complete checkpoint before it")
    else:
        what = (f"{folder} holds no complete checkpoint: there is no {METADATA} (a save that was stopped before "
                "writing it, without this package, or a folder no checkpoint was saved into)")
    beside = _complete_checkpoints_beside(folder)
    found = (f"the complete checkpoints beside it, newest first: {', '.join(beside)}" if beside
             else "there is no complete checkpoint beside it")
    return (f"keras_dtensor_mixfix.checkpoint.load: {what}; {found}. Load one of those (or start from the initial "
            "weights), and save again; a checkpoint saved by keras_dtensor_mixfix.checkpoint.save is complete or "
            "absent, never a mix")


def _complete_checkpoints_beside(folder: str, limit: int = 5) -> List[str]:
    parent = os.path.dirname(folder.rstrip(os.sep))
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    found = [os.path.join(parent, name) for name in names
             if os.path.join(parent, name) != folder and os.path.isfile(os.path.join(parent, name, METADATA))]
    found.sort(key=lambda candidate: os.path.getmtime(os.path.join(candidate, METADATA)), reverse=True)
    return found[:limit]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _one_process_said() -> Iterator[None]:
    # DCP warns on every call in a process without a group (even with no_dist=True), "assuming" what we know
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        yield


def _require_torch_backend() -> None:
    backend = keras_modules.backend_name()
    if backend != "torch":
        raise InvalidArgumentError(f"keras_dtensor_mixfix.checkpoint works with Keras' torch backend; this Keras "
                                   f"runs {backend!r} (set KERAS_BACKEND=torch before importing Keras)")

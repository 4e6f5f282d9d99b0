"""Saving under a multi-process distribution: every rank gathers, rank 0 alone writes the file."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from typing import Any, Callable

from . import keras_modules
from .._lifecycle.recorder import PatchRecorder


def install(patches: PatchRecorder) -> None:
    saving_lib = keras_modules.saving_lib()
    for name in ("save_model", "save_weights_only"):
        patches.set(saving_lib, name, _rank_zero_writes(getattr(saving_lib, name)))


def _rank_zero_writes(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def save(model: Any, filepath: Any, *args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        if keras_modules.distribution() is None or not dist.is_initialized() or dist.get_world_size() == 1:
            return original(model, filepath, *args, **kwargs)
        if dist.get_rank() == 0:
            try:
                return original(model, filepath, *args, **kwargs)
            finally:
                dist.barrier()
        # Every rank gathers the same values (collectives); only rank 0's file is kept.
        scratch = tempfile.mkdtemp(prefix="mixfix-save-")
        try:
            return original(model, os.path.join(scratch, os.path.basename(str(filepath))), *args, **kwargs)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            dist.barrier()

    return save

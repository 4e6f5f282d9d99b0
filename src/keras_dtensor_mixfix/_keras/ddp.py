"""Keras 3.16's DistributedDataParallel wrap, kept off models whose weights are DTensors.

Keras 3.16's torch trainer wraps a model in torch's ``DistributedDataParallel`` whenever a process
group exists and no distribution (or ``DataParallel``) is in force. A model built under
``ModelParallel`` keeps DTensor parameters after ``set_distribution(None)``; DDP's constructor
broadcasts every parameter from rank 0, and c10d's broadcast has no DTensor strategy
("Operator c10d.broadcast_.default does not have a sharding strategy registered"), with Keras
alone too. Such a model is left unwrapped: DTensor already keeps its shards consistent and reduces
its gradients, so DDP has nothing to add. Its inputs are then plain tensors, which promotion takes
as the same on every process (one warning per model says so: DDP would have taken each process's
batch as its own).
"""

from __future__ import annotations

import logging
from typing import Any

from . import keras_modules
from .._lifecycle.recorder import PatchRecorder

log = logging.getLogger("keras_dtensor_mixfix")


def install(patches: PatchRecorder) -> bool:
    """Wrap the trainer's ``_initialize_ddp`` where this Keras has one; returns whether it did."""
    trainer_class = keras_modules.trainer_class()
    original = getattr(trainer_class, "_initialize_ddp", None)
    if original is None:
        return False

    def _initialize_ddp(self: Any) -> Any:
        if getattr(self, "ddp_model", None) is None and holds_dtensor_parameters(self):
            if not getattr(self, "_keras_dtensor_mixfix_ddp_warned", False):
                object.__setattr__(self, "_keras_dtensor_mixfix_ddp_warned", True)
                log.warning("keras_dtensor_mixfix: model %r holds sharded (DTensor) weights and no distribution is "
                            "set: it is not wrapped in DistributedDataParallel, and every process must feed it the "
                            "same inputs. To give each process its own batch, set the distribution it was built "
                            "under again (keras.distribution.set_distribution(...)).", getattr(self, "name", self))
            return None
        return original(self)

    patches.set(trainer_class, "_initialize_ddp", _initialize_ddp)
    return True


def holds_dtensor_parameters(model: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(parameter, DTensor) for parameter in model.parameters())

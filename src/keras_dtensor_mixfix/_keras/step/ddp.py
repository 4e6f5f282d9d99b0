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

A model that is wrapped may hold trainable variables DDP does not see: Keras registers a layer's
variables as torch parameters keyed by path, and of two variables with one path (keras_hub's SmolLM3
builds every block's ``o_proj`` outside its block's name scope) only one is in ``model.parameters()``
(``repros/keras_duplicate_path_not_a_torch_parameter.py``). DDP reduces only those, so the others
would train on each process's rows alone and drift apart. Their gradients are averaged over DDP's
process group here, as DDP averages its own, by a hook on each such parameter.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

from ..._lifecycle.recorder import PatchRecorder
from ..boundary import keras_modules, keras_private
from ..boundary.defects import running_release_has
from ..boundary.overrides import Override

log = logging.getLogger("keras_dtensor_mixfix")

_warned: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""Models already warned about (once per model while installed; forgotten at uninstall)."""

_completed: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""Models whose missed parameters carry the averaging hook. Kept across uninstall: the hooks stay on the parameters
(their DDP wrap stays too), and a second set after a new install would average each gradient twice."""


def _sharded_models_left_unwrapped(patches: PatchRecorder) -> None:
    trainer_class = keras_modules.trainer_class()
    original = keras_private.ddp_initializer()

    def _initialize_ddp(self: Any) -> Any:
        if getattr(self, "ddp_model", None) is None and holds_dtensor_parameters(self):
            # under a distribution (ModelParallel) Keras makes no DDP either: nothing to say
            if keras_modules.distribution() is None and self not in _warned:
                _warned.add(self)
                log.warning("keras_dtensor_mixfix: model %r holds sharded (DTensor) weights and no distribution is "
                            "set: it is not wrapped in DistributedDataParallel, and every process must feed it the "
                            "same inputs. To give each process its own batch, set the distribution it was built "
                            "under again (keras.distribution.set_distribution(...)).", getattr(self, "name", self))
            return None
        result = original(self)
        _average_what_ddp_misses(self)
        return result

    patches.set(trainer_class, keras_private.TRAINER_INITIALIZE_DDP, _initialize_ddp)


OVERRIDE = Override(
    name="DistributedDataParallel wrap", attributes=(keras_private.TRAINER_INITIALIZE_DDP,),
    description="trainer: models with sharded weights are not wrapped in DistributedDataParallel",
    apply=_sharded_models_left_unwrapped,
    needed=lambda: (keras_private.ddp_initializer() is not None
                    and running_release_has("keras_duplicate_path_not_a_parameter")),
    undo=_warned.clear)
"""On a Keras that wraps models in ``DistributedDataParallel`` (3.16)."""


def holds_dtensor_parameters(model: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def _average_what_ddp_misses(model: Any) -> None:
    ddp = getattr(model, "ddp_model", None)
    if ddp is None or model in _completed:
        return
    _completed.add(model)
    seen = {id(parameter) for parameter in ddp.module.parameters()}
    missed = [variable for variable in model.trainable_variables
              if getattr(variable.value, "requires_grad", False) and id(variable.value) not in seen]
    for variable in missed:
        variable.value.register_hook(functools.partial(_averaged, ddp.process_group))
    if missed:
        log.info("keras_dtensor_mixfix: %d trainable variables of %r are not torch parameters of the model (%s), so "
                 "DistributedDataParallel does not reduce them; their gradients are averaged over its process group",
                 len(missed), getattr(model, "name", model), ", ".join(sorted({v.path for v in missed})))


def _averaged(group: Any, gradient: Any) -> Any:
    """The gradient averaged over ``group`` (None, leaving it as it is, once the group is gone)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    averaged = gradient.clone()
    dist.all_reduce(averaged, group=group)
    return averaged.div_(dist.get_world_size(group))

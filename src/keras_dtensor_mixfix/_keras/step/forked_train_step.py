"""Keras 3.12 to 3.15's torch train step, forked for ``jit_compile=True`` under a distribution.

Only those releases install it (:data:`TRAIN_STEP`'s ``needed``: a Keras without its own promotion mode); Keras 3.16
compiles its own step once our promotion replaces its mode (:mod:`.compile`'s ``COMPILE_ALLOWED``). The fork is
Keras' step (the same in 3.12 to 3.15) kept comparable with it line for line, with what a traced step of DTensors
needs: predictions detached before ``backward()``, clearing and ``backward()`` run eagerly, and the losses layers keep
detached once the loss holds them. The private names it reads are checked per release by the Keras self-check's
``trainer_steps`` and ``compiled_step_state`` (``tests/unit/keras_integration/boundary/test_boundary_keras.py`` exempts
exactly those here).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from ..._lifecycle.recorder import PatchRecorder
from ..boundary import keras_modules
from ..boundary.overrides import Override


def _train_step_compiled_under_distribution(patches: PatchRecorder) -> None:
    trainer_class = keras_modules.trainer_class()
    original_train_step = trainer_class.train_step

    def train_step(self: Any, data: Any) -> Any:
        if keras_modules.distribution() is None or not self.jit_compile:
            return original_train_step(self, data)
        return _compiled_train_step(self, data)

    patches.set(trainer_class, "train_step", train_step)


TRAIN_STEP = Override(
    name="train step", attributes=("train_step",),
    description="jit_compile: each distinct repeated block compiled once, or the whole step",
    apply=_train_step_compiled_under_distribution, needed=lambda: not keras_modules.native_promotion_mode())
"""Keras 3.12 to 3.15: the train step compiled under a distribution is :func:`_compiled_train_step`."""



def _eagerly(function: Callable[[], Any]) -> Any:
    """``function()`` outside TorchDynamo (a graph break where the step calls it):

    - clearing the gradients and the losses layers kept from the last step (:func:`_start_step`);
    - ``backward``: the compiled backward's Python wrapper rebuilds each DTensor gradient with
      ``DTensor.__tensor_unflatten__``, and while the step's frame is being compiled TorchDynamo would take
      that function for a frame of its own to compile, once per gradient shape and placement (until
      its recompile limit), each time breaking its graph at ``DTensor(...)``.
    """
    import torch

    return torch.compiler.disable(function)()


def _start_step(trainer: Any) -> None:
    """``zero_grad()``, and the losses layers kept from the last step cleared (as the model's call clears them).

    Traced, ``zero_grad`` guards on every gradient being None and the call's clearing on the kept losses,
    which hold in the first step only: step 2 would compile the whole step again, and with a MoE router's
    auxiliary loss every later step too.
    """
    trainer.zero_grad()
    trainer._clear_losses()


def _detach_kept_losses(trainer: Any) -> None:
    """The losses layers keep from ``add_loss`` (keras_hub MoE routers' auxiliary loss), detached once the step's
    loss holds them: kept, each left the compiled forward as an output that needs a gradient, and ``backward()``
    of the step's loss gives it none, which a DTensor output cannot take ("Expected a DTensor tangent but got a
    plain Tensor"). Their values are unchanged; the next call of the model clears them as before."""
    import torch

    for layer in trainer._flatten_layers():
        kept = layer._losses
        if kept:
            kept[:] = [t.detach() if isinstance(t, torch.Tensor) else t for t in kept]


def _compiled_train_step(trainer: Any, data: Any) -> Any:
    """Keras 3.12-3.15's torch train step (the same in each), with predictions detached before ``backward()``.

    Under torch.compile the step is split at ``backward()``; a DTensor prediction returned by the
    forward graph but unused by the loss's backward receives a plain zero tangent, which the
    compiled backward rejects ("Expected a DTensor tangent"). Metrics need no gradient, so the
    predictions they see are detached first. Clearing the gradients and kept losses, and the backward, run
    eagerly (:func:`_eagerly`); the losses layers keep are detached once the step's loss holds them.
    """
    import torch

    tree = keras_modules.tree()
    x, y, sample_weight = keras_modules.data_adapter_utils().unpack_x_y_sample_weight(data)
    _eagerly(functools.partial(_start_step, trainer))
    y_pred = trainer(x, training=True) if trainer._call_has_training_arg else trainer(x)
    loss = trainer._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
    _detach_kept_losses(trainer)
    first_input = next(leaf for leaf in tree.flatten(x) if leaf is not None)
    trainer._loss_tracker.update_state(loss, sample_weight=first_input.shape[0])
    y_pred = tree.map_structure(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, y_pred)
    if trainer.optimizer is not None:
        loss = trainer.optimizer.scale_loss(loss)
    weights = trainer.trainable_weights[:]
    if weights:
        _eagerly(loss.backward)
        gradients = [variable.value.grad for variable in weights]
        with torch.no_grad():
            trainer.optimizer.apply(gradients, weights)
    return trainer.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

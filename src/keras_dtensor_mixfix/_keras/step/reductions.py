"""Where a model-sharded Keras step reduces partial sums: at layer outputs, and once per gradient.

DTensor chooses each op's sharding by itself, op by op, by the cheapest communication for that op
alone. A row-sharded kernel's matmul leaves a ``Partial`` result; the next op then finds it
cheaper to all-gather its (small) kernel than to reduce the activation, so partial sums travel on
through the model, every later kernel is gathered in every step, and the gradients come out
``Partial`` too, to be reduced again by each optimizer kernel that reads them (Adam: three times).
A model-sharded step then sends far more collectives than the handful the single-process math needs
(``benchmarks/keras_model_step.py`` counts them).

Under a Keras distribution (ours on Keras 3.12 to 3.15, Keras' own on 3.16 while the integration is
installed), two rules bring it to what tensor-parallel training does by design (and what XLA's
partitioner finds for JAX):

- a layer's output is never left ``Partial``: it is reduced to ``Replicate`` on those mesh dims,
  and the gradient arriving at a layer's output is reduced the same way in backward (the gradient
  of a value read by column-sharded kernels is a partial sum over their shards);
- a parameter's gradient is laid out like the parameter as soon as it is accumulated, so the
  optimizer meets matching placements and reduces nothing (a hook registered on each parameter the
  backend makes: our ``distribution_lib``'s on 3.12 to 3.15, Keras' own variables' on 3.16).

Both keep every value (a redistribution never changes the global tensor), and act only on
DTensors under a distribution: a program without one runs exactly as before; after ``uninstall()``
the hooks left on parameters made meanwhile do nothing.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any, Callable

from ..._lifecycle.recorder import PatchRecorder
from ..boundary import keras_modules, keras_private
from ..boundary.overrides import Override


def _settling_partial_sums(patches: PatchRecorder) -> None:
    Layer = keras_modules.layer_class()
    tree = keras_modules.tree()  # bound here: the wrapper below runs inside compiled steps
    original_call = Layer.__call__

    @functools.wraps(original_call)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        outputs = original_call(self, *args, **kwargs)
        if keras_modules.distribution() is None:
            return outputs
        return tree.map_structure(settle_partial_sums, outputs)

    patches.set(Layer, "__call__", __call__)


OVERRIDE = Override(
    name="partial sums settled", attributes=("__call__",),
    description="sharded steps: layer outputs and their gradients are never left partial sums",
    apply=_settling_partial_sums)


GRADIENTS_LIKE_PARAMETERS = False
"""Whether the gradient hook acts: set while the integration is installed (parameters made then keep their hook
after ``uninstall()``, which then changes nothing)."""

_MADE_BY_OUR_BACKEND = {"distribution_lib": ("distribute_variable",),
                        "initial_pieces": ("distribute_constant_variable", "distribute_drawn_variable",
                                           "distribute_variable_from_rank_zero")}
"""Our backend's functions that make a variable's parameter, by module of ``_keras/backend``."""


def _hook_our_parameters(patches: PatchRecorder) -> None:
    """Our backend's parameters (Keras 3.12 to 3.15): each one it makes gets the gradient hook."""
    from .. import backend

    patches.set(sys.modules[__name__], "GRADIENTS_LIKE_PARAMETERS", True)
    for module_name, names in _MADE_BY_OUR_BACKEND.items():
        module = importlib.import_module(f"{backend.__name__}.{module_name}")
        for name in names:
            patches.set(module, name, _hooking(getattr(module, name)))


def _hook_native_parameters(patches: PatchRecorder) -> None:
    """Keras' own layout-aware variables (3.16): each DTensor parameter they make gets the gradient hook."""
    variable_class = keras_modules.core().Variable
    patches.set(sys.modules[__name__], "GRADIENTS_LIKE_PARAMETERS", True)
    patches.set(variable_class, keras_private.VARIABLE_INITIALIZE_DISTRIBUTED,
                _hooking(getattr(variable_class, keras_private.VARIABLE_INITIALIZE_DISTRIBUTED)))


def _hooking(make_parameter: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(make_parameter)
    def made(*args: Any, **kwargs: Any) -> Any:
        parameter = make_parameter(*args, **kwargs)
        if parameter is not None:
            lay_out_gradient_like(parameter)
        return parameter

    return made


GRADIENTS_OF_OUR_PARAMETERS = Override(
    name="gradients like parameters",
    attributes=("GRADIENTS_LIKE_PARAMETERS",) + sum(_MADE_BY_OUR_BACKEND.values(), ()),
    description="sharded steps: gradients take their parameters' layouts",
    apply=_hook_our_parameters, needed=lambda: not keras_modules.native_layout_variables())
"""On Keras 3.12 to 3.15, whose variables our backend makes."""

GRADIENTS_OF_NATIVE_PARAMETERS = Override(
    name="gradients like Keras' parameters",
    attributes=("GRADIENTS_LIKE_PARAMETERS", keras_private.VARIABLE_INITIALIZE_DISTRIBUTED),
    description="sharded steps: gradients take their parameters' layouts (Keras' own DTensor parameters)",
    apply=_hook_native_parameters, needed=keras_modules.native_layout_variables)
"""On Keras 3.16, whose variables make their DTensor parameters themselves."""


def lay_out_gradient_like(parameter: Any) -> None:
    """Make ``parameter.grad`` take ``parameter``'s placements as soon as it is accumulated.

    DTensor leaves a gradient with whatever placements backward produced (often ``Partial``); each
    optimizer kernel reading it then reduces it again. Reduced once here, the optimizer's kernels
    meet matching placements; the values are the same.
    """
    import torch
    from torch.distributed.tensor import DTensor

    if not (isinstance(parameter, DTensor) and isinstance(parameter, torch.nn.Parameter) and parameter.requires_grad):
        return
    parameter.register_post_accumulate_grad_hook(_compiled_out_hook())


@functools.lru_cache(maxsize=None)
def _compiled_out_hook() -> Callable[[Any], None]:
    # The hook runs inside autograd's engine: under a compiled Keras step TorchDynamo would try (and fail) to
    # trace the redistribution as a frame of its own, every step.
    import torch

    return torch.compiler.disable(_gradient_like_parameter)


def _gradient_like_parameter(parameter: Any) -> None:
    from torch.distributed.tensor import DTensor

    grad = parameter.grad
    if GRADIENTS_LIKE_PARAMETERS and isinstance(grad, DTensor) and (grad.placements != parameter.placements
                                      or grad.device_mesh != parameter.device_mesh):
        parameter.grad = grad.redistribute(parameter.device_mesh, parameter.placements)


def settle_partial_sums(value: Any) -> Any:
    """``value`` with no ``Partial`` placement in forward, nor in the gradient it receives."""
    import torch
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value
    if not (value.requires_grad and torch.is_grad_enabled()):
        return _reduced(value)
    if torch.compiler.is_compiling():
        return _settled_in_graph(value)
    if getattr(value, _SETTLED, False):  # a nested layer's output, settled already
        return value
    # Eager: DTensor's own differentiable reduction (its backward keeps a whole gradient whole) and a
    # hook that reduces a partial-sum gradient. The output stays an ordinary tensor: layers may
    # modify it in place (a custom Function's pass-through output is a view, which autograd forbids
    # to modify in place, e.g. Qwen MoE's ``shared_expert_output *= ...``).
    settled = _reduced(value)
    settled.register_hook(_reduced_gradient)
    setattr(settled, _SETTLED, True)
    return settled


_SETTLED = "_keras_dtensor_mixfix_settled"
"""Marks a layer output already settled (a nested layer's). Set on the output tensor itself, which lives as long as the
step's autograd graph: uninstall cannot reach it, and after uninstall no wrapper reads it."""


def _reduced_gradient(grad: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return _reduced(grad) if isinstance(grad, DTensor) else grad


def _reduced(value: Any) -> Any:
    """``value`` with its ``Partial`` mesh dims made ``Replicate`` (one all-reduce), else itself."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.placement_types import Partial

    placements = value.placements
    if not any(isinstance(p, Partial) for p in placements):
        return value
    wanted = [Replicate() if isinstance(p, Partial) else p for p in placements]
    return value.redistribute(value.device_mesh, wanted)


def _settled_in_graph(value: Any) -> Any:
    """``value`` reduced, then rewrapped by ``DTensor.from_local`` on its own layout: the form traced into a compiled
    graph. A tensor hook on an intermediate would break the graph; ``from_local``'s backward lays the gradient out like
    its forward placements, which hold no ``Partial`` here, so a partial-sum gradient is reduced. Built from DTensor's
    own traceable functions, with no autograd Function of ours, the graph stays one AOTAutograd's on-disk cache keeps
    (it bypasses graphs that hold a custom autograd Function). In forward the value is the same tensor's local shard,
    a view, as an eager settled output that needed no reduction is the layer's output itself."""
    from torch.distributed.tensor import DTensor

    reduced = _reduced(value)
    return DTensor.from_local(reduced.to_local(), reduced.device_mesh, reduced.placements, run_check=False,
                              shape=reduced.shape, stride=reduced.stride())

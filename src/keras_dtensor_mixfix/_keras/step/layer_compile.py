"""``jit_compile=True`` under a distribution, compiled per distinct repeated layer instead of per step.

An LLM's decoder blocks are N instances of one layer with one configuration. Compiling the whole step
makes TorchDynamo trace Keras' Python through every block and inductor compile each again. Here the step
runs as Keras runs it eagerly, and each group of interchangeable layers (:mod:`.block_groups`) is compiled
once: the class's ``call`` of the group's *template* (the first member called) is compiled as a stateless call
(within a ``keras.StatelessScope`` over the template's variables, as ``Layer.stateless_call`` runs it), and every
member's ``call`` runs that one compiled function with the member's variables as its inputs (Keras' own pattern for
running a layer on other variable values). The compiled code sees the same template object every time, so its guards
(layer names, paths, configuration) hold and nothing recompiles; the member's tensors are the graph's inputs, so
values and gradients are the member's; what the call updates (seed states, statistics) is assigned to the member's
variables and the losses it adds are added to the member, as its own call would. Inside the compiled region
AOTAutograd lowers DTensor to local ops and collectives: the layer enters and leaves DTensor once.

A group whose template changes its own Python state in a call (a counter, a cache) is not compiled. Whatever is
not grouped runs eagerly; a model with no group compiles its whole step as before (:data:`COMPILE_UNIT`,
``"step"``, asks for that everywhere). A compile that fails leaves its group eager, with one warning saying why.
Members' ``call`` and the optimizer's ``apply`` are replaced through a :class:`PatchRecorder` and restored exactly
by :func:`uninstall`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import weakref
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from ..._lifecycle.recorder import PatchRecorder
from ..._lifecycle.thread_switch import ThreadSwitch
from ..._rules import env
from ..._rules.errors import InvalidArgumentError
from ..boundary import keras_modules, keras_private
from .block_groups import repeated_groups

log = logging.getLogger("keras_dtensor_mixfix")

COMPILE_UNIT = env.KERAS_COMPILE_UNIT
"""``layer`` (default): ``jit_compile=True`` under a distribution compiles each distinct repeated block once
and runs the rest of the step eagerly; ``step``: the whole step is compiled (the fallback for a model with no
repeated block)."""
UNITS = ("layer", "step")

_override: List[Optional[str]] = [None]
_LAYERS_COMPILING = ThreadSwitch()
"""On within :func:`compiling_layers`, in the thread that entered it."""
_prepared: "weakref.WeakKeyDictionary[Any, _Prepared]" = weakref.WeakKeyDictionary()
"""Each trainer prepared (held weakly: a model dropped is forgotten), with its groups and what was replaced."""


def set_compile_unit(unit: Optional[str]) -> None:
    """``"layer"`` or ``"step"`` for every model compiled from now on; None goes back to :data:`COMPILE_UNIT`."""
    if unit is not None and unit not in UNITS:
        raise InvalidArgumentError(f"keras_dtensor_mixfix: set_compile_unit({unit!r}): expected one of {UNITS}, or "
                                   f"None for {COMPILE_UNIT}'s (default 'layer')")
    _override[0] = unit


TRACERS = ("dynamo", "aot")


def block_tracer() -> str:
    """How a group's blocks are traced, from :data:`env.KERAS_BLOCK_TRACER`: ``"dynamo"`` (``torch.compile``, the
    default) or ``"aot"`` (:class:`BlockTracer`)."""
    raw = os.environ.get(env.KERAS_BLOCK_TRACER, "").strip().lower()
    if raw in TRACERS:
        return raw
    if raw:
        env.warn_once((env.KERAS_BLOCK_TRACER, raw), "keras_dtensor_mixfix: ignoring %s=%r: expected one of %s; "
                      "tracing with TorchDynamo (the default)", env.KERAS_BLOCK_TRACER, raw, TRACERS)
    return "dynamo"


def compile_unit() -> str:
    """The compile unit in force: :func:`set_compile_unit`'s, else :data:`COMPILE_UNIT`'s, else ``"layer"``."""
    if _override[0] is not None:
        return _override[0]
    raw = os.environ.get(COMPILE_UNIT, "").strip().lower()
    if raw in UNITS:
        return raw
    if raw:
        env.warn_once((COMPILE_UNIT, raw), "keras_dtensor_mixfix: ignoring %s=%r: expected one of %s; compiling per "
                  "layer (the default)", COMPILE_UNIT, raw, UNITS)
    return "layer"


class _Prepared:
    """A trainer's groups, and the recorder of the attributes replaced for them (for :func:`uninstall`): each
    member's ``call`` and the optimizer's ``apply``, instance attributes that hide the class's."""

    def __init__(self, groups: List["_Group"]) -> None:
        self.groups = groups
        self.patches = PatchRecorder()
        self.optimizer: Any = None


TRAINER_REGIONS = ("compute_loss", "compute_metrics")
"""The trainer's methods compiled as regions of their own (:class:`_CompiledMethod`) while its layers compile."""


def _compile_method(prepared: _Prepared, owner: Any, name: str, label: str) -> None:
    prepared.patches.set(owner, name, _CompiledMethod(owner, name, label).call, create=True,
                         label=f"{label} (compiled)")


def prepare(trainer: Any) -> bool:
    """Whether ``trainer``'s steps compile per layer: groups found and their members' ``call`` replaced (once), and
    the optimizer's ``apply`` and the trainer's :data:`TRAINER_REGIONS` compiled as regions of their own
    (:class:`_CompiledMethod`)."""
    if compile_unit() != "layer":
        return False
    prepared = _prepared.get(trainer)
    if prepared is None:
        prepared = _Prepared([_Group(members) for members in repeated_groups(trainer)])
        for group in prepared.groups:
            for member in group.members:
                prepared.patches.set(member, "call", functools.partial(group.call, member), create=True,
                                     label=f"{member.name}.call (compiled once for its group)")
        _prepared[trainer] = prepared
        if prepared.groups:
            log.info("keras_dtensor_mixfix: jit_compile compiles %s", "; ".join(
                f"{type(g.members[0]).__name__} once for {len(g.members)} layers" for g in prepared.groups))
            for name in TRAINER_REGIONS:
                _compile_method(prepared, trainer, name, f"the model {trainer.name}'s {name}")
    optimizer = getattr(trainer, "optimizer", None)
    # compile() may bring a new one
    if prepared.groups and optimizer is not None and optimizer is not prepared.optimizer:
        _compile_method(prepared, optimizer, "apply", f"the optimizer {optimizer.name}'s update")
        prepared.optimizer = optimizer
    return bool(prepared.groups)


@contextlib.contextmanager
def compiling_layers() -> Iterator[None]:
    """Within it, the grouped layers run compiled (outside it, as Keras would: ``generate``, symbolic builds)."""
    with _LAYERS_COMPILING.on():
        yield


def compiling_layers_in(step: Any) -> Any:
    """``step``, run :func:`compiling_layers`."""
    @functools.wraps(step)
    def with_layers_compiled(data: Any) -> Any:
        with compiling_layers():
            return step(data)

    return with_layers_compiled


def uninstall() -> None:
    """Every replaced ``call`` and ``apply`` removed: the layers and optimizers run their class's again."""
    for prepared in list(_prepared.values()):
        prepared.patches.restore()
    _prepared.clear()


# ----------------------------------------------------------------------------- the compiled call


class _Group:
    """Interchangeable layers and the one compiled function they share: the template's call, stateless."""

    def __init__(self, members: Sequence[Any]) -> None:
        import torch

        self.members = list(members)
        self.original = type(members[0]).call
        stateless = functools.partial(_stateless_call, _assigning_scope_class())
        self.compiled = torch.compile(stateless, dynamic=False)
        if block_tracer() == "aot":
            from .block_tracer import BlockTracer  # here: it imports torch's compile machinery

            self.compiled = BlockTracer(stateless, self.compiled, f"{members[0].name} (and {len(members) - 1} more "
                                        "like it)")
        self.template: Any = None
        self.eager_reason: Optional[str] = None
        self.state_checked = False  # whether the template's first compiled call left its Python state as it was

    def call(self, member: Any, *args: Any, **kwargs: Any) -> Any:
        """``member``'s ``call``: through the compiled template within a compiled step, else its class's (while
        Keras builds or infers shapes, outside the steps, and inside a function torch is compiling)."""
        if (_compiling() or self.eager_reason is not None or not bool(_LAYERS_COMPILING)
                or not _real_tensors(args, kwargs)):
            return self.original(member, *args, **kwargs)
        if self.template is None:
            self.template = member
        if not self.state_checked:
            return self._first_call(member, args, kwargs)
        return self._compiled_call(member, args, kwargs)

    def _first_call(self, member: Any, args: tuple, kwargs: dict) -> Any:
        """The first compiled call (the template's); a Python state it changes would be every member's (a counter
        of calls, a cache), so the group then runs eagerly."""
        before = keras_private.python_state(self.template)
        result = self._compiled_call(member, args, kwargs)
        self.state_checked = True
        if self.eager_reason is None:
            changed = keras_private.python_state_changes(before, self.template)
            if changed:
                self._eager(f"its call changes {changed}, so its members cannot share one compiled call")
        return result

    def _compiled_call(self, member: Any, args: tuple, kwargs: dict) -> Any:
        """The template's compiled stateless call on ``member``'s variables; what it updates of them (seed states,
        statistics) and the losses it adds, given back to ``member`` as its own call would have left them."""
        trainable = [keras_private.variable_storage(v) for v in member.trainable_variables]
        non_trainable = [keras_private.variable_storage(v) for v in member.non_trainable_variables]
        try:
            outputs, updated, losses = self.compiled(self.template, trainable, non_trainable, args, kwargs)
        except Exception as error:  # the layer runs eagerly instead, and says so
            if not _is_compile_error(error):
                raise
            self._eager(_compile_failure(error))
            return self.original(member, *args, **kwargs)
        for variable, before, after in zip(member.non_trainable_variables, non_trainable, updated):
            if after is not before:
                variable.assign(after)
        for loss in losses:
            member.add_loss(loss)
        return outputs

    def _eager(self, reason: str) -> None:
        self.eager_reason = reason
        log.warning("keras_dtensor_mixfix: jit_compile runs %s (and %d more like it) eagerly: %s",
                    self.members[0].name, len(self.members) - 1, reason)


def _stateless_call(scope_class: Any, template: Any, trainable: List[Any], non_trainable: List[Any], args: tuple,
                    kwargs: dict) -> Tuple[Any, List[Any], List[Any]]:
    """The template's class's ``call`` in a ``keras.StatelessScope`` mapping its variables to the given values, as
    Keras' ``Layer.stateless_call`` runs it: the outputs, the non-trainable values after the call and the losses
    the call added (``add_loss``; regularization losses are not the call's: the model computes them itself). What the
    compiled function traces: the template is the same object at every call, the values are the graph's inputs.

    ``scope_class`` is :func:`_assigning_scope_class`'s: an assignment within the call holds the value without its
    autograd history, as torch's Keras assigns (a copy under ``no_grad``), so the reads after it, and the values
    given back, are what the eager call would read."""
    mapping = (list(zip(template.trainable_variables, trainable))
               + list(zip(template.non_trainable_variables, non_trainable)))
    with scope_class(state_mapping=mapping, collect_losses=True) as scope:
        outputs = type(template).call(template, *args, **kwargs)
        updated = [scope.get_current_value(v) for v in template.non_trainable_variables]
        losses = list(scope.losses)
    return outputs, updated, losses


@functools.lru_cache(maxsize=None)
def _assigning_scope_class() -> Any:
    """``keras.StatelessScope``, its updates kept as torch's Keras assigns a variable: without autograd history (an
    eager ``assign`` copies under ``no_grad``; a stateless one would let gradients flow through the new value)."""

    class AssigningScope(keras_modules.stateless_scope_class()):  # type: ignore[misc]
        def add_update(self, update: Tuple[Any, Any]) -> None:
            variable, value = update
            super().add_update((variable, value.detach()))

    return AssigningScope


def _compile_failure(error: BaseException) -> str:
    """Why a region runs eagerly: torch's own message, on one line (its first line alone is often only the kind of
    failure)."""
    return f"torch.compile failed: {type(error).__name__}: {' '.join(str(error).split())[:600]}"


def _is_compile_error(error: BaseException) -> bool:
    from ..._torch.api import dynamo_error_classes

    return isinstance(error, dynamo_error_classes())


def _real_tensors(args: tuple, kwargs: dict) -> bool:
    """False while Keras builds or infers shapes (meta or fake tensors, Keras' symbolic tensors)."""
    import torch

    from ..backend.layouts import is_symbolic

    for leaf in keras_modules.tree().flatten((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            if is_symbolic(leaf):
                return False
        elif hasattr(leaf, "shape") and type(leaf).__name__ == "KerasTensor":
            return False
    return True


def _compiling() -> bool:
    import torch

    return torch.compiler.is_compiling()


class _CompiledMethod:
    """A method of one object (an optimizer's ``apply``, a trainer's ``compute_loss`` and ``compute_metrics``)
    compiled as a region of its own while the layers run compiled.

    With the blocks compiled, these are what the step otherwise runs eagerly as one DTensor dispatch per op: the
    update's ``_foreach_*`` ops per variable list, the loss on sharded logits, the metrics' updates. Compiled, each
    runs as one graph on the local pieces. The region is the method whole, as the whole-step compile traces it
    (an overriding ``compute_loss``, learning-rate schedules, loss scaling, gradient accumulation and clipping
    included). Its first call, any call outside a compiled step or on symbolic values (Keras building the compiled
    loss and metrics), and any call before the object is built run as
    Keras runs them: the first builds what Keras makes lazily (the optimizer's variables; AdamW's cache of the
    variables excluded from weight decay, whose creation made the compiled update compile again at step 2; the
    compiled loss and metrics). A compile that fails leaves the method eager, with one warning.
    """

    def __init__(self, owner: Any, name: str, label: str) -> None:
        import torch

        self.owner = weakref.ref(owner)
        self.name = name
        self.original = getattr(type(owner), name)
        self.compiled = torch.compile(self.original, dynamic=False)
        self.label = label
        self.eager_reason: Optional[str] = None
        self.called = False

    def call(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        owner = self.owner()
        if (self.eager_reason is not None or not bool(_LAYERS_COMPILING) or not self.called
                or not getattr(owner, "built", True) or torch.compiler.is_compiling()
                or not _real_tensors(args, kwargs)):
            self.called = self.called or bool(_LAYERS_COMPILING)
            return self.original(owner, *args, **kwargs)
        try:
            return self.compiled(owner, *args, **kwargs)
        except Exception as error:  # the method runs eagerly instead, and says so
            if not _is_compile_error(error):
                raise
            self.eager_reason = _compile_failure(error)
            log.warning("keras_dtensor_mixfix: jit_compile runs %s eagerly: %s", self.label, self.eager_reason)
            return self.original(owner, *args, **kwargs)

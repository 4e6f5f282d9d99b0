"""``jit_compile=True`` under a distribution, compiled per distinct repeated layer instead of per step.

An LLM's decoder blocks are N instances of one layer with one configuration. Compiling the whole step
makes TorchDynamo trace Keras' Python through every block and inductor compile each again. Here the step
runs as Keras runs it eagerly, and each group of interchangeable layers (:func:`repeated_groups`) is compiled
once: every member's ``call`` runs the group's one compiled function of the group's *template* (the first
member called), with the template's variables holding the member's tensors for the duration of the call.
The compiled code sees the same Python object every time, so its guards (layer names, paths, configuration)
hold and nothing recompiles; the member's own tensors are the graph's inputs, so values and gradients are the
member's. Inside the compiled region AOTAutograd lowers DTensor to local ops and collectives: the layer
enters and leaves DTensor once.

Members are interchangeable only where that is proven from the objects themselves: the same layer
classes in the same tree, variables of the same shapes, dtypes and layouts, and every other attribute of
every sublayer equal (numbers, strings, configurations, functions and their closures), except Keras'
bookkeeping of names and graph nodes (:data:`BOOKKEEPING`) and initializers (used only by ``build``);
a tensor held outside the variables must be the very same object. A group whose template changes its
own Python state in a call (a counter, a cache) is not compiled. Whatever is not grouped runs eagerly;
a model with no group compiles its whole step as before (:data:`COMPILE_UNIT`, ``"step"``, asks for that
everywhere). A compile that fails leaves its group eager, with one warning saying why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import threading
import types
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ..._lifecycle.recorder import PatchRecorder
from ..._rules import env
from ..._rules.errors import InvalidArgumentError
from ..boundary import keras_modules, keras_private

log = logging.getLogger("keras_dtensor_mixfix")

COMPILE_UNIT = env.KERAS_COMPILE_UNIT
"""``layer`` (default): ``jit_compile=True`` under a distribution compiles each distinct repeated block once
and runs the rest of the step eagerly; ``step``: the whole step is compiled (the fallback for a model with no
repeated block)."""
UNITS = ("layer", "step")

BOOKKEEPING = frozenset({
    "name", "_name", "_path", "_parent_path",  # where the layer sits: the outer call's name scope gives the member's
    "_tracker", "_inbound_nodes", "_outbound_nodes", "_auto_config",  # Keras' tracking and functional graph
})
"""Attributes that differ between interchangeable layers and that no ``call`` reads for a value."""

CHANGED_BY_A_CALL = frozenset({"_called", "_parent_path", "_losses"})
"""What Keras' ``Layer.__call__`` sets at every call (``_losses``: ``add_loss``, which the model sums over its
layers in the order they are tracked, the template's first: the order the members were called)."""

_override: List[Optional[str]] = [None]
_active = threading.local()
_prepared: "weakref.WeakKeyDictionary[Any, _Prepared]" = weakref.WeakKeyDictionary()
"""Each trainer prepared (held weakly: a model dropped is forgotten), with its groups and what was replaced."""


def set_compile_unit(unit: Optional[str]) -> None:
    """``"layer"`` or ``"step"`` for every model compiled from now on; None goes back to :data:`COMPILE_UNIT`."""
    if unit is not None and unit not in UNITS:
        raise InvalidArgumentError(f"keras_dtensor_mixfix: set_compile_unit({unit!r}): expected one of {UNITS}, or "
                                   f"None for {COMPILE_UNIT}'s (default 'layer')")
    _override[0] = unit


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


def prepare(trainer: Any) -> bool:
    """Whether ``trainer``'s steps compile per layer: groups found and their members' ``call`` replaced (once), and
    the optimizer's ``apply`` compiled as a region of its own (:class:`_CompiledApply`)."""
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
    optimizer = getattr(trainer, "optimizer", None)
    if prepared.groups and optimizer is not None and optimizer is not prepared.optimizer:  # compile() may bring a new one
        prepared.patches.set(optimizer, "apply", _CompiledApply(optimizer).apply, create=True,
                             label=f"{optimizer.name}.apply (compiled)")
        prepared.optimizer = optimizer
    return bool(prepared.groups)


@contextlib.contextmanager
def compiling_layers() -> Iterator[None]:
    """Within it, the grouped layers run compiled (outside it, as Keras would: ``generate``, symbolic builds)."""
    previous = getattr(_active, "on", False)
    _active.on = True
    try:
        yield
    finally:
        _active.on = previous


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


def repeated_groups(model: Any) -> List[List[Any]]:
    """The outermost blocks of ``model`` (layers of layers with variables) that come in interchangeable groups of
    two or more, each group in the order the layers are tracked; a layer in no group is searched for groups
    inside it."""
    found: List[List[Any]] = []
    _collect(model, found)
    return found


def _collect(layer: Any, found: List[List[Any]]) -> None:
    children = keras_private.sublayers(layer)
    grouped: set = set()
    for index, first in enumerate(children):
        # a block: a layer of layers with variables (a Dense alone costs more to enter compiled than it saves)
        if id(first) in grouped or not first.built or not any(c.variables for c in keras_private.sublayers(first)):
            continue
        members = [first]
        for other in children[index + 1:]:
            if id(other) not in grouped and type(other) is type(first) and other.built:
                reason = difference(first, other)
                if reason is None:
                    members.append(other)
                else:
                    log.debug("keras_dtensor_mixfix: %s and %s are not compiled as one: %s", first.name,
                              other.name, reason)
        if len(members) > 1:
            found.append(members)
            grouped.update(id(m) for m in members)
    for child in children:
        if id(child) not in grouped:
            _collect(child, found)


# ----------------------------------------------------------------------------- interchangeable layers


class _Tree:
    """A layer's sublayers (itself first) and variables, each by position."""

    def __init__(self, layer: Any) -> None:
        self.layers = keras_private.layer_tree(layer)
        self.variables = list(layer.variables)
        self.layer_index = {id(x): i for i, x in enumerate(self.layers)}
        self.variable_index = {id(v): i for i, v in enumerate(self.variables)}


def difference(first: Any, other: Any) -> Optional[str]:
    """None when ``other`` computes what ``first`` computes with ``other``'s variables; else what differs."""
    a, b = _Tree(first), _Tree(other)
    if len(a.layers) != len(b.layers) or len(a.variables) != len(b.variables):
        return "their sublayers or variables differ in number"
    for x, y in zip(a.variables, b.variables):
        if _variable_signature(x) != _variable_signature(y):
            return f"variable {x.path} is {_variable_signature(x)}, {y.path} is {_variable_signature(y)}"
    for x, y in zip(a.layers, b.layers):
        if type(x) is not type(y):
            return f"{x.name} is a {type(x).__name__}, {y.name} a {type(y).__name__}"
        own, theirs = vars(x), vars(y)
        for key in (set(own) | set(theirs)) - BOOKKEEPING:
            if not _same(own.get(key, _MISSING), theirs.get(key, _MISSING), a, b, key, 0):
                return f"{type(x).__name__} {x.name!r}: attribute {key!r} differs"
    for x, y in zip(a.layers[1:], b.layers[1:]):
        if _output_layout(x) != _output_layout(y):
            return f"the layout map lays out {x.name}'s output and {y.name}'s differently"
    return None


_MISSING = object()
_PRIMITIVES = (type(None), bool, int, float, complex, str, bytes)


def _variable_signature(variable: Any) -> Tuple[Any, ...]:
    storage = keras_private.variable_storage(variable)
    placements = tuple(getattr(storage, "placements", ()))
    mesh = getattr(storage, "device_mesh", None)
    return (tuple(variable.shape), str(variable.dtype), bool(variable.trainable), placements, id(mesh))


def _same(p: Any, q: Any, a: _Tree, b: _Tree, key: str, depth: int) -> bool:
    """Whether attribute values ``p`` (of ``a``'s tree) and ``q`` (of ``b``'s) play the same part."""
    if p is q:
        return True
    if type(p) is not type(q) or depth > 4:
        return False
    if isinstance(p, _PRIMITIVES):
        return bool(p == q)
    if id(p) in a.layer_index or id(q) in b.layer_index:
        return a.layer_index.get(id(p)) == b.layer_index.get(id(q)) is not None
    if id(p) in a.variable_index or id(q) in b.variable_index:
        return a.variable_index.get(id(p)) == b.variable_index.get(id(q)) is not None
    if isinstance(p, inspect.Signature):  # Keras keeps each instance's signature of ``call``
        return bool(p == q)
    if isinstance(p, (set, frozenset)):
        return all(isinstance(x, _PRIMITIVES) for x in p) and p == q
    if isinstance(p, (tuple, list)):
        return len(p) == len(q) and all(_same(x, y, a, b, key, depth + 1) for x, y in zip(p, q))
    if isinstance(p, dict):
        if key == "_modules":  # torch's registry of submodules; the variables' ParameterDict is Keras' own copy
            p, q = ({k: v for k, v in d.items() if k != "_torch_params"} for d in (p, q))
        return p.keys() == q.keys() and all(_same(p[k], q[k], a, b, key, depth + 1) for k in p)
    if isinstance(p, types.FunctionType):
        return (p.__code__ is q.__code__ and _same(p.__defaults__, q.__defaults__, a, b, key, depth + 1)
                and _same(_cells(p), _cells(q), a, b, key, depth + 1))
    if isinstance(p, types.MethodType):
        return p.__func__ is q.__func__ and _same(p.__self__, q.__self__, a, b, key, depth + 1)
    if dataclasses.is_dataclass(p) and not isinstance(p, type):  # Keras 3.16's EinsumDense keeps its EinsumAxes
        return all(_same(getattr(p, f.name), getattr(q, f.name), a, b, key, depth + 1) for f in dataclasses.fields(p))
    if isinstance(p, functools.partial):
        return _same((p.func, p.args, p.keywords), (q.func, q.args, q.keywords), a, b, key, depth + 1)
    if isinstance(p, keras_modules.initializer_class()):
        return True  # drawn from in build only; each instance has its own seed
    if isinstance(p, keras_modules.seed_generator_class()):
        return _same(p.state, q.state, a, b, key, depth + 1)  # the state variable, swapped like the others
    get_config = getattr(p, "get_config", None)
    if callable(get_config):
        try:
            return _same(get_config(), q.get_config(), a, b, key, depth + 1)
        except Exception:  # noqa: BLE001 - an object that cannot say its configuration is not known equal
            return False
    return False


def _cells(function: types.FunctionType) -> Tuple[Any, ...]:
    return tuple(cell.cell_contents for cell in function.__closure__ or ())


def _output_layout(layer: Any) -> Any:
    distribution = keras_modules.distribution()
    if distribution is None or not hasattr(distribution, "get_tensor_layout"):
        return None
    layout = distribution.get_tensor_layout(f"{layer.path}/output")
    return None if layout is None else tuple(layout.axes)


# ----------------------------------------------------------------------------- the compiled call


class _Group:
    """Interchangeable layers and the one compiled ``call`` they share."""

    def __init__(self, members: Sequence[Any]) -> None:
        import torch

        self.members = list(members)
        self.original = type(members[0]).call
        self.compiled = torch.compile(self.original, dynamic=False)
        self.template: Any = None
        self.eager_reason: Optional[str] = None
        self.state_checked = False  # whether the template's first compiled call left its Python state as it was

    def call(self, member: Any, *args: Any, **kwargs: Any) -> Any:
        if (self.eager_reason is not None or not getattr(_active, "on", False)
                or not _real_tensors(args, kwargs)):
            return self.original(member, *args, **kwargs)
        if self.template is None:
            self.template = member
        if member is self.template and not self.state_checked:
            return self._first_template_call(args, kwargs)
        if member is self.template:
            return self._compiled_call(member, args, kwargs)
        with _holding(self.template.variables, member.variables):
            return self._compiled_call(self.template, args, kwargs)

    def _first_template_call(self, args: tuple, kwargs: dict) -> Any:
        """The first compiled call, of the template itself; a state it changes would be every member's (a counter of
        calls, a cache), so the group then runs eagerly."""
        before = _python_state(self.template)
        result = self._compiled_call(self.template, args, kwargs)
        self.state_checked = True
        if self.eager_reason is None:
            changed = _changed(before, _python_state(self.template))
            if changed:
                self._eager(f"its call changes {changed}, so its members cannot share one compiled call")
        return result

    def _compiled_call(self, template: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return self.compiled(template, *args, **kwargs)
        except Exception as error:  # noqa: BLE001 - the layer runs eagerly instead, and says so
            if not _is_compile_error(error):
                raise
            self._eager(_compile_failure(error))
            return self.original(template, *args, **kwargs)

    def _eager(self, reason: str) -> None:
        self.eager_reason = reason
        log.warning("keras_dtensor_mixfix: jit_compile runs %s (and %d more like it) eagerly: %s",
                    self.members[0].name, len(self.members) - 1, reason)


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
    return not torch.compiler.is_compiling()


@contextlib.contextmanager
def _holding(template_variables: Sequence[Any], member_variables: Sequence[Any]) -> Iterator[None]:
    """The template's variables holding the member's tensors (in place: assignments reach the member's)."""
    saved = [keras_private.variable_storage(v) for v in template_variables]
    for own, theirs in zip(template_variables, member_variables):
        keras_private.set_variable_storage(own, keras_private.variable_storage(theirs))
    try:
        yield
    finally:
        for own, tensor in zip(template_variables, saved):
            keras_private.set_variable_storage(own, tensor)


def _python_state(layer: Any) -> Dict[Tuple[int, str], Any]:
    """Each sublayer's plain values and container lengths, to notice a call that changes them."""
    state: Dict[Tuple[int, str], Any] = {}
    for index, sublayer in enumerate(keras_private.layer_tree(layer)):
        for key, value in vars(sublayer).items():
            if key in CHANGED_BY_A_CALL:
                continue
            if isinstance(value, _PRIMITIVES):
                state[index, key] = value
            elif isinstance(value, (list, dict, set)):
                state[index, key] = ("length", len(value))
    return state


def _changed(before: Dict[Tuple[int, str], Any], after: Dict[Tuple[int, str], Any]) -> List[str]:
    return sorted({key for _, key in set(before) ^ set(after)}
                  | {key for (index, key), value in before.items() if (index, key) in after
                     and after[index, key] != value})


class _CompiledApply:
    """An optimizer's ``apply`` compiled as a region of its own while the layers run compiled.

    With the blocks compiled, the update is the largest part of the step left eager: one DTensor dispatch per
    ``_foreach_*`` op and variable list, every step. Compiled, it runs as one graph on the local pieces. The region
    is ``apply`` whole, as the whole-step compile traces it (learning-rate schedules, loss scaling, gradient
    accumulation and clipping included). Its first call, and any outside a compiled step, runs as Keras runs it:
    the first builds what Keras makes lazily (the optimizer's variables; AdamW's cache of the variables excluded from
    weight decay, whose creation made the compiled update compile again at step 2). A compile that fails leaves it
    eager, with one warning.
    """

    def __init__(self, optimizer: Any) -> None:
        import torch

        self.optimizer = weakref.ref(optimizer)
        self.original = type(optimizer).apply
        self.compiled = torch.compile(self.original, dynamic=False)
        self.eager_reason: Optional[str] = None
        self.called = False

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        import torch

        optimizer = self.optimizer()
        if (self.eager_reason is not None or not getattr(_active, "on", False) or not self.called
                or not optimizer.built or torch.compiler.is_compiling()):
            self.called = self.called or getattr(_active, "on", False)
            return self.original(optimizer, grads, trainable_variables)
        try:
            return self.compiled(optimizer, grads, trainable_variables)
        except Exception as error:  # noqa: BLE001 - the update runs eagerly instead, and says so
            if not _is_compile_error(error):
                raise
            self.eager_reason = _compile_failure(error)
            log.warning("keras_dtensor_mixfix: jit_compile runs the optimizer %s's update eagerly: %s",
                        optimizer.name, self.eager_reason)
            return self.original(optimizer, grads, trainable_variables)

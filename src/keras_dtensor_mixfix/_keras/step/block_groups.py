"""Which layers of a model are interchangeable blocks: one compiled ``call`` can run them all.

Two layers are interchangeable when Keras' own description of them agrees, part by part:

- the same class, and the same classes of sublayers in the same order;
- the same configuration for the layer and for every sublayer, their ``name`` aside (names differ between
  instances and no call reads them for a value), and initializers aside (``build`` draws from them once; each
  instance may carry its own seed);
- trainable and non-trainable variables of the same shapes, dtypes, trainability and layouts (placements on the same
  mesh), in the same order;
- the same output layouts under the distribution's layout map.

A layer's configuration is its ``get_config()``. Many layers cannot state one: a model's internal sublayers, never
saved on their own, made by their parent from its configuration (keras_hub's normalizations, attentions and expert
layers raise ``NotImplementedError``), and layers whose ``get_config`` fails (keras_hub 0.32's
``LlamaTransformerDecoder`` reads an attribute its ``__init__`` never sets). Such a layer's configuration is what
``get_config`` would hold: its public attributes of plain values (numbers, strings, flags, ``None``, and lists and
tuples of them), the functions it holds by their code, and the configuration of any object it holds that states
one; its sublayers and variables are compared as above.

That is the contract Keras' saving and ``clone_model`` rely on: a layer is what its class, its configuration and its
variables say. State a call reads that none of these carry (a tensor or object set as an attribute after
construction) is outside that contract: such a block is compiled with its template's state;
``KERAS_DTENSOR_MIXFIX_COMPILE_UNIT=step`` compiles the whole step instead.
"""

from __future__ import annotations

import logging
import types
from typing import Any, List, Optional, Tuple

from ..boundary import keras_modules, keras_private

log = logging.getLogger("keras_dtensor_mixfix")

NOT_COMPARED = frozenset({"name"})
"""Configuration keys that differ between interchangeable layers."""


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


def difference(first: Any, other: Any) -> Optional[str]:
    """None when ``other`` is interchangeable with ``first`` (the module's contract); else the first part of their
    descriptions that differs, in words."""
    ours, theirs = keras_private.layer_tree(first), keras_private.layer_tree(other)
    if len(ours) != len(theirs):
        return f"{first.name} has {len(ours) - 1} sublayers, {other.name} {len(theirs) - 1}"
    for x, y in zip(ours, theirs):
        if type(x) is not type(y):
            return f"{x.name} is a {type(x).__name__}, {y.name} a {type(y).__name__}"
        x_config, y_config = comparable_config(x), comparable_config(y)
        if x_config != y_config:
            keys = sorted(k for k in set(x_config) | set(y_config) if x_config.get(k) != y_config.get(k))
            return f"{type(x).__name__} {x.name!r}: configuration {', '.join(map(repr, keys))} differs"
    for kind in ("trainable_variables", "non_trainable_variables"):
        xs, ys = getattr(first, kind), getattr(other, kind)
        if len(xs) != len(ys):
            return f"{first.name} has {len(xs)} {kind}, {other.name} {len(ys)}"
        for x, y in zip(xs, ys):
            if variable_signature(x) != variable_signature(y):
                return f"variable {x.path} is {variable_signature(x)}, {y.path} is {variable_signature(y)}"
    for x, y in zip(ours[1:], theirs[1:]):
        if _output_layout(x) != _output_layout(y):
            return f"the layout map lays out {x.name}'s output and {y.name}'s differently"
    return None


def comparable_config(layer: Any) -> dict:
    """``layer``'s configuration (the module's contract) without what interchangeable layers may differ in
    (:data:`NOT_COMPARED`, serialized initializers reduced to their class)."""
    try:
        config = layer.get_config()
    except Exception:  # noqa: BLE001 - NotImplementedError for a layer never saved alone; a failing get_config
        config = _constructed_values(layer)
    return {key: _without_initializer_details(value) for key, value in config.items() if key not in NOT_COMPARED}


def _constructed_values(layer: Any) -> dict:
    """What ``get_config`` would hold for a layer that cannot state it: its public attributes of plain values; the
    functions it holds (:func:`_function_identity`); and the
    configuration of any other object that states one (a regularizer, a dtype policy). Sublayers and variables are
    compared on their own; initializers are not (used by ``build`` only)."""
    values: dict = {}
    for key, value in vars(layer).items():
        if key.startswith("_") or isinstance(value, _NOT_HERE()):
            continue
        if _plain(value):
            values[key] = value
        elif isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
            values[key] = _function_identity(value, layer)
        elif callable(getattr(value, "get_config", None)):
            try:
                values[key] = ("configured", type(value), value.get_config())
            except Exception:  # noqa: BLE001 - an object that cannot say its configuration: known only by its type
                values[key] = ("object", type(value))
    return values


def _function_identity(function: Any, layer: Any) -> Tuple[Any, ...]:
    """A function by its code (Keras wraps each instance's ``build`` and ``quantize`` in a function of its own, of
    one code), what it wraps, and for a method whether it is bound to the layer itself."""
    if isinstance(function, types.MethodType):
        return ("method", _function_identity(function.__func__, layer), "own" if function.__self__ is layer
                else type(function.__self__))
    wrapped = getattr(function, "__wrapped__", None)
    return ("function", getattr(function, "__code__", function),
            None if wrapped is None else _function_identity(wrapped, layer))


def _NOT_HERE() -> Tuple[type, ...]:  # noqa: N802 - reads as the constant it is, made when Keras is there
    """What :func:`_constructed_values` leaves to other parts of the description."""
    return (keras_modules.layer_class(), keras_modules.base_variable_class(), keras_modules.initializer_class())


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(item) for item in value)
    return isinstance(value, (type(None), bool, int, float, complex, str, bytes))


def _without_initializer_details(value: Any) -> Any:
    if isinstance(value, dict):
        if keras_modules.is_serialized_initializer(value):
            return ("initializer", value.get("class_name"))
        return {key: _without_initializer_details(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_without_initializer_details(item) for item in value)
    return value


def variable_signature(variable: Any) -> Tuple[Any, ...]:
    """A variable's shape, dtype, trainability and layout (placements, and the mesh by identity)."""
    value = variable.value
    placements = tuple(getattr(value, "placements", ()))
    mesh = getattr(value, "device_mesh", None)
    return (tuple(variable.shape), str(variable.dtype), bool(variable.trainable), placements, id(mesh))


def _output_layout(layer: Any) -> Any:
    distribution = keras_modules.distribution()
    if distribution is None or not hasattr(distribution, "get_tensor_layout"):
        return None
    layout = distribution.get_tensor_layout(f"{layer.path}/output")
    return None if layout is None else tuple(layout.axes)

"""A block's stateless call compiled without TorchDynamo: traced by AOTAutograd once per signature, as JAX's ``jit``.

TorchDynamo interprets Keras' Python bytecode symbolically at every compile, and again at every launch. Keras'
layers are written to be traced by JAX (a functional stateless call, no Python control flow on values), so here the
call's Python runs once, on fake tensors, under AOTAutograd (:func:`.._torch.aot_compile.aot_inductor_function`), and
inductor compiles the forward and backward graphs; inductor's on-disk cache serves a second launch's graphs.

No guards are traced, so what a graph depends on selects it, its **signature**:

- the structure of the arguments, and each leaf that is not a tensor by value (numbers, flags, strings, ``None``;
  any other object by identity);
- each tensor's type, shape, strides, dtype, device and whether it requires grad; a DTensor's placements and mesh
  (its device type, ranks, dim names and process groups);
- the template's description as :mod:`.block_groups` reads it (each sublayer's class and configuration) and its
  Python state (:func:`keras_private.python_state`): a configuration changed after the first call traces again;
- grad mode, and how many times the patch, its options or its rules changed (a graph holds the promotions of the
  rules it was traced under).

A call of a signature seen before runs its graph; a new signature traces and compiles one more (:attr:`traces`
counts them; a block that brings more than :data:`MAX_SIGNATURES` is refused as below). A call whose trace fails (a
value read as a Python number, an op AOTAutograd cannot trace) runs through ``fallback`` from then on, with one
warning naming why; an error of the call itself raises there as it would eagerly. State a call reads that none of
the above carries (a tensor set as an attribute after construction, a global read inside the call) is outside the
contract, as it is for :mod:`.block_groups`; such a model compiles its whole step instead
(``KERAS_DTENSOR_MIXFIX_COMPILE_UNIT=step``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

from ..._lifecycle.compile_cache import compile_cache_guard
from ..._torch.aot_compile import aot_inductor_function, flatten, mesh_by_groups, unflatten
from ..boundary import keras_private
from .block_groups import comparable_config

log = logging.getLogger("keras_dtensor_mixfix")

_PLAIN = (type(None), bool, int, float, complex, str, bytes)
MAX_SIGNATURES = 8
"""Signatures one block may trace; a block called with more (an object made anew at each call) is refused."""


class BlockTracer:
    """``function(template, trainable, non_trainable, args, kwargs)`` compiled once per signature (the module's
    contract); ``fallback`` (same arguments) runs it once a trace fails. ``label`` names the block in the warning."""

    def __init__(self, function: Callable[..., Any], fallback: Callable[..., Any], label: str) -> None:
        self._function = function
        self._fallback = fallback
        self._label = label
        self._graphs: Dict[Hashable, Callable[..., Any]] = {}
        self._kept: Dict[int, Any] = {}  # the objects keyed by identity, kept alive so that no other takes their id
        self._meshes: Dict[int, Tuple[Any, Hashable]] = {}
        self.traces = 0
        """How many signatures were traced and compiled."""
        self.refused: Optional[str] = None
        """Why the tracer gave up on this block (its calls run through ``fallback``), or None."""

    def __call__(self, template: Any, trainable: List[Any], non_trainable: List[Any], args: tuple,
                 kwargs: dict) -> Any:
        if self.refused is not None:
            return self._fallback(template, trainable, non_trainable, args, kwargs)
        import torch

        leaves, spec = flatten((trainable, non_trainable, args, kwargs))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        key = (spec, tuple(self._leaf_key(leaf) for leaf in leaves), _template_key(template),
               torch.is_grad_enabled(), compile_cache_guard.changes)
        graph = self._graphs.get(key)
        if graph is not None:
            return graph(*tensors)
        if self.traces >= MAX_SIGNATURES:
            return self._refuse(f"its calls came with {MAX_SIGNATURES + 1} signatures (a new object or shape at each "
                                "call?)", template, trainable, non_trainable, args, kwargs)
        graph = aot_inductor_function(self._flat(template, leaves, spec))
        try:
            outputs = graph(*tensors)
        except Exception as error:  # noqa: BLE001 - the call runs through the fallback, which raises its own errors
            return self._refuse(f"AOTAutograd could not trace it: {type(error).__name__}: "
                                f"{' '.join(str(error).split())[:400]}", template, trainable, non_trainable, args,
                                kwargs)
        self._graphs[key] = graph
        self.traces += 1
        return outputs

    def _refuse(self, why: str, *call: Any) -> Any:
        self.refused = why
        self._graphs.clear()
        self._kept.clear()
        log.warning("keras_dtensor_mixfix: jit_compile traces %s with TorchDynamo instead: %s", self._label, why)
        return self._fallback(*call)

    def _flat(self, template: Any, leaves: List[Any], spec: Any) -> Callable[..., Any]:
        """The function of this signature's tensors alone (its other leaves fixed), as AOTAutograd traces it."""
        import torch

        positions = [index for index, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        function = self._function

        def flat(*tensors: Any) -> Any:
            filled = list(leaves)
            for index, tensor in zip(positions, tensors):
                filled[index] = tensor
            trainable, non_trainable, args, kwargs = unflatten(filled, spec)
            return function(template, trainable, non_trainable, args, kwargs)

        return flat

    def _leaf_key(self, leaf: Any) -> Hashable:
        import torch

        if isinstance(leaf, torch.Tensor):
            return self._tensor_key(leaf)
        if isinstance(leaf, _PLAIN) or isinstance(leaf, torch.dtype):
            return (type(leaf), leaf)
        self._kept[id(leaf)] = leaf
        return ("object", id(leaf))

    def _tensor_key(self, tensor: Any) -> Tuple[Any, ...]:
        key: Tuple[Any, ...] = (type(tensor), tuple(tensor.shape), tensor.dtype, tensor.device.type,
                                tensor.device.index, tensor.requires_grad)
        placements = getattr(tensor, "placements", None)
        if placements is not None:  # a DTensor: its layout, and its local piece's strides
            local = tensor.to_local()
            return key + (self._mesh_key(tensor.device_mesh), tuple(placements), tuple(local.shape), local.stride())
        return key + (tensor.stride(),)

    def _mesh_key(self, mesh: Any) -> Hashable:
        """A mesh by what a traced graph holds of it: its device type, ranks, dim names and process groups (the
        collectives name them), so that an equal mesh made anew over the same groups is the same signature; by
        identity where this rank has no group of it."""
        known = self._meshes.get(id(mesh))
        if known is not None and known[0] is mesh:
            return known[1]
        parts = mesh_by_groups(mesh)
        key = ("mesh", id(mesh)) if parts is None else _hashable(parts)
        self._meshes[id(mesh)] = (mesh, key)  # the mesh kept: no other object takes its id
        return key


def _template_key(template: Any) -> Hashable:
    """The template's description and Python state, as one hashable value."""
    layers = keras_private.layer_tree(template)
    return (tuple((type(layer), _hashable(comparable_config(layer))) for layer in layers),
            _hashable(keras_private.python_state(template)))


def _hashable(value: Any) -> Hashable:
    if isinstance(value, dict):
        return tuple(sorted(((repr(k), _hashable(v)) for k, v in value.items()), key=lambda item: item[0]))
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(repr(v) for v in value))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value

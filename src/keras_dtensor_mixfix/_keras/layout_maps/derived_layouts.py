"""A Keras ``LayoutMap`` read off a built model's layers: tensor parallelism without a hand-written map.

Tensor parallelism splits each pair of projections so that the activation between them stays split: the
projection that reads the hidden state is split along its outputs (by heads, when it has a heads axis), the one
that writes the hidden state back along its inputs. Which is which follows from the model's own layers: an
``EinsumDense`` equation names the contracted and the kept axes, a ``Dense`` kernel's in and out widths are
compared with the model's hidden width, and, where both are the hidden width, the last projection of a layer
(attention's output, after query, key and value) is the one that writes back. The token embedding is split by
vocabulary (its untied output projection too), experts by expert, and on a mesh with a data axis the hidden
dimension of each split weight over that axis as well (as keras_hub's own maps do). Where heads, experts or the
vocabulary do not divide the model axis, another dim is split instead (a kernel's hidden width, an expert's own
width), so that every rank still holds 1/n. Everything else (norms, biases that follow a reduction, routers, small
tables) stays whole, and each weight left whole carries its reason.

Any layout gives the same values (DTensor computes the global result whatever the split); the derivation chooses
the one that moves the least data and keeps the least on each rank. Only Keras' public layer classes are read here,
and the layer walk through :mod:`..boundary.keras_modules`.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..._rules.errors import InvalidArgumentError
from ..boundary import keras_modules
from . import layer_reading, whole_weights
from .layer_reading import Projection

log = logging.getLogger("keras_dtensor_mixfix")

Axes = Tuple[Optional[str], ...]

_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("keras_dtensor_mixfix: %s", message)


@dataclass
class DerivedLayouts:
    """What :func:`derive_layouts` read off a model.

    Attributes:
        layout_map: the ``keras.distribution.LayoutMap`` to give ``ModelParallel``.
        axes: each split variable's path and its layout axes (one mesh axis name or None per dim).
        left_whole: each variable left whole (replicated) and why.
        model_axis: the mesh axis the projections are split over.
        data_axis: the mesh axis the hidden dimension of split weights is split over as well, or None.
        variables: every variable's path with its shape and dtype name.
        axis_sizes: the mesh's axis names and sizes.
    """

    layout_map: Any
    axes: Dict[str, Axes] = field(default_factory=dict)
    left_whole: Dict[str, str] = field(default_factory=dict)
    model_axis: str = "model"
    data_axis: Optional[str] = None
    variables: Dict[str, Tuple[Tuple[int, ...], str]] = field(default_factory=dict)
    axis_sizes: Dict[str, int] = field(default_factory=dict)

    def bytes_per_rank(self) -> Tuple[int, int]:
        """``(bytes each rank holds, bytes one process holds)`` of the model's weights under this map, read off the
        shapes (nothing is built or run; optimizer slots, which follow their variables' layouts, not counted). The
        derivation splits a dim only over mesh axes that divide it, so every rank holds the same bytes."""
        per_rank = whole = 0
        for path, (shape, dtype) in self.variables.items():
            size = math.prod(shape) * whole_weights.dtype_itemsize(dtype)
            whole += size
            split_over = math.prod(self.axis_sizes[axis] for axis in self.axes.get(path, ()) if axis is not None)
            per_rank += size // split_over
        return per_rank, whole


class _Deriver:
    def __init__(self, model: Any, mesh: Any, model_axis: str, data_axis: Optional[str]):
        self.mesh = mesh
        sizes = dict(zip(mesh.axis_names, mesh.shape))
        self.model_axis, self.data_axis = model_axis, data_axis
        self.model_size = sizes[model_axis]
        self.data_size = sizes[data_axis] if data_axis is not None else 1
        self.walked = list(layer_reading.walk(model))
        self.children = {id(layer): children for layer, _, children in self.walked}
        self.token_embedding = layer_reading.token_embedding([layer for layer, _, _ in self.walked])
        if self.token_embedding is None:
            raise InvalidArgumentError(
                f"keras_dtensor_mixfix.layouts: {type(model).__name__} has no Embedding layer, so there is no "
                "vocabulary or hidden width to derive a layout from; write a keras.distribution.LayoutMap by hand")
        self.hidden = layer_reading.hidden_width(model, self.token_embedding)
        self.axes: Dict[str, Axes] = {}
        self.left_whole: Dict[str, str] = {}
        self.variables: Dict[str, Tuple[Tuple[int, ...], str]] = {}
        self.model_name = type(getattr(model, "backbone", model)).__name__

    # -- helpers ------------------------------------------------------------------------------------------------
    def _divides(self, size: int, axis_size: int) -> bool:
        return axis_size <= 1 or size % axis_size == 0

    def _with_data_axis(self, axes: List[Optional[str]], shape: Sequence[int], preferred: Sequence[int]) -> Axes:
        """Put the data axis on the first of ``preferred`` dims that is free and divides."""
        if self.data_axis is not None and self.data_size > 1:
            for dim in preferred:
                if axes[dim] is None and shape[dim] % self.data_size == 0:
                    axes[dim] = self.data_axis
                    break
        return tuple(axes)

    def _split(self, variable: Any, dim: int, hidden_dims: Sequence[int]) -> None:
        shape = tuple(variable.shape)
        axes: List[Optional[str]] = [None] * len(shape)
        axes[dim] = self.model_axis
        self.axes[variable.path] = self._with_data_axis(axes, shape, hidden_dims)

    def _whole(self, variable: Any, why: str, warn: bool = False) -> None:
        self.left_whole[variable.path] = why
        if warn:
            _warn_once(f"{self.model_name}: {why}; those weights are replicated on every rank of {self.model_axis!r}")

    # -- rules --------------------------------------------------------------------------------------------------
    def derive(self) -> None:
        import keras

        for layer, parents, children in self.walked:
            own = layer_reading.own_variables(layer, children)
            if not own:
                continue
            for variable in own:
                self.variables[variable.path] = (tuple(int(size) for size in variable.shape), str(variable.dtype))
            if layer is self.token_embedding:
                self._token_embedding_rule(own)
            elif isinstance(layer, keras.layers.Embedding):
                for variable in own:
                    self._whole(variable, "a small table beside the token embedding (positions, segments)")
            elif isinstance(layer, (keras.layers.EinsumDense, keras.layers.Dense)):
                self._projection_rule(layer, parents, own)
            else:
                experts = layer_reading.num_experts(layer, parents)
                for variable in own:
                    shape = tuple(variable.shape)
                    if experts is not None and len(shape) >= 2 and shape[0] == experts:
                        self._expert_rule(variable, experts)
                    elif "norm" in type(layer).__name__.lower():
                        self._whole(variable, f"{type(layer).__name__}: a normalization's per-feature weights")
                    else:
                        self._whole(variable, f"{type(layer).__name__}'s own weight of shape {shape}: not an "
                                              "embedding, a Dense or EinsumDense kernel, or one row per expert")

    def _token_embedding_rule(self, own: Sequence[Any]) -> None:
        vocabulary = int(self.token_embedding.input_dim)
        for variable in own:
            shape = tuple(variable.shape)
            vocabulary_dim = shape.index(vocabulary) if vocabulary in shape else 0
            hidden_dim = 1 - vocabulary_dim
            if self._divides(vocabulary, self.model_size):
                self._split(variable, vocabulary_dim, [hidden_dim])
            elif self._divides(shape[hidden_dim], self.model_size):
                _warn_once(f"{self.model_name}: the vocabulary ({vocabulary}) does not divide mesh axis "
                           f"{self.model_axis!r} ({self.model_size} ranks), so the token embedding (and an untied "
                           "output projection) is split along its hidden dimension instead (each rank computes every "
                           f"class's logit in part); a vocabulary padded to a multiple of {self.model_size} splits "
                           "by vocabulary")
                self._split(variable, hidden_dim, [vocabulary_dim])
            else:
                self._whole(variable, f"neither the vocabulary ({vocabulary}) nor the hidden width "
                                      f"({shape[hidden_dim]}) divides {self.model_size}", warn=True)

    def _projection(self, layer: Any, kernel: Any) -> Optional[Projection]:
        import keras

        if isinstance(layer, keras.layers.EinsumDense):
            return layer_reading.einsum_projection(layer, tuple(kernel.shape))
        return layer_reading.dense_projection(layer, tuple(kernel.shape))

    def _role(self, projection: Projection, parents: Sequence[Any]) -> Optional[str]:
        """"column" (split the kept axes: the layer reads the hidden state), "row" (split the contracted axes: it
        writes the hidden state), or None."""
        reads = projection.width(projection.contracted) == self.hidden
        writes = projection.width(projection.kept) == self.hidden
        if reads and (not writes or len(projection.kept) > 1):
            return "column"
        if writes and (not reads or len(projection.contracted) > 1):
            return "row"
        if reads and writes:  # a square kernel: the last projection of its layer writes back
            return "row" if self._last_projection_of_its_layer(projection.layer, parents) else "column"
        return None

    def _last_projection_of_its_layer(self, layer: Any, parents: Sequence[Any]) -> bool:
        import keras

        if not parents:
            return False
        siblings = [child for child in self.children[id(parents[-1])]
                    if isinstance(child, (keras.layers.EinsumDense, keras.layers.Dense))]
        return len(siblings) > 1 and siblings[-1] is layer

    def _projection_rule(self, layer: Any, parents: Sequence[Any], own: Sequence[Any]) -> None:
        kernel = getattr(layer, "kernel", None)
        kernel = kernel if any(v is kernel for v in own) else None
        projection = self._projection(layer, kernel) if kernel is not None else None
        if kernel is None or projection is None:
            for variable in own:
                self._whole(variable, f"{type(layer).__name__} {getattr(layer, 'equation', '')}: no kernel this "
                                      "derivation reads")
            return
        # a router sits beside its experts: in the layer that counts them, or in a layer of its own there
        experts = layer_reading.num_experts(layer, parents[-1:])
        if experts is not None and projection.width(projection.kept) == experts:
            for variable in own:
                self._whole(variable, "a router: its logits are ranked over all experts, and it is small")
            return
        role = self._role(projection, parents)
        if role is None:
            for variable in own:
                self._whole(variable, f"{type(layer).__name__} of kernel {tuple(kernel.shape)}: neither reads nor "
                                      f"writes the hidden width {self.hidden}")
            return
        split_side, other_side = ((projection.kept, projection.contracted) if role == "column"
                                  else (projection.contracted, projection.kept))
        # the outermost axis of the split side: the heads, where there are heads
        label = next((label for label in split_side if projection.sizes[label] > 1), None)
        if label is None:
            for variable in own:
                self._whole(variable, f"{layer.name}: a single {'output' if role == 'column' else 'input'}")
            return
        if not self._divides(projection.sizes[label], self.model_size):
            what = "heads" if len(split_side) > 1 else "features"
            why = (f"{layer.name}: its {projection.sizes.get(label, 1)} {what} do not divide mesh axis "
                   f"{self.model_axis!r} ({self.model_size} ranks)")
            if self._split_along_hidden(layer, kernel, projection, split_side, other_side, why):
                for variable in own:
                    if variable is not kernel:
                        self._whole(variable, f"{why}, and its kernel is split along the hidden width: a bias "
                                              "beside it stays whole")
                return
            for variable in own:
                self._whole(variable, why, warn=variable is kernel)
            return
        kernel_dim = projection.kernel_labels.index(label)
        hidden_dims = [projection.kernel_labels.index(other) for other in other_side]
        self._split(kernel, kernel_dim, hidden_dims)
        for variable in own:
            if variable is kernel:
                continue
            self._bias_rule(layer, variable, projection, role, label)

    def _split_along_hidden(self, layer: Any, kernel: Any, projection: Projection, split_side: Sequence[str],
                            other_side: Sequence[str], why: str) -> bool:
        """Where the heads (or features) do not divide the model axis: split the kernel along its hidden-width dim
        over the model axis instead, if the hidden width divides it (keras_hub's own maps split attention kernels
        this way: each rank contracts its part of the hidden state, and the partial sums are reduced). The
        activation between two projections is then whole, so each projection costs a reduction: less than the
        bytes of every rank holding the whole kernel. False where nothing divides."""
        hidden_label = next((label for label in other_side if projection.sizes[label] == self.hidden), None)
        if hidden_label is None or not self._divides(self.hidden, self.model_size):
            return False
        kernel_dim = projection.kernel_labels.index(hidden_label)
        self._split(kernel, kernel_dim, [projection.kernel_labels.index(label) for label in split_side])
        _warn_once(f"{self.model_name}: {why}, so its kernel is split along the hidden width "
                   f"({self.hidden}) instead: a reduction across {self.model_axis!r} per projection")
        return True

    def _bias_rule(self, layer: Any, variable: Any, projection: Projection, role: str, label: str) -> None:
        shape = tuple(variable.shape)
        if role == "row":
            self._whole(variable, "a bias added after the split inputs are summed")
            return
        bias_labels = getattr(layer, "bias_axes", None) or ("o" if projection.kernel_labels == "io" else None)
        if bias_labels and label in bias_labels and len(bias_labels) == len(shape):
            axes: List[Optional[str]] = [None] * len(shape)
            axes[bias_labels.index(label)] = self.model_axis
            self.axes[variable.path] = tuple(axes)
        else:
            self._whole(variable, f"{type(layer).__name__} weight of shape {shape} this derivation does not read")

    def _expert_rule(self, variable: Any, experts: int) -> None:
        """One row per expert: split by expert (each rank computes its experts for every token, and the routing
        weights' sum over experts adds the ranks' parts)."""
        shape = tuple(variable.shape)
        hidden_dims = [dim for dim in range(1, len(shape)) if shape[dim] == self.hidden]
        if self._divides(experts, self.model_size):
            self._split(variable, 0, hidden_dims)
            return
        why = f"{experts} experts do not divide mesh axis {self.model_axis!r} ({self.model_size} ranks)"
        # each expert's own width (its intermediate dim) instead, Megatron's split of a feed-forward pair: the
        # first projection's outputs and the second's inputs, so that only the second's sum is reduced
        inner = next((dim for dim in range(1, len(shape)) if dim not in hidden_dims
                      and self._divides(shape[dim], self.model_size)), None)
        if inner is None and len(hidden_dims) > 1:  # an expert's width equal to the hidden width: its last dim
            inner = next((dim for dim in reversed(range(1, len(shape)))
                          if self._divides(shape[dim], self.model_size)), None)
        if inner is None:
            self._whole(variable, why, warn=True)
            return
        _warn_once(f"{self.model_name}: {why}, so each expert's weights are split along its own width instead")
        self._split(variable, inner, hidden_dims)

    # -- the map ------------------------------------------------------------------------------------------------
    def layout_map(self) -> Any:
        """Anchored keys, one per repeated layer pattern (``block(?:_\\d+)?``) where every match has the same
        axes: a key naming one path exactly would miss the layers of a model built again, whose names Keras numbers
        by how many layers of that name the session made before (``moe_block``, then ``moe_block_2``)."""
        import keras

        by_pattern: Dict[str, Dict[str, Axes]] = {}
        for path, axes in self.axes.items():
            pattern = "/".join(re.escape(re.sub(r"_\d+$", "", part)) + r"(?:_\d+)?" for part in path.split("/"))
            by_pattern.setdefault(pattern, {})[path] = axes
        whole_paths = set(self.left_whole)
        layout_map = keras.distribution.LayoutMap(self.mesh)
        for pattern, members in by_pattern.items():
            key = f"^{pattern}$"
            general = (len(set(members.values())) == 1
                       and not any(re.fullmatch(pattern, path) for path in whole_paths))
            if general:
                layout_map[key] = next(iter(members.values()))
            else:
                for path, axes in members.items():
                    layout_map[f"^{re.escape(path)}$"] = axes
        return layout_map


def _axis_names(mesh: Any, model_axis: Optional[str], data_axis: Any) -> Tuple[str, Optional[str]]:
    names = list(mesh.axis_names)
    if model_axis is None:
        model_axis = "model" if "model" in names else names[-1]
    if model_axis not in names:
        raise InvalidArgumentError(f"keras_dtensor_mixfix.layouts: model_axis={model_axis!r} is not an axis of the "
                                   f"mesh {tuple(names)}; pass one of them")
    if data_axis is _FIRST_OTHER_AXIS:
        data_axis = next((name for name in names if name != model_axis), None)
    if data_axis is not None and (data_axis not in names or data_axis == model_axis):
        raise InvalidArgumentError(f"keras_dtensor_mixfix.layouts: data_axis={data_axis!r} must be an axis of the "
                                   f"mesh {tuple(names)} other than model_axis={model_axis!r}, or None")
    return model_axis, data_axis


class _FirstOtherAxis:
    def __repr__(self) -> str:
        return "<the mesh's first axis other than model_axis>"


_FIRST_OTHER_AXIS: Any = _FirstOtherAxis()


def _built_model(model: Any, config: Optional[Mapping[str, Any]]) -> Any:
    """An instance to read: ``model`` itself, or a class built from ``config`` outside any distribution with its
    variables never initialized (shapes only: no memory for weights, on every backend)."""
    if not isinstance(model, type):
        if config is not None:
            raise InvalidArgumentError("keras_dtensor_mixfix.layouts: config= is for a model class; "
                                       f"got an instance of {type(model).__name__}")
        if not model.weights:
            raise InvalidArgumentError(f"keras_dtensor_mixfix.layouts: {type(model).__name__} has no weights yet; "
                                       "build it first, or pass its class and config=")
        return model
    import keras

    backbone_class = getattr(model, "backbone_cls", None) or model  # a keras_hub task class names its backbone's
    previous = keras.distribution.distribution()
    pending = keras_modules.uninitialized_variables()
    keras.distribution.set_distribution(None)
    try:
        with keras.StatelessScope(initialize_variables=False):
            return backbone_class(**dict(config or {}))
    finally:
        # the shape-only variables must not be initialized by the next stateless scope Keras closes
        keras_modules.set_uninitialized_variables(pending)
        keras.distribution.set_distribution(previous)


def derive_layouts(model: Any, mesh: Any, *, config: Optional[Mapping[str, Any]] = None,
                   model_axis: Optional[str] = None, data_axis: Any = _FIRST_OTHER_AXIS) -> DerivedLayouts:
    """See :func:`keras_dtensor_mixfix.layouts.derive_layouts`."""
    model_axis, data_axis = _axis_names(mesh, model_axis, data_axis)
    deriver = _Deriver(_built_model(model, config), mesh, model_axis, data_axis)
    deriver.derive()
    if deriver.left_whole:
        log.info("keras_dtensor_mixfix: %s: %d variables split, %d left whole", deriver.model_name,
                 len(deriver.axes), len(deriver.left_whole))
    return DerivedLayouts(deriver.layout_map(), deriver.axes, deriver.left_whole, model_axis, data_axis,
                          deriver.variables, dict(zip(mesh.axis_names, (int(size) for size in mesh.shape))))

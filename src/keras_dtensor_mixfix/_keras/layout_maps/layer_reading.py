"""What the layout derivation reads off a built Keras model's layers: each kernel's contracted and kept axes (an
``EinsumDense`` equation's labels, a ``Dense`` kernel's in and out), the layer tree with each layer's own variables,
the model's hidden width, its token embedding and a layer's expert count.

Contract: read only; public Keras layer classes and attributes, and the layer walk of :mod:`..boundary.keras_private`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ..boundary import keras_private


@dataclass
class Projection:
    """One kernel's contracted and kept axes: per kernel dim, whether it is contracted, and its label."""

    layer: Any
    kernel_labels: str
    contracted: List[str]  # in the order the layer's input has them
    kept: List[str]  # in the order the layer's output has them
    sizes: Dict[str, int]

    def width(self, labels: Sequence[str]) -> int:
        return math.prod(self.sizes[label] for label in labels)


def einsum_projection(layer: Any, kernel_shape: Sequence[int]) -> Optional[Projection]:
    equation = str(layer.equation).replace(" ", "")
    match = re.fullmatch(r"([a-zA-Z.]+),([a-zA-Z]+)->([a-zA-Z.]+)", equation)
    if match is None or len(match.group(2)) != len(kernel_shape):
        return None
    inputs, kernel, output = match.groups()
    sizes = dict(zip(kernel, kernel_shape))
    contracted = [label for label in inputs if label in kernel and label not in output]
    kept = [label for label in output if label in kernel]
    return Projection(layer, kernel, contracted, kept, sizes)


def dense_projection(layer: Any, kernel_shape: Sequence[int]) -> Optional[Projection]:
    if len(kernel_shape) != 2:
        return None
    return Projection(layer, "io", ["i"], ["o"], {"i": kernel_shape[0], "o": kernel_shape[1]})


def own_variables(layer: Any, children: Sequence[Any]) -> List[Any]:
    nested = {id(v) for child in children for v in child.weights}
    return [v for v in layer.weights if id(v) not in nested]


def walk(layer: Any, parents: Tuple[Any, ...] = ()) -> Iterator[Tuple[Any, Tuple[Any, ...], List[Any]]]:
    """Every layer under ``layer`` (itself first), with its ancestors and its direct children."""
    children = keras_private.sublayers(layer)
    yield layer, parents, children
    for child in children:
        yield from walk(child, parents + (layer,))


def hidden_width(model: Any, token_embedding: Any) -> int:
    backbone = getattr(model, "backbone", model)
    width = getattr(backbone, "hidden_dim", None)
    if isinstance(width, int) and width > 0:
        return width
    return int(token_embedding.output_dim)


def token_embedding(layers: Sequence[Any]) -> Any:
    import keras

    embeddings = [layer for layer in layers if isinstance(layer, keras.layers.Embedding)]
    if not embeddings:
        return None
    return max(embeddings, key=lambda layer: int(layer.input_dim))


def num_experts(layer: Any, parents: Sequence[Any]) -> Optional[int]:
    for owner in (layer, *reversed(parents)):
        experts = getattr(owner, "num_experts", None)
        if isinstance(experts, int) and experts > 1:
            return experts
    return None

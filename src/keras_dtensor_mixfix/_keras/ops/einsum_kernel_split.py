"""A kernel split only along a contracted label, re-split along an output label before the einsum.

keras_hub's Llama, Llama3 and Qwen layout maps split the query, key and value kernels
(``(hidden, heads, head_dim)``) along the hidden dim, their *input*, on the "model" axis. With the
activations whole on every rank, each projection then gives a partial sum over ranks, reduced at once
(an all-reduce of the whole ``(batch, length, heads, head_dim)`` projection, three per layer forward
and more in backward), and attention runs on every head on every rank.

Splitting the kernel along an output label instead (Megatron's column-parallel projection) needs no
reduction of the result: each rank computes its own heads, attention runs on them (``attention_ops``),
and the output projection, split along heads too, leaves one partial sum per layer. The kernel's
re-split costs one gather of the kernel per step, and one of its gradient; it is done only where the
kernel (a layer's weight) is smaller than the result whose reduction it replaces, and only along the
kernel's first output label in its own dim order (the heads of ``(hidden, heads, head_dim)``), where
that label is not split already and divides evenly.

The same runs while ``torch.compile`` traces (Keras' ``jit_compile``), so the compiled step takes the
path eager takes: without it, attention would run on every head, and DTensor fails to propagate the
output projection's sharding under fake tensors (keras_hub Qwen and Llama3).

The layout map chose the input split, and the re-split costs each step a gather of the kernel: a warning, once per
layout map rule, names the rule that splits the kernel along that output from the start (the same axes, the
moved one swapped between the two dims; docs/keras.md, "Speed"). Eager only: a log call would break a compiled
graph.

Applied only on a mesh dim where exactly one operand is split, along a label the output lacks, and
every other operand is whole; anything else is passed on unchanged to the einsum below
(``local_einsum``, then Keras'). Values are the same (the contraction is merely done elsewhere).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any, List, Optional, Sequence, Set, Tuple

from ..._lifecycle.recorder import PatchRecorder
from ..boundary import keras_modules, keras_private
from ..boundary.overrides import Override
from ..boundary.patches import rebind_everywhere
from .local_einsum import label_sizes, parse


def _kernel_split_einsum(patches: PatchRecorder) -> None:
    """Wrap the einsum installed now (``local_einsum``'s, installed before this)."""
    numpy_module = keras_modules.backend_numpy()
    current = numpy_module.einsum
    rebind_everywhere(patches, current, _kernel_split_on_output(current))


OVERRIDE = Override(
    name="einsum kernel split",
    attributes=("einsum",), description="ops: a kernel re-split so that more einsums line up",
    apply=_kernel_split_einsum, after=("local einsum",))
"""Wraps the einsum ``local einsum`` installed."""


def _kernel_split_on_output(inner: Any) -> Any:
    @functools.wraps(inner)
    def einsum(subscripts: Any, *operands: Any, **kwargs: Any) -> Any:
        return inner(subscripts, *resplit_kernel(subscripts, operands), **kwargs)

    return einsum


def resplit_kernel(subscripts: Any, operands: Sequence[Any]) -> Sequence[Any]:
    """``operands``, with a kernel split only along a contracted label re-split along an output label."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if len(operands) != 2 or not isinstance(subscripts, str):
        return operands
    tensors: List[Any] = [getattr(o, "value", o) if not isinstance(o, torch.Tensor) else o for o in operands]
    if not all(isinstance(t, DTensor) for t in tensors) or tensors[0].device_mesh != tensors[1].device_mesh:
        return operands
    parsed = parse(subscripts, 2)
    if parsed is None:
        return operands
    inputs, output = parsed
    mesh = tensors[0].device_mesh
    out_numel = _output_numel(inputs, output, [t.shape for t in tensors])
    if out_numel is None:
        return operands
    for index, (kernel, labels) in enumerate(zip(tensors, inputs)):
        if not (hasattr(operands[index], "value") or isinstance(operands[index], torch.nn.Parameter)):
            continue  # only a layer's weight: an activation's split is what the layers around it expect
        other, other_labels = tensors[1 - index], inputs[1 - index]
        if kernel.numel() >= out_numel:
            continue  # gathering the kernel would move more than reducing the result
        # the kernel's first output label (its own dim order): the heads of (hidden, heads, head_dim)
        target = next((dim for dim, label in enumerate(labels) if label in output and label not in other_labels),
                      None)
        if target is None:
            continue
        split = {p.dim for mesh_dim, p in enumerate(kernel.placements)
                 if isinstance(p, Shard) and mesh.size(mesh_dim) > 1}
        wanted = list(kernel.placements)
        for mesh_dim, placement in enumerate(kernel.placements):
            if (mesh.size(mesh_dim) == 1 or not isinstance(placement, Shard) or labels[placement.dim] in output
                    or not isinstance(other.placements[mesh_dim], Replicate)):
                continue
            if target in split or kernel.shape[target] % mesh.size(mesh_dim):
                break
            wanted[mesh_dim] = Shard(target)
            split.add(target)
        else:
            if tuple(wanted) == tuple(kernel.placements):
                continue
            # a size-1 mesh dim "splitting" the target dim too would make it split twice: whole there (no data moves)
            wanted = [Replicate() if mesh.size(mesh_dim) == 1 and isinstance(p, Shard) and p.dim == target else p
                      for mesh_dim, p in enumerate(wanted)]
            if not torch.compiler.is_compiling():  # a log call would break the compiled graph
                advise_layout_once(operands[index], kernel, wanted)
            resplit = list(tensors)
            resplit[index] = kernel.redistribute(mesh, wanted)  # differentiable: the gradient goes back
            return resplit
    return operands


log = logging.getLogger("keras_dtensor_mixfix")

_advised: Set[str] = set()
"""The layout map keys (or variable paths) whose re-split was advised against, once each per process."""


def advise_layout_once(variable: Any, kernel: Any, wanted: Sequence[Any]) -> None:
    """A warning, once per layout map rule, that the rule makes every step re-split this kernel, with the rule
    that would not: the same axes with the one that moves swapped between the two dims."""
    path = getattr(variable, "path", None)
    if not isinstance(path, str):
        return  # a bare parameter: no layout map rule to name
    key, axes = _rule_of(path)
    if axes is None or (key or path) in _advised:
        return
    better = _swapped(axes, kernel, wanted)
    if better is None:
        return
    _advised.add(key or path)
    rule_key = key if key is not None else re.escape(path)
    log.warning(
        "keras_dtensor_mixfix: the layout map splits %s %s as %r, along a dim its einsum contracts, so every step "
        "gathers it and splits it again along its output (and its gradient back); layout_map[%r] = %r splits it "
        "that way from the start (see docs/keras.md, \"Speed\")",
        path, "x".join(str(int(d)) for d in kernel.shape), tuple(axes), rule_key, better)


def _rule_of(path: str) -> Tuple[Optional[str], Optional[Tuple[Any, ...]]]:
    """The layout map key matching ``path`` as Keras matches it (exactly, else the one full regex match), and its
    axes; ``(None, None)`` without a layout map or a rule."""
    layout_map = keras_private.layout_map_of(keras_modules.distribution())
    if layout_map is None:
        return None, None
    keys = list(layout_map)
    matching = [path] if path in keys else [key for key in keys if re.fullmatch(key, path)]
    if len(matching) != 1:
        return None, None
    layout = layout_map[matching[0]]
    axes = getattr(layout, "axes", None)
    return matching[0], (tuple(axes) if axes is not None else None)


def _swapped(axes: Tuple[Any, ...], kernel: Any, wanted: Sequence[Any]) -> Optional[Tuple[Any, ...]]:
    """``axes`` with each mesh axis that the re-split moves put on its new dim, and what that dim had on the old."""
    from torch.distributed.tensor import Shard

    names = kernel.device_mesh.mesh_dim_names
    if names is None or len(axes) != kernel.ndim:
        return None
    better = list(axes)
    for mesh_dim, (before, after) in enumerate(zip(kernel.placements, wanted)):
        if isinstance(before, Shard) and isinstance(after, Shard) and before.dim != after.dim:
            name = names[mesh_dim]
            if better[before.dim] != name:
                return None  # the placements do not come from this rule
            better[before.dim], better[after.dim] = better[after.dim], better[before.dim]
    return tuple(better) if better != list(axes) else None


def _output_numel(inputs: Sequence[str], output: str, shapes: Sequence[Any]) -> Any:
    sizes = label_sizes(inputs, shapes)
    if sizes is None:
        return None
    # a loop, not math.prod over a generator: TorchDynamo (torch 2.13) cannot pass a generator to math.prod,
    # and a graph break here, under Keras' name_scope, threw the whole layer call out of the graph
    numel = 1
    for label in output:
        numel *= max(sizes[label])  # a size-1 dim broadcasts
    return numel

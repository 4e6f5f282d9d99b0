"""The arithmetic of a layout, shared by placements.py and construct.py: this rank's slice of a whole tensor
and the spec of a promoted DTensor, both cached in eager mode (caches.py). Nothing here builds a DTensor."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from .._torch.api import DTensorSpec, TensorMeta, compute_local_shape_and_global_offset
from .caches import CACHES, remember

_SLICES = CACHES.slices
# Specs are immutable once built (torch itself shares one spec between DTensors, e.g. from its
# sharding-propagation cache), and building one is costly next to the rest of a promotion, so
# promotions in eager mode reuse them. Never used while tracing: sizes may be symbolic there.
_SPECS = CACHES.specs

# Placement types whose specs may be shared; anything else (_StridedShard, user subclasses) is
# built afresh each time.
SHAREABLE_PLACEMENTS = (Shard, Replicate, Partial)


def region(offsets: Sequence[int], shape: Sequence[int]) -> Tuple[slice, ...]:
    """The slices of the block of ``shape`` that starts at ``offsets``."""
    return tuple(slice(o, o + s) for o, s in zip(offsets, shape))


def local_slice(shape: Tuple[int, ...], mesh: Any, placements: Tuple[Placement, ...]) -> Optional[Tuple[slice, ...]]:
    """This rank's slice of a tensor of global ``shape`` laid out with ``placements`` on ``mesh``; None where this
    rank's coordinate is not a number but stands for every rank's (torch's rank simulator, ``LocalTensorMode``, where
    one process holds each simulated rank's value): DTensor's own chunking then gives each rank its piece."""
    key = (shape, mesh, placements)
    found = _SLICES.get(key)
    if found is None:
        local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
        if not all(type(size) is int for size in (*local_shape, *offsets)):
            return None
        found = region(offsets, local_shape)
        remember(_SLICES, key, found)
    return found


def contiguous_stride(shape: Sequence[int]) -> Tuple[int, ...]:
    stride: List[int] = []
    running = 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(int(size), 1)
    return tuple(reversed(stride))


def stride_in_order_of(local: torch.Tensor, shape: Sequence[int]) -> Tuple[int, ...]:
    """The strides of a tensor of global ``shape`` laid out in memory in the dim order of ``local`` (this rank's piece,
    which a kernel may have returned as a transposed view): outermost first, a dense layout."""
    order = sorted(range(len(shape)), key=lambda dim: (local.stride(dim), local.shape[dim]), reverse=True)
    strides = [0] * len(shape)
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= max(int(shape[dim]), 1)
    return tuple(strides)


def make_spec(mesh: Any, placements: Tuple[Placement, ...], shape: Sequence[int], stride: Sequence[int],
              dtype: torch.dtype, cache: bool = False) -> DTensorSpec:
    """A spec; with ``cache`` (eager only: concrete sizes) an equal spec built before is reused."""
    if not cache or not all(type(p) in SHAREABLE_PLACEMENTS for p in placements):
        return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype))
    key = (mesh, placements, tuple(shape), tuple(stride), dtype)
    found = _SPECS.get(key)
    if found is None:
        found = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype))
        remember(_SPECS, key, found)
    return found

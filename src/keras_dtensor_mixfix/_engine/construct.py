"""Build promoted DTensors: specs, this rank's slice of a whole tensor, the DTensor itself.

Eager promotions reuse specs and slices (bounded caches); nothing here communicates.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from .._torch.api import DTensorSpec, TensorMeta, compute_local_shape_and_global_offset, dtensor_fast_constructor, is_traced

SLICE_CACHE: Dict[Tuple[Any, ...], Tuple[slice, ...]] = {}
# (mesh, placements, shape, stride, dtype) -> DTensorSpec. Specs are immutable once built
# (torch itself shares one spec between DTensors, e.g. from its sharding-propagation cache), and
# building one costs about 12 us, so promotions in eager mode reuse them. Never used while
# tracing: sizes may be symbolic there.
SPEC_CACHE: Dict[Tuple[Any, ...], DTensorSpec] = {}


# Every cache is bounded: eager code with ever-changing shapes must not grow them forever.
CACHE_LIMIT = 4096
# Placement types whose specs may be shared; anything else (_StridedShard, user subclasses) is
# built afresh each time.
SHAREABLE_PLACEMENTS = (Shard, Replicate, Partial)


def remember(cache: Dict[Any, Any], key: Any, value: Any) -> None:
    if len(cache) >= CACHE_LIMIT:
        cache.clear()
    cache[key] = value


def local_slice(shape: Tuple[int, ...], mesh: Any, placements: Tuple[Placement, ...]) -> Tuple[slice, ...]:
    key = (shape, mesh, placements)
    found = SLICE_CACHE.get(key)
    if found is None:
        local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
        found = tuple(slice(o, o + s) for o, s in zip(offsets, local_shape))
        remember(SLICE_CACHE, key, found)
    return found


def contiguous_stride(shape: Sequence[int]) -> Tuple[int, ...]:
    stride: List[int] = []
    running = 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(int(size), 1)
    return tuple(reversed(stride))


def make_spec(mesh: Any, placements: Tuple[Placement, ...], shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype,
          cache: bool = False) -> DTensorSpec:
    """A spec; with ``cache`` (eager only: concrete sizes) an equal spec built before is reused."""
    if not cache or not all(type(p) in SHAREABLE_PLACEMENTS for p in placements):
        return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype))
    key = (mesh, placements, tuple(shape), tuple(stride), dtype)
    found = SPEC_CACHE.get(key)
    if found is None:
        found = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype))
        remember(SPEC_CACHE, key, found)
    return found


# Eager promotions build DTensors with the C++ constructor alone (see dtensor_fast_constructor);
# traced ones use the full constructor.
dtensor_new: Optional[Callable[..., DTensor]] = dtensor_fast_constructor()


def new_dtensor(local: torch.Tensor, spec: DTensorSpec, eager: bool) -> DTensor:
    if eager and dtensor_new is not None:
        return dtensor_new(DTensor, local, spec, requires_grad=False)
    return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]


def local_piece(plain: torch.Tensor, local_index: Optional[Tuple[slice, ...]]) -> torch.Tensor:
    """This rank's piece of the whole tensor ``plain`` (all of it for ``None``), detached: below
    autograd the flag means nothing, and detaching keeps DTensor from warning about it."""
    local = plain if local_index is None else plain[local_index]
    return local.detach() if local.requires_grad else local


def wrap_result(out: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """A local result wrapped the way DTensor wraps one (``requires_grad`` from the result)."""
    if dtensor_new is not None:
        return dtensor_new(DTensor, out, spec, requires_grad=out.requires_grad)
    return DTensor(out, spec, requires_grad=out.requires_grad)  # type: ignore[call-arg]


def wrap(local: torch.Tensor, mesh: Any, placements: Tuple[Placement, ...], shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> DTensor:
    if local.requires_grad:
        # Below autograd the flag means nothing; detaching keeps DTensor from warning about it.
        local = local.detach()
    eager = not is_traced(local)
    return new_dtensor(local, make_spec(mesh, placements, shape, stride, dtype, cache=eager), eager)


def clear_construct_caches() -> None:
    SLICE_CACHE.clear()
    SPEC_CACHE.clear()

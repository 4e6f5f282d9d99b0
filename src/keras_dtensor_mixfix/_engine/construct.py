"""Stage 5, construct: build the promoted DTensors and the call that carries them.

A whole tensor becomes a DTensor holding this rank's slice of it (or all of it); a local piece
is wrapped as it is. Eager promotions reuse specs and slices (bounded caches, see caches.py);
nothing here communicates.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate

from .._torch.api import DTensorSpec, dtensor_fast_constructor, is_traced, redistribute_local_tensor
from .specs import contiguous_stride, local_slice, make_spec

Rebuilt = Tuple[Tuple[Any, ...], Dict[str, Any]]


# Eager promotions build DTensors with the C++ constructor alone (see dtensor_fast_constructor);
# traced ones use the full constructor.
dtensor_new: Optional[Callable[..., DTensor]] = dtensor_fast_constructor()


def new_dtensor(local: torch.Tensor, spec: DTensorSpec, eager: bool) -> DTensor:
    if eager and dtensor_new is not None:
        return dtensor_new(DTensor, local, spec, requires_grad=False)
    return DTensor(local, spec, requires_grad=False)


def local_piece(plain: torch.Tensor, local_index: Optional[Tuple[slice, ...]]) -> torch.Tensor:
    """This rank's piece of the whole tensor ``plain`` (all of it for ``None``), detached: below
    autograd the flag means nothing, and detaching keeps DTensor from warning about it."""
    local = plain if local_index is None else plain[local_index]
    return local.detach() if local.requires_grad else local


def wrap(local: torch.Tensor, mesh: Any, placements: Tuple[Placement, ...], shape: Sequence[int], stride: Sequence[int],
         dtype: torch.dtype) -> DTensor:
    """``local`` as this rank's piece of a DTensor of global ``shape``/``stride``."""
    if local.requires_grad:
        # Below autograd the flag means nothing; detaching keeps DTensor from warning about it.
        local = local.detach()
    eager = not is_traced(local)
    return new_dtensor(local, make_spec(mesh, placements, shape, stride, dtype, cache=eager), eager)


def whole_dtensor(plain: torch.Tensor, mesh: Any, placements: Tuple[Placement, ...]) -> DTensor:
    """The whole tensor ``plain`` as a DTensor with ``placements``: this rank keeps its slice."""
    shape = tuple(plain.shape)
    if all(p.is_replicate() for p in placements):
        return wrap(plain, mesh, placements, shape, plain.stride(), plain.dtype)
    index = None if is_traced(plain) else local_slice(shape, mesh, placements)
    if index is None:
        # torch.compile traces rank-agnostically, and torch's rank simulator holds every rank at once (the mesh
        # coordinate is symbolic in both): a concrete slice offset would be one rank's and wrong on the others.
        # DTensor's own Replicate -> Shard step is traceable and local (no communication).
        replicated = make_spec(mesh, (Replicate(),) * mesh.ndim, shape, plain.stride(), plain.dtype)
        target = make_spec(mesh, placements, shape, plain.stride(), plain.dtype)
        local = redistribute_local_tensor(plain, replicated, target)
        return new_dtensor(local, target, eager=False)
    return wrap(plain[index], mesh, placements, shape, plain.stride(), plain.dtype)


def local_dtensor(plain: torch.Tensor, mesh: Any, placements: Tuple[Placement, ...], shape: Tuple[int, ...]) -> DTensor:
    """``plain`` as this rank's piece of a contiguous DTensor of global ``shape``."""
    return wrap(plain, mesh, placements, shape, contiguous_stride(shape), plain.dtype)


def rebuild(args: Tuple[Any, ...], kwargs: Dict[str, Any], replacements: Dict[Tuple[Any, ...], DTensor]) -> Rebuilt:
    """The call's arguments with each promoted operand in its place (``replacements`` by position)."""
    new_args = list(args)
    new_kwargs = dict(kwargs)
    lists: Dict[Any, List[Any]] = {}
    for position, value in replacements.items():
        head = position[0]
        container: Any = new_args if isinstance(head, int) else new_kwargs
        if len(position) == 1:
            container[head] = value
        else:
            if head not in lists:
                original = container[head]
                lists[head] = list(original)
            lists[head][position[1]] = value
    for head, items in lists.items():
        container = new_args if isinstance(head, int) else new_kwargs
        original = container[head]
        container[head] = tuple(items) if isinstance(original, tuple) else items
    return tuple(new_args), new_kwargs

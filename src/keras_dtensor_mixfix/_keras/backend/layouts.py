"""Keras layouts as DTensor layouts: a mesh and one placement per mesh dim, and moving tensors to them.

What the torch ``distribution_lib`` (:mod:`.distribution_lib`) builds from a Keras ``TensorLayout``,
and what the integration's ops (:mod:`.local_pieces`) use to put a tensor where a layout says. Only torch is
imported here, never Keras.
"""

from __future__ import annotations

import logging
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..._rules.errors import InvalidArgumentError

log = logging.getLogger("keras_dtensor_mixfix")


class TorchLayout(NamedTuple):
    """What ``TensorLayout.backend_layout`` is on torch."""

    mesh: Any
    placements: Tuple[Any, ...]

    @property
    def device_mesh(self) -> Any:
        """Keras 3.16's ``DTensorLayout`` name for the mesh."""
        return self.mesh


DTensorLayout = TorchLayout
"""Keras 3.16's name for a backend layout (``DTensorLayout(device_mesh, placements)``)."""


def placements_for(axes: Sequence[Optional[str]], mesh_axis_names: Sequence[str],
                   mesh_shape: Optional[Sequence[int]] = None) -> Tuple[Any, ...]:
    """Keras layout axes (one per tensor dim) -> DTensor placements (one per mesh dim).

    A mesh axis of size 1 splits nothing, so its placement is ``Replicate()`` whatever the layout
    says: the local tensors are the same, and DTensor's sharding propagation stays away from
    strategies (and shard orders) that only differ on an axis where no data moves.
    """
    from torch.distributed.tensor import Replicate, Shard

    unknown = [a for a in axes if a is not None and a not in mesh_axis_names]
    if unknown:
        raise InvalidArgumentError(f"keras_dtensor_mixfix: layout axes {tuple(axes)} name {unknown}, which the mesh "
                         f"{tuple(mesh_axis_names)} does not have")
    placements: List[Any] = []
    for name in mesh_axis_names:
        dims = [dim for dim, axis in enumerate(axes) if axis == name]
        if len(dims) > 1:
            raise InvalidArgumentError(f"keras_dtensor_mixfix: layout axes {tuple(axes)} use mesh axis {name!r} "
                                       f"for tensor dims {dims}; a mesh axis can shard one tensor dim")
        trivial = mesh_shape is not None and mesh_shape[len(placements)] == 1
        placements.append(Shard(dims[0]) if dims and not trivial else Replicate())
    return tuple(placements)


def fit_placements(shape: Sequence[int], mesh: Any, placements: Sequence[Any], what: str) -> Tuple[Any, ...]:
    """Replicate tensor dims too small to give every rank of their mesh axis a piece (with a warning)."""
    from torch.distributed.tensor import Replicate, Shard

    fitted = []
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard) and shape[placement.dim] < mesh.size(mesh_dim):
            log.warning("keras_dtensor_mixfix: %s: dim %d of shape %s is smaller than mesh axis %r (%d ranks); "
                        "it is replicated instead of sharded", what, placement.dim, tuple(shape),
                        (mesh.mesh_dim_names or ("?",) * mesh.ndim)[mesh_dim], mesh.size(mesh_dim))
            fitted.append(Replicate())
        else:
            fitted.append(placement)
    return tuple(fitted)


def is_symbolic(tensor: torch.Tensor) -> bool:
    """A meta tensor, or a fake or functional one of a trace (the torch boundary's ``is_traced``), not a DTensor:
    it holds no values to lay out."""
    from torch.distributed.tensor import DTensor

    from ..._torch.api import is_traced  # imports DTensor's internals: not at the package's import

    return not isinstance(tensor, DTensor) and (tensor.is_meta or is_traced(tensor))


def relayout(tensor: Any, layout: TorchLayout) -> Any:
    """``tensor`` with ``layout`` (differentiably); non-tensors and symbolic tensors pass unchanged.

    A DTensor is redistributed; a plain tensor is taken as the same whole value on every rank.
    """
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(tensor, torch.Tensor) or is_symbolic(tensor):
        return tensor
    mesh, placements = layout
    if isinstance(tensor, DTensor):
        if tensor.device_mesh == mesh and tuple(tensor.placements) == tuple(placements):
            return tensor
        return tensor.redistribute(mesh, placements)
    # A plain tensor is the same whole value on every rank: slice locally, differentiably.
    replicated = DTensor.from_local(tensor, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, placements)

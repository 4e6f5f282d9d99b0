"""What is sharded: every variable of a model (optimizer slots included) with its layout and this rank's bytes.

:func:`sharding_report` reads each variable's value on this rank (a DTensor's placements and local piece; a plain
tensor is whole) and makes no collective, so any rank may call it alone. :func:`layout_map_coverage` compares a
``ModelParallel`` layout map with the variables of a model: the keys that match no variable (as the running Keras
matches them: whole paths with ``re.fullmatch`` since 3.15, so ``"d1/kernel"`` misses ``"sequential/d1/kernel"``;
``re.search`` before) and whether anything is sharded at all. The integration warns with it once per model step
function (``data.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import weakref
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from . import whole_weights

log = logging.getLogger("keras_dtensor_mixfix")


@dataclasses.dataclass(frozen=True)
class VariableSharding:
    """One variable on this rank.

    Attributes:
        path: the Keras path (``sequential/d1/kernel``; an optimizer slot's path names its optimizer).
        role: ``"model"`` or ``"optimizer"``.
        axes: per dim of the variable, the mesh axes it is split over (``()``: whole along that dim).
        placements: the DTensor placements as text, or ``"plain"`` for a tensor that is not a DTensor.
        global_shape: the variable's shape.
        local_shape: the shape of this rank's piece.
        dtype: the dtype's name.
        local_bytes: the bytes of this rank's piece.
        global_bytes: the bytes of the whole variable (what one process holds).
    """

    path: str
    role: str
    axes: Tuple[Tuple[str, ...], ...]
    placements: str
    global_shape: Tuple[int, ...]
    local_shape: Tuple[int, ...]
    dtype: str
    local_bytes: int
    global_bytes: int

    @property
    def sharded(self) -> bool:
        """Whether this rank holds less than the whole variable."""
        return any(self.axes)


@dataclasses.dataclass(frozen=True)
class ShardingReport:
    """Every variable of a model on this rank, and the totals beside one process's.

    ``str(report)`` is a table: one row per variable, then the totals.
    """

    variables: Tuple[VariableSharding, ...]
    rank: int
    world_size: int

    @property
    def bytes_on_this_rank(self) -> int:
        """What this rank holds of every variable together."""
        return sum(v.local_bytes for v in self.variables)

    @property
    def bytes_in_one_process(self) -> int:
        """What one process would hold: every variable whole."""
        return sum(v.global_bytes for v in self.variables)

    @property
    def sharded_count(self) -> int:
        """How many variables this rank holds only a piece of."""
        return sum(v.sharded for v in self.variables)

    def __str__(self) -> str:
        header = ("path", "role", "split over", "global shape", "local shape", "dtype", "here")
        rows: List[Tuple[str, ...]] = [header]
        for v in self.variables:
            split = ", ".join("/".join(axes) if axes else "-" for axes in v.axes) or "-"
            rows.append((v.path, v.role, f"({split})", "x".join(map(str, v.global_shape)) or "()",
                         "x".join(map(str, v.local_shape)) or "()", v.dtype, _size(v.local_bytes)))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
        ratio = self.bytes_on_this_rank / self.bytes_in_one_process if self.bytes_in_one_process else 1.0
        lines.append(f"rank {self.rank} of {self.world_size}: {len(self.variables)} variables, {self.sharded_count} "
                     f"sharded; {_size(self.bytes_on_this_rank)} here, {_size(self.bytes_in_one_process)} in one "
                     f"process ({ratio:.0%})")
        return "\n".join(lines)


def _size(count: int) -> str:
    """``count`` bytes in the largest binary unit that keeps a whole part: ``"512 B"``, ``"1.5 KiB"``, ``"2.0 GiB"``."""
    value, unit = float(count), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


def sharding_report(model: Any) -> ShardingReport:
    """Every variable of ``model`` (and of its optimizer, once built) on this rank; no collective."""
    import torch.distributed as dist

    rows = [_row(variable, "model") for variable in _unique(model.variables)]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        rows += [_row(variable, "optimizer") for variable in _unique(optimizer.variables)]
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return ShardingReport(tuple(rows), rank, world_size)


def _unique(variables: Iterable[Any]) -> List[Any]:
    seen: Set[int] = set()
    kept = []
    for variable in variables:
        if id(variable) not in seen:
            seen.add(id(variable))
            kept.append(variable)
    return kept


def _row(variable: Any, role: str) -> VariableSharding:
    import torch
    from torch.distributed.tensor import DTensor, Shard

    value = getattr(variable, "value", variable)
    global_shape = tuple(int(d) for d in variable.shape)
    if isinstance(value, DTensor):
        local = value.to_local()
        axes: List[List[str]] = [[] for _ in global_shape]
        names = value.device_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(value.device_mesh.ndim))
        for mesh_dim, placement in enumerate(value.placements):
            if isinstance(placement, Shard) and value.device_mesh.size(mesh_dim) > 1:
                axes[placement.dim % max(len(global_shape), 1)].append(names[mesh_dim])
        placements = str(tuple(value.placements))
        local_shape = tuple(int(d) for d in local.shape)
        itemsize = local.element_size()
    else:
        axes = [[] for _ in global_shape]
        placements = "plain"
        local_shape = global_shape
        itemsize = value.element_size() if isinstance(value, torch.Tensor) else whole_weights.itemsize(variable)
    return VariableSharding(
        path=str(variable.path), role=role, axes=tuple(tuple(a) for a in axes), placements=placements,
        global_shape=global_shape, local_shape=local_shape, dtype=str(variable.dtype),
        local_bytes=math.prod(local_shape) * itemsize, global_bytes=math.prod(global_shape) * itemsize)


@dataclasses.dataclass(frozen=True)
class LayoutMapCoverage:
    """How a layout map meets a model's variables.

    Attributes:
        unmatched: each key that matches no variable path (``re.fullmatch``), with the paths it matches anywhere
            inside (``re.search``): what a ``.*`` prefix would have caught.
        sharded_paths: the variables the map splits along some mesh axis of more than one device.
    """

    unmatched: Tuple[Tuple[str, Tuple[str, ...]], ...]
    sharded_paths: Tuple[str, ...]


def layout_map_coverage(layout_map: Any, paths: Iterable[str], mesh_shape: Optional[dict] = None) -> LayoutMapCoverage:
    """Which keys of ``layout_map`` match none of ``paths``, and which paths the map splits.

    ``mesh_shape``: axis name -> size; an axis of size 1 splits nothing (None: every named axis counts).
    """
    paths = list(paths)
    unmatched = []
    sharded = []
    for key in list(layout_map):
        probe = _map_of_one_key(layout_map, key)
        if not any(_layout_for(probe, path) is not None for path in paths):
            pattern = re.compile(key)
            unmatched.append((key, tuple(path for path in paths if pattern.search(path))))
    for path in paths:
        layout = _layout_for(layout_map, path)
        axes = getattr(layout, "axes", layout) if layout is not None else None
        if axes and any(axis is not None and (mesh_shape is None or mesh_shape.get(axis, 2) > 1) for axis in axes):
            sharded.append(path)
    return LayoutMapCoverage(tuple(unmatched), tuple(sharded))


def _map_of_one_key(layout_map: Any, key: str) -> Any:
    """A layout map of ``key`` alone: what it matches is what the running Keras matches (``re.fullmatch`` since 3.15,
    ``re.search`` before)."""
    probe = type(layout_map)(layout_map.device_mesh)
    probe[key] = layout_map[key]  # an exact key is looked up as it is
    return probe


def _layout_for(layout_map: Any, path: str) -> Any:
    try:
        return layout_map[path]
    except ValueError:  # several keys match: Keras raises when it lays the variable out, not here
        return None


_warned: Dict[int, Tuple[Any, Set[str]]] = {}
"""Per layout map (by id, with a weak reference to tell a new map at a reused id; a LayoutMap is unhashable), the
keys already warned about ("" for "splits nothing")."""


def warn_about_coverage(model: Any, distribution: Any) -> None:
    """Warn, once per layout map and key, about keys of ``distribution``'s layout map that match no variable of
    ``model``, and once per layout map when it splits no variable of ``model`` at all."""
    from ..boundary import keras_private

    layout_map = keras_private.layout_map_of(distribution)
    if layout_map is None or not list(layout_map):
        return
    paths = [str(v.path) for v in _unique(model.variables)]
    if not paths:
        return
    mesh = distribution.device_mesh
    coverage = layout_map_coverage(layout_map, paths, dict(zip(mesh.axis_names, mesh.shape)))
    entry = _warned.get(id(layout_map))
    if entry is None or entry[0]() is not layout_map:
        entry = _warned[id(layout_map)] = (weakref.ref(layout_map), set())
    warned = entry[1]
    for key, near in coverage.unmatched:
        if key in warned:
            continue
        warned.add(key)
        hint = (f"; it is found inside {len(near)} path(s), e.g. {near[0]!r}: the key {'.*' + key!r} would match "
                "them" if near else "")
        log.warning("keras_dtensor_mixfix: layout map key %r matches no variable of model %r (Keras matches a key "
                    "to a variable's whole path with re.fullmatch since Keras 3.15, re.search before)%s", key,
                    model.name, hint)
    if not coverage.sharded_paths and "" not in warned:
        warned.add("")
        log.warning("keras_dtensor_mixfix: the layout map splits no variable of model %r, so every rank holds the "
                    "whole model (as without a distribution); keras_dtensor_mixfix.layouts.sharding_report(model) "
                    "lists each variable's layout", model.name)

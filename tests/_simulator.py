"""The tests' one entry to torch's rank simulator: the ``fake`` process group and ``LocalTensorMode(N)`` (private torch
APIs, imported here only; a torch without them skips the simulated layer with the reason).

``simulated_mesh(shape)`` starts a fake process group of ``prod(shape)`` ranks, enters ``LocalTensorMode`` and builds
the mesh. Under the mode, DeviceMesh's coordinate of "this rank" is one symbolic integer per mesh dim holding every
simulated rank's value; torch computes it once per mesh and mode with a loop that re-runs the same mesh-layout
computation for every rank under the mode (O(ranks²) dispatches: 64 s for a 512-rank mesh here, on torch 2.11 to
2.15). ``fast_coordinates`` computes the same coordinates with the layout computation run once, outside the mode, and
is installed for the simulated tests; ``test_simulator.py`` checks that it equals torch's own on every mesh shape
small enough for torch's to be quick.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
import torch.distributed as dist

local_tensor = pytest.importorskip("torch.distributed._local_tensor",
                                   reason="torch's rank simulator (LocalTensorMode) is not in this torch")
fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg",
                              reason="torch's fake process group is not in this torch")

LocalTensor = local_tensor.LocalTensor
LocalTensorMode = local_tensor.LocalTensorMode
torch_coordinates = local_tensor._LocalDeviceMesh.get_coordinate
"""torch's own ``get_coordinate`` under the mode (a staticmethod taking the mesh)."""


def _coordinates_by_rank(mesh: Any, ranks: Any) -> List[Dict[int, int]]:
    """For each mesh dim, every simulated rank's coordinate on ``mesh``: torch's rule (each rank's position in the
    mesh layout's rank tensor, past its leading dim of sub-meshes), the layout computed once, outside the mode."""
    with local_tensor.maybe_disable_local_tensor_mode():
        rank_tensor = mesh._layout.remap_to_tensor(mesh._rank_map.clone())
        positions = torch.nonzero(torch.ones_like(rank_tensor, dtype=torch.bool)).tolist()
        values = rank_tensor.flatten().tolist()
    coordinates: List[Dict[int, int]] = [{} for _ in range(mesh.ndim)]
    seen: Dict[int, int] = {}
    for position, rank in zip(positions, values):
        seen[rank] = seen.get(rank, 0) + 1
        if rank in ranks:
            for dim, coordinate in enumerate(position[1:]):
                coordinates[dim][rank] = coordinate
    missing = [rank for rank in ranks if seen.get(rank) != 1]
    assert not missing, f"simulated ranks not exactly once in the mesh layout: {missing[:8]}"
    return coordinates


def fast_coordinates(mesh: Any) -> List[torch.SymInt]:
    """``DeviceMesh.get_coordinate`` under ``LocalTensorMode``: the same symbolic integers as torch's, cached per mesh
    on the mode (the cache holds the mesh, so that its id is not reused)."""
    mode = local_tensor.enabled_local_tensor_mode()
    assert mode is not None, "fast_coordinates outside LocalTensorMode"
    cache = mode.__dict__.setdefault("_tests_fast_coordinates", {})
    found = cache.get(id(mesh))
    if found is None:
        found = (mesh, [torch.SymInt(local_tensor.LocalIntNode(by_rank))
                        for by_rank in _coordinates_by_rank(mesh, mode.ranks)])
        cache[id(mesh)] = found
    return found[1]


def coordinate_values(coordinates: List[Any], ranks: Any) -> List[Dict[int, int]]:
    """Each rank's value of symbolic coordinates (to compare two computations of them): a coordinate the same on every
    rank is a constant (torch makes one of a per-rank integer whose values are all equal)."""
    def by_rank(value: Any) -> Dict[int, int]:
        node = value.node if isinstance(value, torch.SymInt) else None
        if node is not None and hasattr(node, "_local_ints"):
            return dict(node._local_ints)
        constant = node.constant_int() if node is not None else int(value)
        return {rank: constant for rank in ranks}
    return [by_rank(value) for value in coordinates]


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks in this process (this process is rank 0 of it)."""
    assert not dist.is_initialized(), "a process group exists in the pytest process"
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def simulated_mesh(shape: Tuple[int, ...], device: str = "cpu", *, fast: bool = True) -> Iterator[Any]:
    """A ``device`` mesh of ``shape`` under ``LocalTensorMode(prod(shape))``, inside a fake process group that already
    exists (``fake_process_group``); ``fast``: the coordinates by ``fast_coordinates``."""
    with contextlib.ExitStack() as stack:
        if fast:
            patcher = pytest.MonkeyPatch()
            stack.callback(patcher.undo)
            patcher.setattr(local_tensor._LocalDeviceMesh, "get_coordinate", staticmethod(fast_coordinates))
        stack.enter_context(LocalTensorMode(math.prod(shape)))
        yield torch.distributed.device_mesh.init_device_mesh(device, shape)

"""Helpers used inside rank functions (imported by the worker processes)."""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from keras_dtensor_mixfix.testing import mesh


def mesh_for(world_size: int):
    """1-D mesh on 2 ranks, 2-D ("dp", "tp") mesh on 4."""
    if world_size == 4:
        return mesh((2, 2), ("dp", "tp"))
    return mesh()


def placements_for(device_mesh, dim: int) -> tuple:
    """Shard ``dim`` on the last mesh dim, Replicate elsewhere (column/row sharding)."""
    return (Replicate(),) * (device_mesh.ndim - 1) + (Shard(dim),)


def shard(tensor: torch.Tensor, device_mesh, placements: Sequence, requires_grad: bool = False) -> DTensor:
    out = distribute_tensor(tensor.detach().clone(), device_mesh, list(placements))
    return out.requires_grad_(requires_grad) if requires_grad else out


def full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(full(actual), expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def plain_grad(tensor: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert tensor.grad is not None, f"{what}: no gradient"
    assert type(tensor.grad) is torch.Tensor, (f"{what}: gradient is {type(tensor.grad).__name__}, "
                                               "expected a plain Tensor")
    close(tensor.grad, expected, what)


def rank() -> int:
    return dist.get_rank()


@contextlib.contextmanager
def forced_defect(name: str, forced: bool = True):
    """With ``forced``, the running torch is taken to have the upstream-defect table's entry ``name`` (both readers of
    the table see it; the engine's per-op caches are cleared around it)."""
    from keras_dtensor_mixfix._engine import corrections
    from keras_dtensor_mixfix._engine.caches import CACHES
    from keras_dtensor_mixfix._torch import versions

    if not forced:
        yield
        return
    original = versions.has_defect

    def has_defect(defect, version):
        return defect == name or original(defect, version)

    versions.has_defect = corrections.has_defect = has_defect
    CACHES.clear()
    try:
        yield
    finally:
        versions.has_defect = corrections.has_defect = original
        CACHES.clear()

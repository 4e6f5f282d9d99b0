"""The simulated layer's harness: its fast mesh coordinates equal torch's own, so a simulated result is torch's."""

from __future__ import annotations

import math

import pytest
import torch

import _simulator


@pytest.mark.parametrize("shape", [(8,), (2, 4), (4, 4, 4), (3, 5), (1, 8), (2, 1, 4)],
                         ids=lambda shape: "x".join(map(str, shape)))
def test_fast_coordinates_equal_torchs_on_every_mesh_and_sub_mesh(shape):
    size = math.prod(shape)
    names = tuple(f"d{index}" for index in range(len(shape)))
    with _simulator.fake_process_group(size), _simulator.LocalTensorMode(size) as mode:
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", shape, mesh_dim_names=names)
        meshes = [mesh] + [mesh[name] for name in names]
        if len(names) > 1:
            meshes.append(mesh[names[-2:]])
        for each in meshes:
            torchs = _simulator.coordinate_values(_simulator.torch_coordinates(each), mode.ranks)
            ours = _simulator.coordinate_values(_simulator.fast_coordinates(each), mode.ranks)
            assert ours == torchs, f"mesh {each}"
            assert all(len(by_rank) == size for by_rank in ours)

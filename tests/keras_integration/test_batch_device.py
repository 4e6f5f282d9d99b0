"""Batches land on the rank's own device: the mesh's device type, on CUDA the current device (LOCAL_RANK's).

No GPU here. ``batch_device`` is tested with a fake mesh whose ``device_type`` is ``"cuda"`` and a faked
``torch.cuda.current_device`` (standing for a rank whose LOCAL_RANK device is cuda:3). The copy of a batch
on another device is tested on 2 gloo ranks by asking :func:`local_batch_on` for the CPU itself: the same
DTensor as ``distribute_tensor`` gives, made from one ``non_blocking`` copy of this rank's slice only (``Tensor.to``
recorded), where ``distribute_tensor`` would copy the whole batch, blocking.
"""

from __future__ import annotations

import types

import torch

from keras_dtensor_mixfix.testing import run_on_ranks


def test_a_batch_goes_to_the_mesh_device_type_and_on_cuda_to_the_current_device(monkeypatch):
    from keras_dtensor_mixfix._keras.backend.distribution_lib import batch_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert batch_device(types.SimpleNamespace(device_type="cuda")) == torch.device("cuda", 3)
    assert batch_device(types.SimpleNamespace(device_type="cpu")) == torch.device("cpu")


def _sliced_then_copied(shape, names, placements_of):
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from keras_dtensor_mixfix._keras.backend.distribution_lib import distribute_data_input, local_batch_on
    from keras_dtensor_mixfix.testing import mesh

    m = mesh(shape, names)
    placements = tuple(eval(text, {"Shard": Shard, "Replicate": Replicate}) for text in placements_of)
    torch.manual_seed(0)
    batch = torch.randn(8, 3)
    copies = []
    real_to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        copies.append((tuple(self.shape), kwargs.get("non_blocking")))
        return real_to(self, *args, **kwargs)

    torch.Tensor.to = recording_to
    try:
        moved = local_batch_on(batch, torch.device("cpu"), m, placements, is_global=True)
        own = local_batch_on(batch[:2], torch.device("cpu"), m, placements, is_global=False)
    finally:
        torch.Tensor.to = real_to
    expected = distribute_tensor(batch, m, list(placements), src_data_rank=None)
    same_device = distribute_data_input(batch, (m, placements), is_global=True)  # already on the mesh's device
    return {
        "equal": isinstance(moved, DTensor) and moved.placements == expected.placements
        and moved.shape == expected.shape and moved.stride() == expected.stride()
        and torch.equal(moved._local_tensor, expected._local_tensor),
        "copies": copies,
        "own_local_shape": tuple(own._local_tensor.shape),
        "same_device_equal": torch.equal(same_device._local_tensor, expected._local_tensor),
    }


def test_a_global_batch_is_sliced_first_and_only_the_slice_is_copied_once_non_blocking():
    for shape, names, placements, local_rows in (((2,), ("batch",), ("Shard(0)",), 4),
                                                 ((2, 2), ("batch", "model"), ("Shard(0)", "Replicate()"), 4)):
        for out in run_on_ranks(_sliced_then_copied, shape, names, placements, world_size=len(shape) * 2):
            assert out["equal"] and out["same_device_equal"], out
            # this rank's slice once, then the per-process batch once: both non_blocking, never the whole batch
            assert out["copies"] == [((local_rows, 3), True), ((2, 3), True)], out["copies"]
            assert out["own_local_shape"] == (2, 3)

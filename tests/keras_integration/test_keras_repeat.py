"""Keras' ``repeat`` of a DTensor by a whole number along an axis, on every supported Keras.

Grouped-query attention (keras_hub's Llama, Qwen and their MoE variants) repeats the key/value heads with
``ops.repeat(key, groups, axis=2)``; with the batch split over ranks, Keras 3.12 to 3.14's
``repeat_interleave`` failed in the backward, and the integration computes it as Keras 3.15 does
(``_keras/ops/repeat.py``). Values and gradients against one process, on (2,) and (2, 2) meshes, and on plain
tensors Keras' own ``repeat``, bit for bit.
"""

from __future__ import annotations

import math

import pytest

from keras_dtensor_mixfix.testing import run_on_ranks

SHAPE = (4, 8, 2, 4)  # batch, length, key/value heads, head depth


def repeat_split_keys(keys, placements, mesh_shape):
    """``keras.ops.repeat(keys, 2, axis=2)`` and ``axis=-1`` of keys laid out as ``placements``; a weighted sum of
    both backpropagated. Returns the global outputs and gradient."""
    import keras
    import torch
    from torch.distributed.tensor import distribute_tensor

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix.testing import mesh

    assert keras_integration.install()
    try:
        device_mesh = mesh(mesh_shape, ("batch", "model")[-len(mesh_shape):])
        leaf = torch.nn.Parameter(distribute_tensor(keys, device_mesh, placements))
        outputs = [keras.ops.repeat(leaf, 2, axis=2), keras.ops.repeat(leaf, 3, axis=-1)]
        total = sum((out * out * _weights(out.shape)).sum() for out in outputs)
        total.backward()
        return [out.detach().full_tensor() for out in outputs], leaf.grad.full_tensor()
    finally:
        keras_integration.uninstall()


def _weights(shape):
    import torch

    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) / math.prod(shape)


@pytest.mark.parametrize("mesh_shape, layout", [((2,), "batch"), ((2, 2), "batch, heads"), ((2, 2), "batch, depth")])
def test_repeat_of_split_keys_equals_single_process(mesh_shape, layout):
    import torch
    from torch.distributed.tensor import Replicate, Shard

    placements = {"batch": [Shard(0)], "batch, heads": [Shard(0), Shard(2)],
                  "batch, depth": [Shard(0), Shard(3)]}[layout]
    torch.manual_seed(0)
    keys = torch.randn(SHAPE)
    leaf = keys.clone().requires_grad_()
    expected = [torch.repeat_interleave(leaf, 2, dim=2), torch.repeat_interleave(leaf, 3, dim=-1)]
    sum((out * out * _weights(out.shape)).sum() for out in expected).backward()
    assert Replicate() not in placements
    for outputs, gradient in run_on_ranks(repeat_split_keys, keys, placements, mesh_shape,
                                          world_size=math.prod(mesh_shape), timeout=300):
        for got, want in zip(outputs, expected):
            torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)
        torch.testing.assert_close(gradient, leaf.grad)


def test_repeat_of_plain_tensors_is_keras_own():
    import numpy as np
    import torch
    from keras import ops

    from keras_dtensor_mixfix import keras_integration

    x = torch.randn(SHAPE)

    def run():
        return [ops.convert_to_numpy(result) for result in (
            ops.repeat(x, 2, axis=2), ops.repeat(x, 3), ops.repeat(x, 2, axis=-1),
            ops.repeat(np.arange(6.0).reshape(2, 3), 2, axis=0))]

    keras_integration.uninstall()
    before = run()
    assert keras_integration.install()
    try:
        during = run()
    finally:
        keras_integration.uninstall()
    for got, want in zip(during, before):
        np.testing.assert_array_equal(got, want)

"""Keras' reductions of DTensors (argmax over a dim split on a 2-D mesh, compiled argmax over split logits,
compiled max and min), values and gradients against one process."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _keras_ops import VOCAB
from _keras_releases import one_graph

from keras_dtensor_mixfix.testing import run_on_ranks


def arg_reductions_2d(logits):
    """Keras' argmax and argmin of logits split by rows over "batch" (one row per rank) and by vocabulary over
    "model" on a (2, 2) mesh (torch's own fails: repros/torch_argmax_2d.py)."""
    import keras
    from torch.distributed.tensor import Shard, distribute_tensor

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix.testing import mesh

    assert keras_integration.install()
    try:
        split = distribute_tensor(logits, mesh((2, 2), ("batch", "model")), [Shard(0), Shard(2)])
        return {name: [getattr(keras.ops, name)(split, axis=axis).full_tensor() for axis in (-1, 1)]
                for name in ("argmax", "argmin")}
    finally:
        keras_integration.uninstall()


def test_argmax_over_a_dim_split_on_a_2d_mesh_equals_single_process():
    import torch

    torch.manual_seed(0)
    logits = torch.randn(2, 8, VOCAB)
    for result in run_on_ranks(arg_reductions_2d, logits, world_size=4, timeout=300):
        for name, values in result.items():
            for axis, value in zip((-1, 1), values):
                torch.testing.assert_close(value, getattr(torch, name)(logits, dim=axis).to(value.dtype),
                                           msg=lambda m: f"{name} axis {axis}: {m}")


def compiled_arg_reductions(logits, mesh_shape, layout):
    """Keras' argmax and argmin over vocabulary-split logits inside ``torch.compile(fullgraph=True)``
    (a metric's accuracy in a compiled step): every axis, with and without ``keepdims``."""
    import keras
    import torch
    from torch.distributed.tensor import distribute_tensor

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix.testing import mesh

    assert keras_integration.install()
    try:
        split = distribute_tensor(logits, mesh(mesh_shape, ("batch", "model")), layout)
        torch._dynamo.reset()

        def reductions(x):
            return {(name, axis, keepdims): getattr(keras.ops, name)(x, axis=axis, keepdims=keepdims)
                    for name in ("argmax", "argmin") for axis in (-1, 1) for keepdims in (False, True)}

        results = torch.compile(reductions, backend="aot_eager", fullgraph=True, dynamic=False)(split)
        return {key: (value.full_tensor(), str(value.dtype)) for key, value in results.items()}
    finally:
        keras_integration.uninstall()


@one_graph
@pytest.mark.parametrize("mesh_shape", [(1, 2), (2, 2)])
def test_compiled_argmax_over_vocabulary_split_logits_equals_single_process(mesh_shape):
    """Compiled, the winner of each piece is gathered instead of DTensor's handler, whose data-dependent read
    of the piece's offset breaks the graph (``fullgraph=True`` fails on it); ties go to the first index, NaN
    wins, an uneven last piece counts."""
    import torch
    from torch.distributed.tensor import Replicate, Shard

    torch.manual_seed(0)
    logits = torch.randn(2, 8, VOCAB - 1)
    logits[0, 0, [3, 20]] = 9.0  # a tie across the two vocabulary pieces: the first index wins
    logits[0, 1, [5, 25]] = -9.0
    logits[1, 2, 22] = float("nan")
    layout = [Replicate(), Shard(2)] if mesh_shape == (1, 2) else [Shard(0), Shard(2)]
    for result in run_on_ranks(compiled_arg_reductions, logits, mesh_shape, layout,
                               world_size=math.prod(mesh_shape), timeout=300):
        for (name, axis, keepdims), (value, dtype) in result.items():
            expected = getattr(torch, name)(logits, dim=axis, keepdim=keepdims)
            assert dtype == "torch.int32", (name, axis, keepdims)
            torch.testing.assert_close(value, expected.to(torch.int32), msg=lambda m: f"{name} {axis} {keepdims}: {m}")


def compiled_extremes(x, mesh_shape, layout):
    """Keras' ``max`` and ``min`` of a split DTensor inside ``torch.compile(fullgraph=True)``, every axis and over
    all, with and without ``keepdims``; and the gradient of a loss that uses one of them with a gradient and
    another without (an attention sink's row maximum, subtracted for stability)."""
    import keras
    import torch
    from torch.distributed.tensor import distribute_tensor

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix.testing import mesh

    assert keras_integration.install()
    try:
        split = distribute_tensor(x, mesh(mesh_shape, ("batch", "model")), layout).requires_grad_()
        torch._dynamo.reset()

        def extremes(x):
            values = {(name, axis, keepdims): getattr(keras.ops, name)(x, axis=axis, keepdims=keepdims).detach()
                      for name in ("max", "min") for axis in (None, 0, -1) for keepdims in (False, True)}
            stable = x - keras.ops.stop_gradient(keras.ops.max(x, axis=-1, keepdims=True))
            loss = keras.ops.sum(keras.ops.exp(stable)) + keras.ops.sum(keras.ops.min(x, axis=-1) ** 2)
            return values, loss

        values, loss = torch.compile(extremes, backend="aot_eager", fullgraph=True, dynamic=False)(split)
        loss.backward()
        return ({key: value.full_tensor() for key, value in values.items()}, loss.full_tensor().detach(),
                split.grad.full_tensor())
    finally:
        keras_integration.uninstall()


@one_graph
@pytest.mark.parametrize("mesh_shape", [(1, 2), (2, 2)])
def test_compiled_max_and_min_of_a_split_dtensor_equal_single_process(mesh_shape):
    """Compiled, Keras' ``max``/``min`` of a DTensor trace in one graph (Keras 3.12-3.15's break it reading
    ``result.values``, and keras_hub GPT-OSS's row maximum then reached torch's backward as a graph output with no
    gradient: repros/torch_compile_dtensor_output_without_gradient.py); values and gradient equal one process,
    a tie's gradient split evenly."""
    import keras
    import torch
    from torch.distributed.tensor import Replicate, Shard

    torch.manual_seed(0)
    x = torch.randn(4, 3, VOCAB - 1)
    x[0, 0, [3, 20]] = -9.0  # a tie of minima across the two vocabulary pieces
    layout = [Replicate(), Shard(2)] if mesh_shape == (1, 2) else [Shard(0), Shard(2)]
    whole = x.clone().requires_grad_()
    expected = {(name, axis, keepdims): keras.ops.convert_to_numpy(getattr(keras.ops, name)(
        x, axis=axis, keepdims=keepdims)) for name in ("max", "min") for axis in (None, 0, -1)
        for keepdims in (False, True)}
    loss = ((whole - whole.amax(-1, keepdim=True).detach()).exp().sum() + (whole.amin(-1) ** 2).sum())
    loss.backward()
    for values, got_loss, grad in run_on_ranks(compiled_extremes, x, mesh_shape, layout,
                                               world_size=math.prod(mesh_shape), timeout=300):
        for key, value in values.items():
            np.testing.assert_allclose(value.numpy(), expected[key], err_msg=str(key))
        torch.testing.assert_close(got_loss, loss.detach())
        torch.testing.assert_close(grad, whole.grad)

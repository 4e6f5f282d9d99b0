"""Keras' tensor ops of DTensors (one_hot compiled, cast of a NumPy value compiled, stack, pad, cumsum, not_equal),
as this torch installs their workarounds and as on torch 2.11, against one process."""

from __future__ import annotations

import numpy as np
import pytest
from _keras_ops import as_installed_and_as_on_2_11, installed, placements_of
from _keras_releases import one_graph

from keras_dtensor_mixfix.testing import run_on_ranks


def compiled_one_hot(choices, tracer="dynamo"):
    """Keras' ``one_hot`` of replicated and row-split DTensor ids inside ``torch.compile(fullgraph=True)`` (a
    MoE router's expert choices), the class axis last and first; ``tracer="aot"``: traced by AOTAutograd alone, as
    the block tracer traces (``KERAS_DTENSOR_MIXFIX_BLOCK_TRACER=aot``)."""
    import keras
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix.testing import mesh

    assert keras_integration.install()
    try:
        device_mesh = mesh((2,), ("model",))
        torch._dynamo.reset()
        def both(x):
            return [keras.ops.one_hot(x, 5), keras.ops.one_hot(x, 5, axis=0)]

        if tracer == "aot":
            from functorch.compile import aot_function, nop

            def encode(x):  # one trace per input: the two placements are two signatures
                return aot_function(both, fw_compiler=nop)(x)
        else:
            encode = torch.compile(both, backend="aot_eager", fullgraph=True, dynamic=False)
        return {name: [(value.full_tensor(), tuple(value.placements)) for value in
                       encode(distribute_tensor(choices, device_mesh, [placement]))]
                for name, placement in (("replicated", Replicate()), ("split", Shard(0)))}
    finally:
        keras_integration.uninstall()


@one_graph
@pytest.mark.parametrize("tracer", ["dynamo", "aot"])
def test_compiled_one_hot_of_a_dtensor_equals_single_process(tracer):
    """Compiled, ``one_hot`` of a DTensor encodes each rank's piece: torch's own meets a range check DTensor has no
    strategy for (repros/torch_dtensor_one_hot_compiled.py), and the graph break it made in keras_hub's Qwen MoE
    router left a split graph whose view of its input AOTAutograd could not replay. Traced by AOTAutograd alone the
    same (keras_hub's Mixtral and Qwen3 MoE experts fell back to torch.compile from the block tracer for it)."""
    import keras
    import torch
    from torch.distributed.tensor import Replicate, Shard

    choices = torch.tensor([[0, 3], [2, 1], [4, 4]])
    expected = [keras.ops.convert_to_numpy(keras.ops.one_hot(choices, 5, axis=axis)) for axis in (-1, 0)]
    for result in run_on_ranks(compiled_one_hot, choices, tracer, world_size=2, timeout=300):
        for placement, values in result.items():
            for (value, placements), want, axis in zip(values, expected, (-1, 0)):
                np.testing.assert_array_equal(value.numpy(), want, err_msg=f"{placement} axis {axis}")
            # row-split ids stay row-split: the rows axis moves behind a leading class axis
            wanted = [(Shard(0),), (Shard(1),)] if placement == "split" else [(Replicate(),)] * 2
            assert [p for _, p in values] == wanted, placement


@one_graph
def test_cast_of_a_numpy_value_compiles_into_one_graph():
    """keras_hub Gemma's ``q *= ops.cast(1 / np.sqrt(head_dim), q.dtype)``: Keras' cast of a NumPy value broke
    TorchDynamo's graph (it reads the traced array's dtype), and the break left ``q`` a graph input modified in
    place, which torch's AOTAutograd gets wrong for a DTensor (repros/torch_compile_mutated_dtensor_input.py).
    With the integration it traces in one graph, to the same value."""
    import torch
    from keras import ops

    from keras_dtensor_mixfix import keras_integration

    def normalized(q):
        q = q * 1
        q *= ops.cast(1 / np.sqrt(8), dtype=q.dtype)
        return q

    q = torch.randn(2, 3)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):  # Keras alone: the graph break
        torch.compile(normalized, backend="eager", fullgraph=True)(q)
    assert keras_integration.install()
    try:
        torch._dynamo.reset()
        compiled = torch.compile(normalized, backend="eager", fullgraph=True)(q)
    finally:
        keras_integration.uninstall()
    torch.testing.assert_close(compiled, normalized(q), rtol=0, atol=0)


def stack_of_split_halves(x, as_on_2_11):
    """keras_hub's rotary embedding's ``ops.stack((-x2, x1), axis=-2)`` of a DTensor split along its heads (dim 2),
    on this rank: the global value and the gradient of ``x``. ``as_on_2_11``: the integration installed as on torch
    2.11, whose DTensor places a negative stack axis wrongly (repros/torch_stack_negative_dim.py)."""
    import keras
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from keras_dtensor_mixfix.testing import mesh

    with installed("stack_negative_dim_misplaced", as_on_2_11):
        leaf = distribute_tensor(x, mesh((1, 2), ("batch", "model")), [Replicate(), Shard(2)]).requires_grad_()
        x1, x2 = keras.ops.split(leaf, 2, axis=-1)
        out = keras.ops.reshape(keras.ops.stack((-x2, x1), axis=-2), leaf.shape)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        return out.detach().full_tensor(), leaf.grad.full_tensor()


@pytest.mark.parametrize("as_on_2_11", [False, True], ids=["as-installed", "as-on-2.11"])
def test_stack_on_a_negative_axis_of_a_split_dtensor_equals_single_process(as_on_2_11):
    import keras
    import torch

    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 6)  # (batch, positions, heads, depth)
    reference = x.clone().requires_grad_()
    x1, x2 = keras.ops.split(reference, 2, axis=-1)
    out = keras.ops.reshape(keras.ops.stack((-x2, x1), axis=-2), reference.shape)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    for value, gradient in run_on_ranks(stack_of_split_halves, x, as_on_2_11, world_size=2, timeout=300):
        torch.testing.assert_close(value, out.detach())
        torch.testing.assert_close(gradient, reference.grad)


def pad_of_a_split_dtensor(x, placements, as_on_2_11):
    """Keras ``ops.pad`` of a DTensor on a (1, 2) mesh, padding dims 1 and 2 (keras_hub's Qwen3.5 pads its chunks),
    on this rank: the global value, the result's placements and the gradient of ``x``. ``as_on_2_11``: the
    integration installed as on torch 2.11, whose DTensor pads into a malformed result on a 2-D mesh
    (repros/torch_pad_2d_mesh.py)."""
    import keras
    import torch
    from torch.distributed.tensor import distribute_tensor

    from keras_dtensor_mixfix.testing import mesh

    with installed("pad_2d_mesh_one_placement", as_on_2_11):
        leaf = distribute_tensor(x, mesh((1, 2), ("batch", "model")), list(placements)).requires_grad_()
        out = keras.ops.pad(leaf, [[0, 0], [3, 0], [0, 2]])
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        return out.detach().full_tensor(), len(out.placements), leaf.grad.full_tensor()


@as_installed_and_as_on_2_11("pad_2d_mesh_one_placement",
                              "torch 2.11 pads into a malformed DTensor on a 2-D mesh (repros/torch_pad_2d_mesh.py)")
@pytest.mark.parametrize("split", ["R", 0, 1])  # whole, split along a dim not padded, along a padded one
def test_pad_of_a_split_dtensor_on_a_two_dimensional_mesh_equals_single_process(split, as_on_2_11):
    import keras
    import torch

    torch.manual_seed(0)
    x = torch.randn(4, 6, 8)
    reference = x.clone().requires_grad_()
    out = keras.ops.pad(reference, [[0, 0], [3, 0], [0, 2]])
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    for value, placements, gradient in run_on_ranks(pad_of_a_split_dtensor, x, placements_of(("R", split)), as_on_2_11,
                                                    world_size=2, timeout=300):
        torch.testing.assert_close(value, out.detach())
        assert placements == 2
        torch.testing.assert_close(gradient, reference.grad)


def cumsum_of_a_split_dtensor(x, placements, as_on_2_11):
    """Keras ``ops.cumsum`` along the last axis of a DTensor on a (1, 2) mesh, on this rank: the global value and
    the gradient of ``x``. ``as_on_2_11``: the integration installed as on torch 2.11, whose DTensor has no strategy
    for the flip in cumsum's backward (repros/torch_flip_no_strategy.py)."""
    import keras
    import torch
    from torch.distributed.tensor import distribute_tensor

    from keras_dtensor_mixfix.testing import mesh

    # (the negative axis is counted from the start on every release here)
    with installed("flip_without_strategy", as_on_2_11):
        leaf = distribute_tensor(x, mesh((1, 2), ("batch", "model")), list(placements)).requires_grad_()
        out = keras.ops.cumsum(leaf, axis=-1)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        return out.detach().full_tensor(), leaf.grad.full_tensor()


@as_installed_and_as_on_2_11("flip_without_strategy", "torch 2.11 has no strategy for the flip of cumsum's "
                              "backward (repros/torch_flip_no_strategy.py)")
@pytest.mark.parametrize("split", ["R", 0, 2])
def test_cumsum_of_a_split_dtensor_equals_single_process(split, as_on_2_11):
    import keras
    import torch

    torch.manual_seed(0)
    x = torch.randn(4, 3, 8)
    reference = x.clone().requires_grad_()
    out = keras.ops.cumsum(reference, axis=-1)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    for value, gradient in run_on_ranks(cumsum_of_a_split_dtensor, x, placements_of(("R", split)), as_on_2_11,
                                        world_size=2, timeout=300):
        torch.testing.assert_close(value, out.detach())
        torch.testing.assert_close(gradient, reference.grad)


def not_equal_of_split_ids(ids, as_on_2_11):
    """keras_hub's padding mask, ``ops.not_equal(token_ids, 0)``, of ids split by rows on 2 ranks: the global value.
    ``as_on_2_11``: the integration installed as on torch 2.11, whose DTensor has no strategy for ``ne.Tensor``
    (repros/torch_ne_tensor_no_strategy.py)."""
    import keras
    from torch.distributed.tensor import Shard, distribute_tensor

    from keras_dtensor_mixfix.testing import mesh

    with installed("ne_tensor_without_strategy", as_on_2_11):
        split = distribute_tensor(ids, mesh((2,), ("batch",)), [Shard(0)])
        return keras.ops.not_equal(split, 0).full_tensor()


@as_installed_and_as_on_2_11("ne_tensor_without_strategy",
                              "torch 2.11 has no strategy for ne.Tensor (repros/torch_ne_tensor_no_strategy.py)")
def test_not_equal_of_split_ids_equals_single_process(as_on_2_11):
    import torch

    ids = torch.tensor([[3, 0, 5, 0], [0, 7, 7, 1]])
    for value in run_on_ranks(not_equal_of_split_ids, ids, as_on_2_11, world_size=2, timeout=300):
        assert torch.equal(value, ids != 0)

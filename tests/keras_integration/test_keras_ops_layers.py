"""Keras' layer ops of DTensors (RMS normalization over a split axis, convolutions of split channels or
positions, activations whose gradient arrives transposed, reshapes DTensor cannot carry a split through), values and
gradients against one process."""

from __future__ import annotations

import pytest
from _keras_ops import installed, placements_of

from keras_dtensor_mixfix.testing import RankError, run_on_ranks


def rms_normalization_of_split_rows(x, scale, mesh_shape, x_placements):
    """``keras.ops.rms_normalization`` of a DTensor split along the normalized (last) axis, on this rank: the
    global value, the gradients of ``x`` and ``scale``, and the placements of the result."""
    import keras
    import torch
    from torch.distributed.tensor import Replicate, distribute_tensor

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix.testing import mesh

    assert keras_integration.install()
    try:
        device_mesh = mesh(mesh_shape, ("batch", "model"))
        x_leaf = distribute_tensor(x, device_mesh, list(x_placements)).requires_grad_()
        scale_leaf = distribute_tensor(scale, device_mesh, [Replicate(), Replicate()]).requires_grad_()
        out = keras.ops.rms_normalization(x_leaf, scale_leaf, axis=-1, epsilon=1e-6)
        (out * torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)).sum().backward()
        return dict(out=out.detach().full_tensor(), x_grad=x_leaf.grad.full_tensor(),
                    scale_grad=scale_leaf.grad.full_tensor())
    finally:
        keras_integration.uninstall()


@pytest.mark.parametrize("mesh_shape, x_placements", [
    ((1, 2), ("R", 2)),   # the hidden dim over "model"
    ((2, 2), (2, "R")),   # over "batch": keras_hub's 2-D maps leave the embedding's output so (SmolLM3's build call)
    ((2, 2), (0, 2)),     # the rows over "batch", the hidden dim over "model"
], ids=["1x2-hidden-over-model", "2x2-hidden-over-batch", "2x2-rows-and-hidden"])
def test_rms_normalization_of_rows_split_along_the_normalized_axis_equals_single_process(mesh_shape, x_placements):
    import torch

    torch.manual_seed(0)
    x, scale = torch.randn(4, 6, 8), torch.rand(8) + 0.5
    reference_x, reference_scale = x.clone().requires_grad_(), scale.clone().requires_grad_()
    out = torch.nn.functional.rms_norm(reference_x, (8,), reference_scale, 1e-6)
    (out * torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)).sum().backward()
    placements = placements_of(x_placements)
    world_size = mesh_shape[0] * mesh_shape[1]
    for result in run_on_ranks(rms_normalization_of_split_rows, x, scale, mesh_shape, placements,
                               world_size=world_size, timeout=300):
        torch.testing.assert_close(result["out"], out.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["x_grad"], reference_x.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["scale_grad"], reference_scale.grad, rtol=1e-5, atol=1e-6)


def convolution_of_split_channels(x, kernel, mesh_shape, x_placements, kernel_placements, as_on_2_11):
    """Keras ``ops.depthwise_conv`` and ``ops.conv`` (channels last) of a DTensor split along its channels or positions,
    on this rank: the global values and the gradients of ``x`` and the kernels. ``as_on_2_11``: the integration
    installed as on torch 2.11, whose DTensor convolution it cannot use (the convolution runs on local pieces)."""
    import keras
    import torch
    from torch.distributed.tensor import distribute_tensor

    from keras_dtensor_mixfix.testing import mesh

    with installed("conv_handler_refuses_unsplit", as_on_2_11):
        device_mesh = mesh(mesh_shape, ("batch", "model"))
        x_leaf = distribute_tensor(x, device_mesh, list(x_placements)).requires_grad_()
        depthwise = distribute_tensor(kernel, device_mesh, list(kernel_placements)).requires_grad_()
        dense = distribute_tensor(kernel.reshape(4, 8, 1).repeat(1, 1, 3) / 3, device_mesh,
                                  list(kernel_placements)).requires_grad_()
        out = keras.ops.depthwise_conv(x_leaf, depthwise, padding="same")
        out2 = keras.ops.conv(x_leaf, dense, padding="valid")
        ((out * torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)).sum() + out2.square().sum()).backward()
        return dict(out=out.detach().full_tensor(), out2=out2.detach().full_tensor(), x_grad=x_leaf.grad.full_tensor(),
                    kernel_grad=depthwise.grad.full_tensor(), dense_grad=dense.grad.full_tensor())


@pytest.mark.parametrize("mesh_shape, x_placements, kernel_placements, as_on_2_11", [
    ((1, 2), ("R", 2), ("R", "R"), False),   # channels over "model" (a feature-split projection's output: Qwen3.5)
    ((1, 2), ("R", 1), ("R", 1), False),     # positions over "model", the kernel split too
    ((2, 2), (0, 2), ("R", "R"), False),     # rows over "batch", channels over "model"
    # as on torch 2.11 (local pieces): the rows kept split, so the kernels' gradients are sums over ranks
    ((1, 2), ("R", 0), ("R", 1), True),
    ((2, 2), (0, 2), ("R", "R"), True),
], ids=["1x2-channels", "1x2-positions-and-kernel", "2x2-rows-and-channels", "1x2-rows-and-kernel-as-on-2.11",
        "2x2-rows-and-channels-as-on-2.11"])
def test_convolution_of_an_input_split_along_channels_or_positions_equals_single_process(mesh_shape, x_placements,
                                                                                         kernel_placements, as_on_2_11):
    import keras
    import torch

    torch.manual_seed(0)
    x, kernel = torch.randn(4, 10, 8), torch.randn(4, 8, 1)  # (batch, length, channels); (width, channels, 1)
    reference_x, reference_kernel = x.clone().requires_grad_(), kernel.clone().requires_grad_()
    reference_dense = (kernel.reshape(4, 8, 1).repeat(1, 1, 3) / 3).requires_grad_()
    out = keras.ops.depthwise_conv(reference_x, reference_kernel, padding="same")
    out2 = keras.ops.conv(reference_x, reference_dense, padding="valid")
    ((out * torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)).sum() + out2.square().sum()).backward()

    world_size = mesh_shape[0] * mesh_shape[1]
    for result in run_on_ranks(convolution_of_split_channels, x, kernel, mesh_shape, placements_of(x_placements),
                               placements_of(kernel_placements), as_on_2_11, world_size=world_size, timeout=300):
        torch.testing.assert_close(result["out"], out.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["out2"], out2.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["x_grad"], reference_x.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["kernel_grad"], reference_kernel.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["dense_grad"], reference_dense.grad, rtol=1e-5, atol=1e-5)


def activation_read_transposed(name, leaf, in_place):
    """Keras activation ``name`` of ``leaf`` (rows, features) reshaped to (batch, length, features) (scaled in place
    if ``in_place``, as a model may), read back transposed, with a weighted sum's gradient taken into ``leaf.grad``:
    the detached output."""
    import keras
    import torch

    activated = getattr(keras.activations, name)(keras.ops.reshape(leaf, (4, 8, 4)))
    if in_place:
        activated *= 1.5
    out = keras.ops.transpose(activated, (0, 2, 1))
    (out * torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach()


def activations_of_rows_read_transposed(rows, mesh_shape, placements):
    """Each Keras activation whose backward torch lays out unlike DTensor's declaration, applied to a DTensor
    reshaped from (rows, features) to (batch, length, features) and read back transposed (as Qwen3.5's gated
    delta net reads its ``softplus``): each output and the gradient of ``rows``."""
    from torch.distributed.tensor import distribute_tensor

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix._keras.ops.activations import AFFECTED
    from keras_dtensor_mixfix.testing import mesh

    assert keras_integration.install()
    try:
        leaf = distribute_tensor(rows, mesh(mesh_shape, ("batch", "model")), list(placements)).requires_grad_()
        outs = {}
        for name in AFFECTED:
            for in_place in (False, True):
                out = activation_read_transposed(name, leaf, in_place)
                outs[name, in_place] = (out.full_tensor(), leaf.grad.full_tensor())
                leaf.grad = None
        return outs
    finally:
        keras_integration.uninstall()


@pytest.mark.parametrize("mesh_shape, placements", [
    ((1, 2), ("R", 0)),  # rows over "model" (DataParallel's layout on a 1-D mesh)
    ((1, 2), ("R", 1)),  # features over "model"
    ((2, 2), (0, 1)),    # rows over "batch", features over "model"
], ids=["1x2-rows", "1x2-features", "2x2-rows-and-features"])
def test_activation_gradient_read_transposed_reshapes_like_single_process(mesh_shape, placements):
    """torch's kernel writes these activations' gradients transposed where DTensor declares them contiguous; the
    reshape before the activation then failed in the backward ("view size is not compatible": Qwen3.5)."""
    import torch

    from keras_dtensor_mixfix._keras.ops.activations import AFFECTED

    torch.manual_seed(0)
    rows = torch.randn(32, 4)
    want = {}
    for name in AFFECTED:
        for in_place in (False, True):
            leaf = rows.clone().requires_grad_()
            want[name, in_place] = (activation_read_transposed(name, leaf, in_place), leaf.grad)
    for result in run_on_ranks(activations_of_rows_read_transposed, rows, mesh_shape, placements_of(placements),
                               world_size=mesh_shape[0] * mesh_shape[1], timeout=300):
        assert set(result) == set(want)
        for key, (out, grad) in result.items():
            torch.testing.assert_close(out, want[key][0], rtol=1e-6, atol=1e-6, msg=str(key))
            torch.testing.assert_close(grad, want[key][1], rtol=1e-6, atol=1e-6, msg=str(key))


def grouped_reshape(x, mesh_shape, x_placements, gradient_placements, newshape, in_place=False):
    """Keras ``reshape`` of a DTensor made of ``x`` to ``newshape`` (doubled in place if ``in_place``, as Gemma's
    attention scales its queries), then a weighted sum whose gradient arrives at the reshaped value laid out as
    ``gradient_placements`` (None: as DTensor leaves it): the global value, the gradient of ``x`` and the value's
    placements."""
    import keras
    import torch
    from torch.distributed.tensor import distribute_tensor

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix.testing import mesh

    class ArrivesLaidOut(torch.autograd.Function):
        """Identity; the gradient leaves it as ``placements`` (as an op of the model may lay it out)."""

        @staticmethod
        def forward(ctx, tensor, placements):
            ctx.placements = placements
            return tensor.view_as(tensor)

        @staticmethod
        def backward(ctx, gradient):
            return gradient.redistribute(gradient.device_mesh, ctx.placements), None

    assert keras_integration.install()
    try:
        leaf = distribute_tensor(x, mesh(mesh_shape, ("batch", "model")), list(x_placements)).requires_grad_()
        out = keras.ops.reshape(leaf * 1.0, newshape)
        if in_place:
            out *= 2.0
        read = ArrivesLaidOut.apply(out, gradient_placements) if gradient_placements is not None else out
        (read * torch.linspace(0.5, 1.5, read.numel()).reshape(read.shape)).sum().backward()
        return dict(out=out.detach().full_tensor(), grad=leaf.grad.full_tensor(), placements=tuple(out.placements))
    finally:
        keras_integration.uninstall()


@pytest.mark.parametrize("mesh_shape, x_placements, gradient_placements, shape, newshape, kept, in_place", [
    # 4 query heads split over 4 ranks grouped as (2 key/value heads, 2 per head): DTensor refuses to keep the split
    ((1, 4), ("R", 2), None, (2, 3, 4, 5), (2, 3, 2, 2, 5), ("R", "R"), False),
    # 6 heads over 2, grouped (3, 2), rows over "batch": the heads are gathered, the rows stay split
    ((2, 2), (0, 2), None, (2, 3, 6, 4), (2, 3, 3, 2, 4), (0, "R"), False),
    # 4 heads over 2 grouped (2, 2): DTensor keeps the split on the first factor; nothing gathered
    ((2, 2), (0, 2), None, (2, 3, 4, 4), (2, 3, 2, 2, 4), (0, 2), False),
    # the same, the reshaped value then changed in place
    ((2, 2), (0, 2), None, (2, 3, 4, 4), (2, 3, 2, 2, 4), (0, 2), True),
    # tokens flattened (MoE), the gradient arriving split over both axes (Mixtral on 8 ranks): DTensor's view back
    # computed the wrong pieces (repros/torch_view_two_axes_one_dim.py)
    ((2, 2), (0, "R"), (0, 0), (2, 8, 8), (16, 8), (0, "R"), False),
    # ... arriving at a value changed in place: autograd then takes the gradient to the reshape's input through its
    # own CopySlices node, whose view back no hook reaches, and torch's bug stands
    pytest.param((2, 2), (0, "R"), (0, 0), (2, 8, 8), (16, 8), (0, "R"), True, marks=pytest.mark.xfail(
        strict=True, raises=RankError, reason="torch's view of a dim split over two mesh axes "
                                              "(repros/torch_view_two_axes_one_dim.py) inside CopySlices' backward")),
], ids=["1x4-heads-gathered", "2x2-heads-gathered-rows-kept", "2x2-split-kept", "2x2-split-kept-in-place",
        "2x2-gradient-over-both-axes", "2x2-gradient-over-both-axes-in-place"])
def test_reshape_of_a_split_dtensor_equals_single_process(mesh_shape, x_placements, gradient_placements, shape,
                                                         newshape, kept, in_place):
    """Where DTensor cannot carry a split into a reshape's new shape (grouped-query attention's query heads, Gemma3 on
    (2, 4)) the reshaped dims are gathered first; where the gradient arrives split differently from the forward
    output, it is laid out as the forward was before the view back."""
    import keras
    import torch

    torch.manual_seed(0)
    x = torch.randn(*shape)
    reference = x.clone().requires_grad_()
    out = keras.ops.reshape(reference * 1.0, newshape)
    if in_place:
        out *= 2.0
    (out * torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)).sum().backward()
    grad_placements = placements_of(gradient_placements) if gradient_placements is not None else None
    for result in run_on_ranks(grouped_reshape, x, mesh_shape, placements_of(x_placements), grad_placements, newshape,
                               in_place, world_size=mesh_shape[0] * mesh_shape[1], timeout=300):
        torch.testing.assert_close(result["out"], out.detach(), rtol=0, atol=0)
        torch.testing.assert_close(result["grad"], reference.grad, rtol=1e-6, atol=1e-6)
        assert result["placements"] == placements_of(kept)

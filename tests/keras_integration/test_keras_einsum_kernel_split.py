"""A kernel split along its contracted input dim is re-split along its first output label
(``_keras/ops/einsum_kernel_split.py``).

Keras' einsum of a whole activation and a Keras variable split along the hidden dim (keras_hub
Llama's query kernel) on 2 gloo ranks: the result is split along the heads (no partial sum to
reduce), and its value and both gradients equal one process's; eager, and compiled in one graph (under
``jit_compile`` the re-split was skipped, so compiled attention got every head and the output projection's
einsum went to DTensor, whose sharding propagation failed on a strided shard: keras_hub Qwen and Llama3).
"""

from __future__ import annotations

import pytest

from _keras_releases import one_graph
from keras_dtensor_mixfix.testing import run_on_ranks


def projection(x, kernel, kernel_placements, compiled=False):
    import keras
    import torch
    from torch.distributed.tensor import Replicate, distribute_tensor

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix.testing import mesh

    assert keras_integration.install()
    try:
        device_mesh = mesh((1, 2), ("batch", "model"))
        weight = torch.nn.Parameter(distribute_tensor(kernel, device_mesh, list(kernel_placements)))
        x_leaf = distribute_tensor(x, device_mesh, [Replicate(), Replicate()]).requires_grad_()
        einsum = lambda a, b: keras.ops.einsum("btd,dnh->btnh", a, b)  # noqa: E731
        if compiled:
            torch._dynamo.reset()
            einsum = torch.compile(einsum, dynamic=False, fullgraph=True)  # no graph break in the wrappers
        out = einsum(x_leaf, weight)
        placements = str(tuple(out.placements))
        scale = torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)
        (out * scale).sum().backward()
        return dict(out=out.detach().full_tensor(), placements=placements, x_grad=x_leaf.grad.full_tensor(),
                    kernel_grad=weight.grad.full_tensor(), kernel_grad_placements=str(tuple(weight.grad.placements)))
    finally:
        keras_integration.uninstall()


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=one_graph)], ids=["eager", "compiled"])
def test_hidden_split_query_kernel_is_split_by_heads_and_equals_single_process(compiled):
    import torch
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    x, kernel = torch.randn(2, 6, 8), torch.randn(8, 4, 3)
    reference_x, reference_kernel = x.clone().requires_grad_(), kernel.clone().requires_grad_()
    out = torch.einsum("btd,dnh->btnh", reference_x, reference_kernel)
    (out * torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)).sum().backward()
    # keras_hub's layout on a (1, 2) mesh: the heads over "batch" (size 1), the hidden dim over "model"
    for result in run_on_ranks(projection, x, kernel, (Shard(1), Shard(0)), compiled, world_size=2, timeout=300):
        assert result["placements"] == "(Replicate(), Shard(dim=2))", result["placements"]  # the heads, no Partial
        torch.testing.assert_close(result["out"], out.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["x_grad"], reference_x.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["kernel_grad"], reference_kernel.grad, rtol=1e-5, atol=1e-6)
        assert result["kernel_grad_placements"] == "(Shard(dim=1), Shard(dim=0))"  # the kernel's own layout


def projection_under_layout_map(query_axes):
    """Keras' EinsumDense (``btd,dnh->btnh``) under ModelParallel with ``query_axes`` for its kernel on a (1, 2)
    mesh: the warnings logged over two steps, the kernel's placements, and the trained kernel."""
    import logging

    import keras
    import numpy as np

    from keras_dtensor_mixfix import keras_integration

    messages = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    logging.getLogger("keras_dtensor_mixfix").addHandler(handler)
    assert keras_integration.install()
    try:
        devices = keras.distribution.list_devices()
        layout_map = keras.distribution.LayoutMap(keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices))
        layout_map["net/query/kernel"] = query_axes
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                             batch_dim_name="batch"))
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6, 8)),
                                  keras.layers.EinsumDense("btd,dnh->btnh", output_shape=(None, 4, 3), name="query"),
                                  keras.layers.Reshape((6, 12))], name="net")
        model.compile(optimizer="sgd", loss="mse")
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(4, 6, 8)).astype("float32"), rng.normal(size=(4, 6, 12)).astype("float32")
        for _ in range(2):
            model.train_on_batch(x, y)
        placements = str(tuple(model.layers[0].kernel.value.placements))
        return dict(messages=messages, placements=placements, kernel=model.layers[0].kernel.numpy())
    finally:
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
        logging.getLogger("keras_dtensor_mixfix").removeHandler(handler)


def test_a_kernel_split_along_its_input_is_named_once_with_the_rule_that_avoids_the_resplit():
    keras_hub_like = run_on_ranks(projection_under_layout_map, ("model", "batch", None), world_size=2, timeout=300)
    for result in keras_hub_like:
        advice = [m for m in result["messages"] if "splits it again along its output" in m]
        assert len(advice) == 1, result["messages"]  # once, not once per step
        assert "net/query/kernel 8x4x3 as ('model', 'batch', None)" in advice[0], advice[0]
        assert "layout_map['net/query/kernel'] = ('batch', 'model', None)" in advice[0], advice[0]
    # the advice followed: split by heads from the start, nothing to re-split or advise, the same training
    followed = run_on_ranks(projection_under_layout_map, ("batch", "model", None), world_size=2, timeout=300)
    for before, after in zip(keras_hub_like, followed):
        assert not [m for m in after["messages"] if "splits it again" in m], after["messages"]
        # the heads over "model" (Keras 3.16's own variables keep the size-1 "batch" axis on the hidden dim)
        assert after["placements"] in ("(Replicate(), Shard(dim=1))",
                                       "(Shard(dim=0), Shard(dim=1))"), after["placements"]
        import numpy as np

        np.testing.assert_allclose(after["kernel"], before["kernel"], rtol=1e-5, atol=1e-6)

"""How a model-sharded Keras step computes: einsum (and matmul) on local pieces, partial sums settled at layer outputs,
gradients laid out like their parameters, size-1 mesh axes replicated.

Each einsum the integration runs on local pieces is checked on real gloo ranks against the same
einsum on plain tensors in one process: the value, and the gradient of every operand (a sharded,
a whole and a partial-sum operand each), on 2 ranks and on a 2×2 mesh of 4 ranks. The Keras
model-level effects are checked on a 2-rank ModelParallel MLP; its trained weights equal one
process (as every test in tests/keras_integration/test_keras.py checks for its models).
"""

from __future__ import annotations

import numpy as np
import pytest

from keras_dtensor_mixfix.testing import run_on_ranks

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# (subscripts, global shapes, placements per operand by name), mesh given by the placements' length
CASES_1D = [
    ("btd,dnh->btnh", [(4, 3, 6), (6, 2, 3)], [("R",), ("S1",)]),             # column-sharded kernel
    ("btnh,nhd->btd", [(4, 3, 2, 3), (2, 3, 6)], [("S2",), ("S0",)]),         # row-sharded: partial result
    ("bqnh,bknh->bnqk", [(4, 3, 2, 3), (4, 5, 2, 3)], [("S2",), ("S2",)]),    # attention, head-sharded
    ("bd,df->bf", [(4, 6), (6, 5)], [("P",), ("R",)]),                         # a partial-sum operand
    ("btd,dnh->btnh", [(4, 3, 6), (6, 3, 3)], [("R",), ("S1",)]),             # uneven shards (3 over 2 ranks)
    ("bd,df->bf", [(4, 6), (6, 5)], [("S1",), ("R",)]),                        # needs communication: DTensor's
    # Keras' matmul of DTensors, as the einsum it is
    ("matmul", [(2, 4, 3, 5), (2, 4, 5, 3)], [("S1",), ("S1",)]),             # head-split attention (Bloom)
    ("matmul", [(4, 3, 6), (6, 5)], [("S0",), ("R",)]),                        # batch-split rows, whole kernel
    ("matmul", [(3, 6), (6, 4)], [("R",), ("S1",)]),                           # column-sharded kernel
    # a plain operand ("T", the same whole tensor on every rank): keys from keras_hub's plain generate cache
    ("bqnh,bknh->bnqk", [(4, 3, 2, 3), (4, 5, 2, 3)], [("S2",), ("T",)]),
    ("bd,df->bf", [(4, 6), (6, 5)], [("T",), ("S1",)]),                        # a plain batch, a split kernel
]
CASES_2D = [
    ("bd,df->bf", [(4, 6), (6, 4)], [("R", "S0"), ("S1", "R")]),
    ("btnh,nhd->btd", [(4, 3, 2, 3), (2, 3, 4)], [("S0", "S2"), ("R", "S0")]),
    ("matmul", [(2, 4, 3, 5), (2, 4, 5, 3)], [("S0", "S1"), ("S0", "S1")]),
    ("bqnh,bknh->bnqk", [(4, 3, 2, 3), (4, 5, 2, 3)], [("S0", "S2"), ("T", "T")]),
]


def _placement(name):
    from torch.distributed.tensor import Partial, Replicate, Shard

    return {"R": Replicate(), "P": Partial("sum")}.get(name) or Shard(int(name[1:]))


def _globals(shapes):
    import torch

    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]


def _reference(subscripts, shapes):
    import torch

    operands = [t.requires_grad_() for t in _globals(shapes)]
    out = torch.matmul(*operands) if subscripts == "matmul" else torch.einsum(subscripts, *operands)
    weight = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
    (out * weight).sum().backward()
    return out.detach().numpy(), [t.grad.numpy() for t in operands]


def einsum_on_ranks(cases, mesh_shape, compiled=False):
    """Each case's value and gradients on this rank, eager or (``compiled``) through ``torch.compile``
    (``aot_eager``, the whole einsum in one graph; the backward is the compiled graph's)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, distribute_tensor

    from keras_dtensor_mixfix._keras.ops import local_einsum

    mesh = init_device_mesh("cpu", mesh_shape)
    local_calls = []

    def original(subscripts, *operands, **kwargs):
        local_calls.append(not any(isinstance(o, DTensor) for o in operands))
        return torch.einsum(subscripts, *operands)

    def original_matmul(a, b):
        local_calls.append(not any(isinstance(o, DTensor) for o in (a, b)))
        return torch.matmul(a, b)

    sharded_einsum, matmul = local_einsum._sharded_einsum(original), local_einsum._sharded_matmul(original_matmul)

    def einsum(subscripts, *operands):
        return matmul(*operands) if subscripts == "matmul" else sharded_einsum(subscripts, *operands)

    results = []
    for subscripts, shapes, names in cases:
        operands = []
        for tensor, placement_names in zip(_globals(shapes), names):
            if "T" in placement_names:  # plain
                operands.append(tensor.requires_grad_())
                continue
            placements = [_placement(n) for n in placement_names]
            if any(isinstance(p, Partial) for p in placements):  # pieces that sum to the tensor, unequal
                share = (dist.get_rank() + 1) / sum(range(1, dist.get_world_size() + 1))
                operand = DTensor.from_local(tensor * share, mesh, placements, run_check=False)
            else:
                operand = distribute_tensor(tensor, mesh, placements, src_data_rank=None)
            operands.append(operand.detach().requires_grad_())
        local_calls.clear()
        if compiled:
            torch._dynamo.reset()  # a fresh trace per case: local_calls records what the trace ran
            step = torch.compile(lambda *ops: einsum(subscripts, *ops), backend="aot_eager", fullgraph=True,
                                 dynamic=False)
            out = step(*operands)
        else:
            out = einsum(subscripts, *operands)
        weight = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
        (out.full_tensor() * weight).sum().backward()
        results.append({"local": local_calls == [True], "value": out.full_tensor().detach().numpy(),
                        "grads": [(o.grad.full_tensor() if isinstance(o, DTensor) else o.grad).numpy()
                                  for o in operands],
                        "grad_types": [type(o.grad) is type(o) for o in operands]})
    return results


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("cases, world_size, mesh_shape", [(CASES_1D, 2, (2,)), (CASES_2D, 4, (2, 2))],
                         ids=["2 ranks", "2x2 mesh"])
def test_einsum_values_and_gradients_equal_one_process(cases, world_size, mesh_shape, compiled):
    per_rank = run_on_ranks(einsum_on_ranks, cases, mesh_shape, compiled, world_size=world_size, timeout=300)
    for index, (subscripts, shapes, names) in enumerate(cases):
        value, grads = _reference(subscripts, shapes)
        communicates = names == [("S1",), ("R",)]
        for rank, results in enumerate(per_rank):
            got = results[index]
            assert got["local"] is not communicates, (subscripts, names, rank)
            np.testing.assert_allclose(got["value"], value, rtol=1e-12, atol=1e-12, err_msg=f"{subscripts} {names}")
            assert all(got["grad_types"]), f"a gradient of another type than its operand: {subscripts} {names}"
            for got_grad, want in zip(got["grads"], grads):
                np.testing.assert_allclose(got_grad, want, rtol=1e-12, atol=1e-12,
                                           err_msg=f"gradient: {subscripts} {names} rank {rank}")


def keras_mlp_step():
    import keras
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix._keras.boundary import keras_modules

    assert keras_integration.install()
    try:
        devices = keras.distribution.list_devices()
        mesh = keras.distribution.DeviceMesh((1, len(devices)), ["batch", "model"], devices)
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*up/kernel"] = ("batch", "model")  # "batch" has size 1: nothing to split there
        layout_map[".*down/kernel"] = ("model", None)
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                             batch_dim_name="batch"))
        keras.utils.set_random_seed(0)
        up, down = keras.layers.Dense(16, name="up"), keras.layers.Dense(4, name="down")
        # whole (no rule): its input comes split by features, so backward leaves its gradient split unless laid out
        mix = keras.layers.Dense(16, name="mix")
        inputs = keras.Input((8,))
        model = keras.Model(inputs, down(mix(up(inputs))))
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(6, 8)).astype("float32"), rng.normal(size=(6, 4)).astype("float32")
        initial = model.get_weights()
        losses = [float(model.train_on_batch(x, y)) for _ in range(2)]
        with torch.no_grad():
            hidden = up(keras.ops.convert_to_tensor(x))
            output = down(mix(hidden))
        grads = {v.path: (tuple(v.value.grad.placements), tuple(v.value.placements))
                 for v in model.trainable_weights if isinstance(v.value, DTensor)}
        return {"initial": initial, "losses": losses, "trained": model.get_weights(), "grads": grads,
                "up_kernel": tuple(up.kernel.value.placements),
                "down_output_partial": any(isinstance(p, Partial) for p in output.placements),
                "expected_up": (Replicate(), Shard(1)), "keras_own_lib": keras_modules.native_distribution_lib()}
    finally:
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
        keras.backend.clear_session()


def test_keras_step_settles_partial_sums_and_lays_out_gradients():
    import keras

    per_rank = run_on_ranks(keras_mlp_step, world_size=2, timeout=300)
    out = per_rank[0]
    if not out["keras_own_lib"]:  # Keras 3.16 makes the layouts itself (and shards a size-1 axis)
        assert out["up_kernel"] == out["expected_up"]  # ours: the size-1 "batch" axis is replicated
    assert not out["down_output_partial"]  # a row-sharded layer's output is reduced at the layer
    for path, (grad, parameter) in out["grads"].items():
        assert grad == parameter, path
    assert any("mix/kernel" in path for path in out["grads"]), out["grads"]
    keras.utils.set_random_seed(0)
    up, down, mix = keras.layers.Dense(16, name="up"), keras.layers.Dense(4, name="down"), keras.layers.Dense(16)
    inputs = keras.Input((8,))
    model = keras.Model(inputs, down(mix(up(inputs))))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.set_weights(out["initial"])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 8)).astype("float32"), rng.normal(size=(6, 4)).astype("float32")
    losses = [float(model.train_on_batch(x, y)) for _ in range(2)]
    np.testing.assert_allclose(out["losses"], losses, rtol=1e-5)
    for got, want in zip(out["trained"], model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    keras.backend.clear_session()

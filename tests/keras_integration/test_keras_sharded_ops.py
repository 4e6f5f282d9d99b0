"""Keras ops the integration wraps because DTensor cannot run Keras' version on sharded values.

A vocabulary-sharded embedding read twice (a layer norm), attention with head-sharded
projections, ``slice_update`` into a batch-sharded tensor, and reductions over a sharded axis read
as Python numbers, on 2 gloo ranks against one process (values and trained weights); the same
model on a (2, 2) ("batch", "model") mesh with keras_hub's kind of layout (weights split over both
axes, the batch over "batch"), and the lookup of batch-split ids in such a table (values and
gradients); attention on head-sharded operands compiled (values and gradients); on plain tensors the
wrapped ops are Keras' own, bit for bit.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest

from _keras_releases import one_graph
from keras_dtensor_mixfix.testing import RankError, run_on_ranks

VOCAB, LENGTH, HEADS, DEPTH = 32, 6, 2, 4


def _model(prefix=""):
    import keras
    from keras import ops

    class Attention(keras.layers.Layer):
        def build(self, input_shape):
            self.qkv = self.add_weight(shape=(input_shape[-1], 3, HEADS, DEPTH), name="qkv",
                                       initializer="glorot_uniform")

        def call(self, x):
            qkv = ops.einsum("btd,dkhe->btkhe", x, self.qkv)
            out = ops.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
            return ops.reshape(out, (-1, LENGTH, HEADS * DEPTH))

    ids = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, HEADS * DEPTH, name="embed")(ids)
    x = keras.layers.LayerNormalization(name="norm")(x)  # reads the embedding twice (mean, then x - mean)
    x = Attention(name="attn")(x)
    logits = keras.layers.Dense(VOCAB, name="head")(x)
    return keras.Model(ids, logits, name=f"{prefix}lm")


def _compile(model):
    import keras

    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _data():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, size=(4, LENGTH)).astype("int32")
    return ids, np.roll(ids, -1, axis=1)


LAYOUTS_1D = {".*embed/embeddings": ("model", None),  # vocabulary-sharded table
              ".*attn/qkv": (None, None, "model", None),  # heads
              ".*head/kernel": (None, "model")}
# keras_hub's get_layout_map on a (batch, model) mesh: weights split over both axes
LAYOUTS_2D = {".*embed/embeddings": ("model", "batch"),
              ".*attn/qkv": ("batch", None, "model", None),
              ".*head/kernel": ("batch", "model")}


def sharded_lm(mesh_shape=None, layouts=None):
    import keras
    import torch
    from torch.distributed.tensor import DTensor

    from keras_dtensor_mixfix import keras_integration

    assert keras_integration.install()
    try:
        keras.utils.set_random_seed(1)
        devices = keras.distribution.list_devices()
        mesh = keras.distribution.DeviceMesh(mesh_shape or (1, len(devices)), ["batch", "model"], devices)
        layout_map = keras.distribution.LayoutMap(mesh)
        for key, axes in (layouts or LAYOUTS_1D).items():
            layout_map[key] = axes
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                             batch_dim_name="batch"))
        model = _model()
        _compile(model)
        initial = model.get_weights()
        placements = {v.path: str(tuple(v.value.placements)) for v in model.weights if isinstance(v.value, DTensor)}
        x, y = _data()
        losses = [float(model.train_on_batch(x, y)) for _ in range(3)]
        trained = model.get_weights()
        predicted = model.predict_on_batch(x)
        if mesh_shape is not None:
            return dict(initial=initial, placements=placements, losses=losses, trained=trained, predicted=predicted)
        # slice_update into a tensor sharded on the batch axis (what keras_hub's generate() does)
        full = torch.arange(4 * LENGTH, dtype=torch.int32).reshape(4, LENGTH)
        sharded = keras.distribution.distribute_tensor(full, keras.distribution.TensorLayout(["model", None], mesh))
        updated = keras.ops.slice_update(sharded, [0, 2], torch.full((4, 1), -1, dtype=torch.int32))
        updated_tensor = keras.ops.slice_update(sharded, torch.tensor([1, 3]), torch.full((2, 2), -2,
                                                                                          dtype=torch.int32))
        updates = (updated.full_tensor().numpy(), updated_tensor.full_tensor().numpy(), str(sharded.placements))
        # reductions over the sharded rows, read as Python numbers on every rank (keras_hub's generate()
        # indexes with `ops.min(row_lengths)`); each rank's own rows alone would give other values
        lengths = keras.distribution.distribute_tensor(torch.tensor([3, 5, 2, 4]),
                                                       keras.distribution.TensorLayout(["model"], mesh))
        index = keras.ops.min(lengths)
        reductions = dict(
            min=int(index), max=int(keras.ops.max(lengths)), item=index.item(),
            indexed=keras.ops.convert_to_numpy(sharded[:, index]),
            amin=keras.ops.convert_to_numpy(keras.ops.amin(sharded, axis=0)),
            amax=keras.ops.convert_to_numpy(keras.ops.amax(sharded, axis=0)),
            all=bool(keras.ops.all(sharded < 12)), any=bool(keras.ops.any(sharded > 20)),
            placements=str(tuple(index.placements)))
    finally:
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
        keras.backend.clear_session()
    return dict(initial=initial, placements=placements, losses=losses, trained=trained, predicted=predicted,
                updates=updates, reductions=reductions)


def _assert_equals_single_process(out):
    """Losses, trained weights and predictions of the sharded run equal one process's from the same weights."""
    reference = _model("ref_")
    _compile(reference)
    reference.set_weights(out["initial"])
    x, y = _data()
    losses = [float(reference.train_on_batch(x, y)) for _ in range(3)]
    np.testing.assert_allclose(out["losses"], losses, rtol=1e-5)
    for got, want in zip(out["trained"], reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["predicted"], reference.predict_on_batch(x), rtol=1e-5, atol=1e-6)


def test_vocab_sharded_embedding_attention_and_slice_update_equal_single_process():
    per_rank = run_on_ranks(sharded_lm, world_size=2, timeout=900)
    out = per_rank[0]
    placements = {"/".join(path.split("/")[-2:]): value for path, value in out["placements"].items()}
    assert placements["embed/embeddings"] == "(Replicate(), Shard(dim=0))", out["placements"]
    assert placements["attn/qkv"] == "(Replicate(), Shard(dim=2))", out["placements"]
    _assert_equals_single_process(out)
    updated, updated_tensor, placements = out["updates"]
    assert "Shard(dim=0)" in placements
    full = np.arange(4 * LENGTH, dtype="int32").reshape(4, LENGTH)
    want = full.copy()
    want[:, 2] = -1
    np.testing.assert_array_equal(updated, want)
    want = full.copy()
    want[1:3, 3:5] = -2
    np.testing.assert_array_equal(updated_tensor, want)
    for rank, result in enumerate(per_rank):
        reductions = result["reductions"]
        assert reductions.pop("placements") == "(Replicate(), Replicate())", (rank, reductions)
        assert (reductions.pop("min"), reductions.pop("max"), reductions.pop("item")) == (2, 5, 2), (rank, reductions)
        np.testing.assert_array_equal(reductions.pop("indexed"), full[:, 2])
        np.testing.assert_array_equal(reductions.pop("amin"), full.min(axis=0))
        np.testing.assert_array_equal(reductions.pop("amax"), full.max(axis=0))
        assert reductions == dict(all=False, any=True), (rank, reductions)


def test_weights_split_over_both_mesh_axes_and_the_batch_over_one_equal_single_process():
    """(2, 2) mesh, keras_hub's kind of layout: the table's hidden dim and the kernels' input dims split over
    "batch" while each rank's batch rows are its own (torch's lookup alone fails there: repros/)."""
    out = run_on_ranks(sharded_lm, (2, 2), LAYOUTS_2D, world_size=4, timeout=900)[0]
    placements = {"/".join(path.split("/")[-2:]): value for path, value in out["placements"].items()}
    assert placements["embed/embeddings"] == "(Shard(dim=1), Shard(dim=0))", out["placements"]
    assert placements["attn/qkv"] == "(Shard(dim=0), Shard(dim=2))", out["placements"]
    _assert_equals_single_process(out)


def lookup_split_ids(table, ids, table_placements, ids_placements, compiled=False):
    """Keras' ``take`` of ``ids`` (a DTensor) in ``table`` (a DTensor parameter) on a (2, 2) mesh: the value,
    its placements, and the table's gradient of a loss that weighs every looked-up element differently;
    ``compiled``: the lookup through ``torch.compile`` (``aot_eager``, one graph), as under ``jit_compile``."""
    import keras
    import torch
    from torch.distributed.tensor import distribute_tensor

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix.testing import mesh

    assert keras_integration.install()
    try:
        device_mesh = mesh((2, 2), ("batch", "model"))
        sharded_table = torch.nn.Parameter(distribute_tensor(table, device_mesh, list(table_placements)))
        split_ids = distribute_tensor(ids, device_mesh, list(ids_placements))
        if compiled:
            torch._dynamo.reset()
            take = torch.compile(lambda t, i: keras.ops.take(t, i, axis=0), backend="aot_eager", fullgraph=True,
                                 dynamic=False)
        else:
            take = lambda t, i: keras.ops.take(t, i, axis=0)  # noqa: E731
        looked_up = take(sharded_table, split_ids)
        weights = torch.arange(looked_up.numel(), dtype=torch.float32).reshape(looked_up.shape) / looked_up.numel()
        (looked_up * weights).sum().backward()  # the weights: a plain tensor, promoted
        return looked_up.detach().full_tensor(), str(tuple(looked_up.placements)), sharded_table.grad.full_tensor()
    finally:
        keras_integration.uninstall()


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=one_graph)], ids=["eager", "compiled"])
def test_lookup_of_split_ids_in_a_table_split_over_the_same_axis_equals_single_process(compiled):
    """The failure class behind keras_hub's 2-D IndexError: a mask made for this rank's ids applied to
    another batch piece. Every combination of ids split or whole and table split on either mesh axis;
    eager, and compiled (under ``jit_compile`` the lookup failed "Mixing fake modes NYI": a graph break
    before it, in the wrapper, put it in a resumed frame)."""
    import torch
    from torch.distributed.tensor import Replicate, Shard

    torch.manual_seed(0)
    table, ids = torch.randn(VOCAB, 8), torch.randint(0, VOCAB, (4, LENGTH))
    cases = [((Shard(1), Shard(0)), (Shard(0), Replicate())),  # keras_hub's layout, batch rows split
             ((Shard(0), Shard(1)), (Shard(0), Replicate())),  # vocabulary over "batch" too
             ((Shard(0), Shard(0)), (Shard(0), Shard(1))),     # ids split over both axes
             ((Replicate(), Shard(0)), (Shard(0), Replicate())),
             ((Shard(1), Shard(0)), (Replicate(), Replicate()))]
    reference_table = table.clone().requires_grad_()
    looked_up = torch.nn.functional.embedding(ids, reference_table)
    weights = torch.arange(looked_up.numel(), dtype=torch.float32).reshape(looked_up.shape) / looked_up.numel()
    (looked_up * weights).sum().backward()
    for table_placements, ids_placements in cases:
        for value, placements, grad in run_on_ranks(
                lookup_split_ids, table, ids, table_placements, ids_placements, compiled, world_size=4, timeout=300):
            what = f"table {table_placements}, ids {ids_placements}"
            torch.testing.assert_close(value, looked_up.detach(), msg=lambda m: f"{what}: {m}")
            torch.testing.assert_close(grad, reference_table.grad, msg=lambda m: f"{what}, gradient: {m}")
            # the result keeps the ids' split (no gathered batch) and is never left a partial sum
            assert "Partial" not in placements, (what, placements)
            if isinstance(ids_placements[0], Shard):
                assert placements.startswith("(Shard(dim=0)"), (what, placements)


def compiled_attention(query, key, value, mask):
    """Keras' ``dot_product_attention`` of head-sharded query, key and value (grouped: 4 query heads, 2
    key/value heads) with a whole boolean mask, through ``torch.compile`` (inductor, static shapes, as under
    ``jit_compile``): the value, its placements, and the gradients of a loss weighing every element differently."""
    import keras
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix.testing import mesh

    assert keras_integration.install()
    try:
        device_mesh = mesh((2,), ("model",))
        pieces = [distribute_tensor(t, device_mesh, [Shard(2)]).requires_grad_() for t in (query, key, value)]
        torch._dynamo.reset()
        attention = torch.compile(lambda q, k, v, m: keras.ops.dot_product_attention(q, k, v, mask=m, scale=0.3),
                                  dynamic=False, fullgraph=True)
        out = attention(*pieces, mask)
        weights = torch.arange(out.numel(), dtype=torch.float32).reshape(out.shape) / out.numel()
        (out * weights).sum().backward()
        return out.detach().full_tensor(), str(tuple(out.placements)), [t.grad.full_tensor() for t in pieces]
    finally:
        keras_integration.uninstall()


@one_graph
def test_compiled_attention_on_head_sharded_operands_equals_single_process():
    """Compiled, attention still runs on each rank's heads: the local pieces were taken with
    ``hasattr(piece, "to_local")``, which TorchDynamo answers False for a DTensor
    (``repros/torch_dynamo_hasattr_dtensor.py``), so Keras' attention ran on whole DTensors and AOTAutograd
    failed replaying its transposed inputs ("as_strided not supported with DTensor": keras_hub's Llama3 and Qwen
    under ``jit_compile``). In one graph: Keras' own check for flash attention (``SDPAParams``, which TorchDynamo
    cannot trace) is answered off CUDA without asking, as torch would answer it."""
    import torch

    torch.manual_seed(0)
    query = torch.randn(4, LENGTH, 4, DEPTH)
    key, value = torch.randn(4, LENGTH, 2, DEPTH), torch.randn(4, LENGTH, 2, DEPTH)
    mask = torch.tril(torch.ones(LENGTH, LENGTH, dtype=torch.bool)).expand(4, 1, LENGTH, LENGTH).clone()
    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    repeated = [t.transpose(1, 2).repeat_interleave(2, dim=1) for t in leaves[1:]]
    expected = torch.nn.functional.scaled_dot_product_attention(leaves[0].transpose(1, 2), *repeated, attn_mask=mask,
                                                                scale=0.3).transpose(1, 2)
    weights = torch.arange(expected.numel(), dtype=torch.float32).reshape(expected.shape) / expected.numel()
    (expected * weights).sum().backward()
    for out, placements, grads in run_on_ranks(compiled_attention, query, key, value, mask, world_size=2, timeout=300):
        assert placements == "(Shard(dim=2),)", placements
        torch.testing.assert_close(out, expected.detach())
        for grad, leaf, name in zip(grads, leaves, ("query", "key", "value")):
            torch.testing.assert_close(grad, leaf.grad, msg=lambda m: f"{name} gradient: {m}")


def compiled_lookup_then_head_split_projection(table, ids, kernel, mesh_shape, layouts):
    """Keras' ``take`` in a vocabulary-split table, then ``einsum`` with a head-split kernel (a query projection,
    run on local pieces: the looked-up rows' gradient arrives a partial sum), through ``torch.compile``: the
    value and both gradients. ``layouts``: the table's, the ids' and the kernel's placements."""
    import keras
    import torch
    from torch.distributed.tensor import distribute_tensor

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix.testing import mesh

    assert keras_integration.install()
    try:
        device_mesh = mesh(mesh_shape, ("batch", "model"))
        table_layout, ids_layout, kernel_layout = layouts
        sharded_table = torch.nn.Parameter(distribute_tensor(table, device_mesh, table_layout))
        sharded_kernel = torch.nn.Parameter(distribute_tensor(kernel, device_mesh, kernel_layout))
        sharded_ids = distribute_tensor(ids, device_mesh, ids_layout)
        torch._dynamo.reset()
        step = torch.compile(lambda t, i, k: keras.ops.einsum("btd,dnh->btnh", keras.ops.take(t, i, axis=0), k),
                             backend="aot_eager", fullgraph=True, dynamic=False)
        out = step(sharded_table, sharded_ids, sharded_kernel)
        weights = torch.arange(out.numel(), dtype=torch.float32).reshape(out.shape) / out.numel()
        (out * weights).sum().backward()
        return out.detach().full_tensor(), sharded_table.grad.full_tensor(), sharded_kernel.grad.full_tensor()
    finally:
        keras_integration.uninstall()


@one_graph
@pytest.mark.parametrize("mesh_shape", [(1, 2), (2, 2)])
def test_compiled_lookup_whose_gradient_arrives_a_partial_sum_equals_single_process(mesh_shape):
    """Compiled, the lookup runs on this rank's vocabulary piece and its result is a plain partial sum, so a
    partial-sum gradient (keras_hub Gemma under ``jit_compile``: its embedding meets the head-split query kernel)
    reaches the table without DTensor's masked partial, whose redistribution cannot take it ("Redistribution from
    one partial type (P(sum)) to another (MaskP(...)) is unsupported")."""
    import torch

    from torch.distributed.tensor import Replicate, Shard

    torch.manual_seed(0)
    if mesh_shape == (1, 2):
        vocabulary, layouts = VOCAB, ([Replicate(), Shard(0)], [Replicate(), Replicate()], [Replicate(), Shard(1)])
    else:  # keras_hub's (2, 2) layout: hidden dim on "batch", vocabulary on "model"; ids split by rows
        vocabulary, layouts = VOCAB - 1, ([Shard(1), Shard(0)], [Shard(0), Replicate()], [Shard(0), Shard(1)])
    table, ids, kernel = torch.randn(vocabulary, 8), torch.randint(0, vocabulary, (2, LENGTH)), torch.randn(8, 4, 3)
    ids[0, :3] = torch.tensor([vocabulary - 1, -1, -vocabulary])  # the last (short) piece's rows; Keras' negatives
    leaves = [table.clone().requires_grad_(), kernel.clone().requires_grad_()]
    expected = torch.einsum("btd,dnh->btnh", torch.nn.functional.embedding(ids % vocabulary, leaves[0]), leaves[1])
    weights = torch.arange(expected.numel(), dtype=torch.float32).reshape(expected.shape) / expected.numel()
    (expected * weights).sum().backward()
    for out, table_grad, kernel_grad in run_on_ranks(compiled_lookup_then_head_split_projection, table, ids, kernel,
                                                     mesh_shape, layouts, world_size=math.prod(mesh_shape),
                                                     timeout=300):
        torch.testing.assert_close(out, expected.detach())
        torch.testing.assert_close(table_grad, leaves[0].grad, msg=lambda m: f"table gradient: {m}")
        torch.testing.assert_close(kernel_grad, leaves[1].grad, msg=lambda m: f"kernel gradient: {m}")


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


def compiled_one_hot(choices):
    """Keras' ``one_hot`` of replicated and row-split DTensor ids inside ``torch.compile(fullgraph=True)`` (a
    MoE router's expert choices), the class axis last and first."""
    import keras
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix.testing import mesh

    assert keras_integration.install()
    try:
        device_mesh = mesh((2,), ("model",))
        torch._dynamo.reset()
        encode = torch.compile(lambda x: [keras.ops.one_hot(x, 5), keras.ops.one_hot(x, 5, axis=0)],
                               backend="aot_eager", fullgraph=True, dynamic=False)
        return {name: [(value.full_tensor(), tuple(value.placements)) for value in
                       encode(distribute_tensor(choices, device_mesh, [placement]))]
                for name, placement in (("replicated", Replicate()), ("split", Shard(0)))}
    finally:
        keras_integration.uninstall()


@one_graph
def test_compiled_one_hot_of_a_dtensor_equals_single_process():
    """Compiled, ``one_hot`` of a DTensor encodes each rank's piece: torch's own meets a range check DTensor has no
    strategy for (repros/torch_dtensor_one_hot_compiled.py), and the graph break it made in keras_hub's Qwen MoE
    router left a split graph whose view of its input AOTAutograd could not replay."""
    import keras
    import torch
    from torch.distributed.tensor import Replicate, Shard

    choices = torch.tensor([[0, 3], [2, 1], [4, 4]])
    expected = [keras.ops.convert_to_numpy(keras.ops.one_hot(choices, 5, axis=axis)) for axis in (-1, 0)]
    for result in run_on_ranks(compiled_one_hot, choices, world_size=2, timeout=300):
        for placement, values in result.items():
            for (value, placements), want, axis in zip(values, expected, (-1, 0)):
                np.testing.assert_array_equal(value.numpy(), want, err_msg=f"{placement} axis {axis}")
            # row-split ids stay row-split: the rows axis moves behind a leading class axis
            wanted = [(Shard(0),), (Shard(1),)] if placement == "split" else [(Replicate(),)] * 2
            assert [p for _, p in values] == wanted, placement


def test_wrapped_ops_are_keras_own_on_plain_tensors():
    import torch
    from keras import ops

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix._keras.boundary import keras_modules
    from keras_dtensor_mixfix._keras.ops.activations import AFFECTED

    rng = np.random.default_rng(0)
    table = rng.normal(size=(VOCAB, 8)).astype("float32")
    ids = rng.integers(0, VOCAB, size=(3, 5))
    q, k, v = (rng.normal(size=(2, LENGTH, HEADS, DEPTH)).astype("float32") for _ in range(3))
    mask = np.tril(np.ones((LENGTH, LENGTH), bool))[None, None]
    import keras

    dense = keras.layers.Dense(3, kernel_initializer="glorot_uniform", name="plain_dense")

    def run():
        return [ops.convert_to_numpy(ops.take(table, ids, axis=0)),
                ops.convert_to_numpy(ops.slice_update(np.zeros((4, 4), "float32"), [1, 1], np.ones((2, 2), "float32"))),
                ops.convert_to_numpy(ops.slice_update(np.zeros((4, 4), "float32"), torch.tensor([0, 2]),
                                                      np.ones((2, 2), "float32"))),
                ops.convert_to_numpy(ops.dot_product_attention(q, k, v, mask=mask)),
                ops.convert_to_numpy(ops.dot_product_attention(q, k, v, is_causal=True)),
                *(ops.convert_to_numpy(getattr(ops, name)(table, axis=0)) for name in ("min", "max", "amin", "amax")),
                *(ops.convert_to_numpy(getattr(ops, name)(table > 0, axis=1)) for name in ("all", "any")),
                *(ops.convert_to_numpy(getattr(ops, name)(table, axis=1)) for name in ("argmax", "argmin")),
                ops.convert_to_numpy(ops.min(ids)),
                ops.convert_to_numpy(ops.einsum("btd,dk->btk", q.reshape(2, LENGTH, -1), table[:8].T)),
                ops.convert_to_numpy(ops.einsum("ij,jk", table[:4, :4].astype("int8"), table[:4, :4].astype("int8"))),
                ops.convert_to_numpy(ops.einsum("...d,d->...", q, q[0, 0, 0])),
                ops.convert_to_numpy(ops.matmul(q, np.swapaxes(k, 2, 3))),
                ops.convert_to_numpy(ops.matmul(table[:4, :4].astype("int8"), table[:4, :4].astype("int8"))),
                ops.convert_to_numpy(ops.cast(1 / np.sqrt(8), "float32")),  # NumPy scalar (compile.py's cast)
                ops.convert_to_numpy(ops.cast(table, "float16")),
                ops.convert_to_numpy(ops.one_hot(ids, VOCAB)), ops.convert_to_numpy(ops.one_hot(ids % 7, 7, axis=0)),
                ops.convert_to_numpy(ops.depthwise_conv(q.reshape(2, LENGTH, -1), table[:3, :, None], padding="same")),
                ops.convert_to_numpy(ops.conv(q.reshape(2, LENGTH, -1), table[:3, :, None], padding="valid")),
                *(ops.convert_to_numpy(getattr(keras.activations, name)(table)) for name in AFFECTED),
                ops.convert_to_numpy(ops.reshape(q, (2, LENGTH, 2, HEADS // 2, DEPTH))),
                ops.convert_to_numpy(ops.reshape(table, -1)),
                ops.convert_to_numpy(dense(q.reshape(2, LENGTH, -1)))]  # Layer.__call__, no distribution

    from keras.src.layers.layer import Layer

    functions = (keras_modules.backend_numpy().take, keras_modules.core().slice_update,
                 keras_modules.backend_nn().dot_product_attention, keras_modules.backend_numpy().min,
                 keras_modules.backend_numpy().einsum, Layer.__call__, keras_modules.backend_numpy().argmax,
                 keras_modules.backend_nn().one_hot, keras_modules.backend_numpy().matmul)
    reshape = keras_modules.backend_numpy().reshape
    keras_integration.uninstall()
    before = run()
    assert keras_integration.install()
    try:
        assert keras_modules.backend_numpy().take is not functions[0]
        assert keras_modules.backend_numpy().min is not functions[3]
        assert keras_modules.backend_numpy().einsum is not functions[4]
        assert keras_modules.backend_numpy().argmax is not functions[6]
        assert keras_modules.backend_nn().one_hot is not functions[7]
        assert keras_modules.backend_numpy().matmul is not functions[8]
        assert keras_modules.backend_numpy().reshape is not reshape
        during = run()
    finally:
        keras_integration.uninstall()
    assert (keras_modules.backend_numpy().take, keras_modules.core().slice_update,
            keras_modules.backend_nn().dot_product_attention, keras_modules.backend_numpy().min,
            keras_modules.backend_numpy().einsum, Layer.__call__, keras_modules.backend_numpy().argmax,
            keras_modules.backend_nn().one_hot, keras_modules.backend_numpy().matmul) == functions
    assert keras_modules.backend_numpy().reshape is reshape
    for got, want in zip(during, before):
        np.testing.assert_array_equal(got, want)


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


def _torch_has(defect):
    """Whether the running torch has the upstream-defect table's entry ``defect``."""
    import torch

    from keras_dtensor_mixfix._torch.versions import has_defect

    return has_defect(defect, torch.__version__)


def _as_installed_and_as_on_2_11(defect, reason):
    """The ``as_on_2_11`` parameter of a test of a torch-2.11 workaround: the integration as this torch installs it
    (left out where this torch has ``defect``: ``reason``), and as on 2.11, ``defect`` forced."""
    return pytest.mark.parametrize("as_on_2_11", [
        pytest.param(False, marks=pytest.mark.skipif(_torch_has(defect), reason=reason)), True],
        ids=["as-installed", "as-on-2.11"])


@contextlib.contextmanager
def _installed(defect, as_on_2_11):
    """The integration installed (with ``as_on_2_11``: as on torch 2.11, ``defect`` forced), uninstalled after."""
    from _ranks import forced_defect
    from keras_dtensor_mixfix import keras_integration

    with forced_defect(defect, as_on_2_11):
        assert keras_integration.install()
    try:
        yield
    finally:
        keras_integration.uninstall()


def _placements(spec):
    """DTensor placements from a spec of "R" (replicated) or a tensor dim (split along it), one per mesh dim."""
    from torch.distributed.tensor import Replicate, Shard

    return tuple(Replicate() if p == "R" else Shard(p) for p in spec)


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
    placements = _placements(x_placements)
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

    with _installed("conv_handler_refuses_unsplit", as_on_2_11):
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
    for result in run_on_ranks(convolution_of_split_channels, x, kernel, mesh_shape, _placements(x_placements),
                               _placements(kernel_placements), as_on_2_11, world_size=world_size, timeout=300):
        torch.testing.assert_close(result["out"], out.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["out2"], out2.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["x_grad"], reference_x.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["kernel_grad"], reference_kernel.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["dense_grad"], reference_dense.grad, rtol=1e-5, atol=1e-5)


def attention_output_reshaped(query, key, value, mesh_shape):
    """Keras ``dot_product_attention`` of head-split operands, its output reshaped to (batch, length, heads x depth)
    as keras_hub's attention layers do: the global value and the gradient of ``query``."""
    import keras
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix.testing import mesh

    assert keras_integration.install()
    try:
        device_mesh = mesh(mesh_shape, ("batch", "model"))
        placements = [Shard(0) if mesh_shape[0] > 1 else Replicate(), Shard(2)]  # rows, heads
        q, k, v = (distribute_tensor(t, device_mesh, placements).requires_grad_() for t in (query, key, value))
        out = keras.ops.dot_product_attention(q, k, v, is_causal=True)
        flat = keras.ops.reshape(out, (out.shape[0], out.shape[1], -1))
        (flat * torch.linspace(0.5, 1.5, flat.numel()).reshape(flat.shape)).sum().backward()
        return dict(out=flat.detach().full_tensor(), q_grad=q.grad.full_tensor())
    finally:
        keras_integration.uninstall()


@pytest.mark.parametrize("mesh_shape", [(1, 2), (2, 2)])
def test_attention_output_of_head_split_operands_reshapes_like_single_process(mesh_shape):
    """The attention's output piece is torch's transposed view; reshaping the DTensor made of it failed (``view``
    on a non-contiguous piece: keras_hub's GPT-NeoX)."""
    import keras
    import torch

    torch.manual_seed(0)
    # 4 heads: two on each rank (with one, any stride views)
    query, key, value = (torch.randn(2, LENGTH, 4, DEPTH) for _ in range(3))
    reference_q = query.clone().requires_grad_()
    out = keras.ops.dot_product_attention(reference_q, key, value, is_causal=True)
    flat = keras.ops.reshape(out, (out.shape[0], out.shape[1], -1))
    (flat * torch.linspace(0.5, 1.5, flat.numel()).reshape(flat.shape)).sum().backward()
    for result in run_on_ranks(attention_output_reshaped, query, key, value, mesh_shape,
                               world_size=mesh_shape[0] * mesh_shape[1], timeout=300):
        torch.testing.assert_close(result["out"], flat.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["q_grad"], reference_q.grad, rtol=1e-5, atol=1e-6)


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
    for result in run_on_ranks(activations_of_rows_read_transposed, rows, mesh_shape, _placements(placements),
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
    grad_placements = _placements(gradient_placements) if gradient_placements is not None else None
    for result in run_on_ranks(grouped_reshape, x, mesh_shape, _placements(x_placements), grad_placements, newshape,
                               in_place, world_size=mesh_shape[0] * mesh_shape[1], timeout=300):
        torch.testing.assert_close(result["out"], out.detach(), rtol=0, atol=0)
        torch.testing.assert_close(result["grad"], reference.grad, rtol=1e-6, atol=1e-6)
        assert result["placements"] == _placements(kept)


def stack_of_split_halves(x, as_on_2_11):
    """keras_hub's rotary embedding's ``ops.stack((-x2, x1), axis=-2)`` of a DTensor split along its heads (dim 2),
    on this rank: the global value and the gradient of ``x``. ``as_on_2_11``: the integration installed as on torch
    2.11, whose DTensor places a negative stack axis wrongly (repros/torch_stack_negative_dim.py)."""
    import keras
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from keras_dtensor_mixfix.testing import mesh

    with _installed("stack_negative_dim_misplaced", as_on_2_11):
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

    with _installed("pad_2d_mesh_one_placement", as_on_2_11):
        leaf = distribute_tensor(x, mesh((1, 2), ("batch", "model")), list(placements)).requires_grad_()
        out = keras.ops.pad(leaf, [[0, 0], [3, 0], [0, 2]])
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        return out.detach().full_tensor(), len(out.placements), leaf.grad.full_tensor()


@_as_installed_and_as_on_2_11("pad_2d_mesh_one_placement",
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
    for value, placements, gradient in run_on_ranks(pad_of_a_split_dtensor, x, _placements(("R", split)), as_on_2_11,
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
    with _installed("flip_without_strategy", as_on_2_11):
        leaf = distribute_tensor(x, mesh((1, 2), ("batch", "model")), list(placements)).requires_grad_()
        out = keras.ops.cumsum(leaf, axis=-1)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        return out.detach().full_tensor(), leaf.grad.full_tensor()


@_as_installed_and_as_on_2_11("flip_without_strategy", "torch 2.11 has no strategy for the flip of cumsum's "
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
    for value, gradient in run_on_ranks(cumsum_of_a_split_dtensor, x, _placements(("R", split)), as_on_2_11,
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

    with _installed("ne_tensor_without_strategy", as_on_2_11):
        split = distribute_tensor(ids, mesh((2,), ("batch",)), [Shard(0)])
        return keras.ops.not_equal(split, 0).full_tensor()


@_as_installed_and_as_on_2_11("ne_tensor_without_strategy",
                              "torch 2.11 has no strategy for ne.Tensor (repros/torch_ne_tensor_no_strategy.py)")
def test_not_equal_of_split_ids_equals_single_process(as_on_2_11):
    import torch

    ids = torch.tensor([[3, 0, 5, 0], [0, 7, 7, 1]])
    for value in run_on_ranks(not_equal_of_split_ids, ids, as_on_2_11, world_size=2, timeout=300):
        assert torch.equal(value, ids != 0)

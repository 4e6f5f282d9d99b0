"""Keras' embedding lookup and attention of DTensors (the take and dot_product_attention overrides), eager and
compiled, values and gradients against one process."""

from __future__ import annotations

import math

import pytest
from _keras_ops import DEPTH, LENGTH, VOCAB
from _keras_releases import one_graph

from keras_dtensor_mixfix.testing import run_on_ranks


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

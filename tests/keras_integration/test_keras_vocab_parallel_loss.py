"""Sparse categorical cross-entropy over logits split on the class axis (``_keras/ops/vocab_parallel_loss.py``).

Keras' loss (``keras.losses.SparseCategoricalCrossentropy`` with sample weights, and the per-row
``keras.ops.sparse_categorical_crossentropy``) of DTensor logits on 2 and 4 gloo ranks, (1, 2),
(2, 2) and (1, 4) meshes, even and uneven vocabularies (an empty trailing shard too), targets plain or
split by rows: values AND the logits' gradients equal one process's Keras on plain tensors; the
vocabulary-parallel path is taken (no all-gather of the logits) where it applies, and Keras' own
where it does not (``from_logits=False``); on plain tensors the function is Keras' own, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from _keras_releases import compiles_whole
from keras_dtensor_mixfix.testing import run_on_ranks

ROWS, LENGTH = 4, 6


def _loss(logits, target, weights, from_logits, ignore_class):
    """Keras' summed-over-batch loss with sample weights, and the unweighted per-row loss."""
    import keras

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits, ignore_class=ignore_class)
    # a copy: with a mask (ignore_class) Keras' apply_mask multiplies the weights in place (``sample_weight
    # *= float_mask``, torch backend), and run_on_ranks' workers share the caller's tensor memory
    return loss(target, logits, sample_weight=weights.clone()), keras.ops.sparse_categorical_crossentropy(
        target, logits, from_logits=from_logits)


def _reference(logits, target, weights, from_logits=True, ignore_class=None):
    import torch

    leaf = logits.clone().requires_grad_()
    total, rows = _loss(leaf, target, weights, from_logits, ignore_class)
    (total + (rows * torch.linspace(0.5, 1.5, rows.numel()).reshape(rows.shape)).sum()).backward()
    return total.detach(), rows.detach(), leaf.grad


def sharded_loss(logits, target, weights, mesh_shape, logits_placements, target_placements, from_logits=True,
                 ignore_class=None):
    """On each rank: the loss, the per-row loss and the logits' gradient (whole), the placements of the
    per-row loss, how many times the vocabulary-parallel path ran and the all-gathers of one step."""
    import torch
    from torch.distributed.tensor import distribute_tensor
    from torch.utils._python_dispatch import TorchDispatchMode

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix._keras.ops import vocab_parallel_loss
    from keras_dtensor_mixfix.testing import mesh

    calls, gathers = [0], [0]
    real = vocab_parallel_loss.vocab_parallel_cross_entropy

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    class CountGathers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._overloadpacket.__name__.startswith("all_gather"):
                gathers[0] += 1
            return func(*args, **(kwargs or {}))

    assert keras_integration.install()
    vocab_parallel_loss.vocab_parallel_cross_entropy = counted
    try:
        device_mesh = mesh(mesh_shape, ("batch", "model"))
        leaf = torch.nn.Parameter(distribute_tensor(logits, device_mesh, list(logits_placements)))
        if target_placements is not None:
            target = distribute_tensor(target, device_mesh, list(target_placements))
        with CountGathers():
            total, rows = _loss(leaf, target, weights, from_logits, ignore_class)
            row_weights = torch.linspace(0.5, 1.5, rows.numel()).reshape(rows.shape)  # plain: promoted
            (total + (rows * row_weights).sum()).backward()
        full = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in (total.detach(), rows.detach())]
        return dict(total=full[0], rows=full[1], grad=leaf.grad.full_tensor(), calls=calls[0],
                    gathers=gathers[0], placements=str(tuple(getattr(rows, "placements", ()))))
    finally:
        vocab_parallel_loss.vocab_parallel_cross_entropy = real
        keras_integration.uninstall()


def _data(vocab, seed=0):
    import torch

    torch.manual_seed(seed)
    logits = torch.randn(ROWS, LENGTH, vocab) * 3
    target = torch.randint(0, vocab, (ROWS, LENGTH))
    weights = (torch.rand(ROWS, LENGTH) > 0.3).float()  # a padding mask, as keras_hub's CausalLM passes it
    return logits, target, weights


def _check(results, reference, vocab_parallel=True):
    import torch

    total, rows, grad = reference
    for rank, out in enumerate(results):
        torch.testing.assert_close(out["total"], total, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(out["rows"], rows, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} rows: {m}")
        torch.testing.assert_close(out["grad"], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} grad: {m}")
        if vocab_parallel:
            assert out["calls"] == 2, out  # the weighted loss and the per-row one
            assert out["gathers"] == 0, out  # the logits were never gathered (nor anything else)
        else:
            assert out["calls"] == 0, out


@pytest.mark.parametrize("vocab", [32, 31])
def test_two_ranks_vocabulary_split_equals_single_process(vocab):
    from torch.distributed.tensor import Replicate, Shard

    logits, target, weights = _data(vocab)
    results = run_on_ranks(sharded_loss, logits, target, weights, (1, 2), (Replicate(), Shard(2)), None,
                           world_size=2, timeout=300)
    _check(results, _reference(logits, target, weights))
    assert results[0]["placements"] == "(Replicate(), Replicate())"


def test_four_ranks_2x2_and_1x4_meshes_uneven_and_empty_shards_equal_single_process():
    from torch.distributed.tensor import Replicate, Shard

    cases = [((2, 2), 30, (Shard(0), Shard(2)), (Shard(0), Replicate()), "(Shard(dim=0), Replicate())"),
             ((2, 2), 31, (Shard(0), Shard(2)), None, "(Shard(dim=0), Replicate())"),  # plain targets
             ((2, 2), 31, (Shard(2), Shard(1)), (Replicate(), Shard(1)), "(Replicate(), Shard(dim=1))"),
             ((2, 2), 32, (Replicate(), Shard(2)), None, "(Replicate(), Replicate())"),
             ((1, 4), 13, (Replicate(), Shard(2)), None, "(Replicate(), Replicate())"),  # 4, 4, 4, 1 classes
             ((1, 4), 3, (Replicate(), Shard(2)), None, "(Replicate(), Replicate())")]  # a rank with none
    for mesh_shape, vocab, placements, target_placements, rows_placements in cases:
        logits, target, weights = _data(vocab, seed=vocab)
        results = run_on_ranks(sharded_loss, logits, target, weights, mesh_shape, placements, target_placements,
                               world_size=4, timeout=300)
        _check(results, _reference(logits, target, weights))
        assert results[0]["placements"] == rows_placements, (mesh_shape, placements, results[0]["placements"])


def test_ignore_class_takes_the_vocabulary_parallel_path_from_logits_false_keras_own():
    import torch
    from torch.distributed.tensor import Replicate, Shard

    logits, target, weights = _data(32)
    target[0, :3] = 5
    results = run_on_ranks(sharded_loss, logits, target, weights, (1, 2), (Replicate(), Shard(2)), None,
                           True, 5, world_size=2, timeout=300)
    _check(results, _reference(logits, target, weights, ignore_class=5))
    probabilities = torch.softmax(logits, dim=-1)
    results = run_on_ranks(sharded_loss, probabilities, target, weights, (1, 2), (Replicate(), Shard(2)), None,
                           False, world_size=2, timeout=300)
    _check(results, _reference(probabilities, target, weights, from_logits=False), vocab_parallel=False)


def compiled_sharded_loss(logits, target, weights, mesh_shape, logits_placements):
    """On each rank: the loss and the logits' gradient (whole) from a torch.compile'd step, and the
    collectives in the graphs it compiled (forward and backward, as AOTAutograd hands them over)."""
    import torch
    import torch._dynamo
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch.distributed.tensor import distribute_tensor

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix.testing import mesh

    collectives = []

    def record(graph, example_inputs):
        collectives.extend(node.target.__name__ for node in graph.graph.nodes
                           if node.op == "call_function" and "_c10d_functional" in str(node.target))
        return make_boxed_func(graph.forward)

    torch._dynamo.reset()
    assert keras_integration.install()
    try:
        device_mesh = mesh(mesh_shape, ("batch", "model"))
        leaf = torch.nn.Parameter(distribute_tensor(logits, device_mesh, list(logits_placements)))
        row_weights = torch.linspace(0.5, 1.5, target.numel()).reshape(target.shape)

        def step(leaf, target, weights):
            total, rows = _loss(leaf, target, weights, True, None)
            return total + (rows * row_weights).sum()

        compiled = torch.compile(step, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
        out = compiled(leaf, target, weights)
        out.backward()
        return dict(out=out.detach().full_tensor(), grad=leaf.grad.full_tensor(), collectives=collectives)
    finally:
        keras_integration.uninstall()
        torch._dynamo.reset()


@compiles_whole
@pytest.mark.parametrize("world_size, mesh_shape", [(2, (1, 2)), (4, (2, 2))])
def test_compiled_step_reduces_over_the_class_pieces_without_gathering_them(world_size, mesh_shape):
    import torch
    from torch.distributed.tensor import Replicate, Shard

    logits, target, weights = _data(31, seed=world_size)
    placements = (Replicate(), Shard(2)) if mesh_shape[0] == 1 else (Shard(0), Shard(2))
    results = run_on_ranks(compiled_sharded_loss, logits, target, weights, mesh_shape, placements,
                           world_size=world_size, timeout=600)
    total, rows, grad = _reference(logits, target, weights)
    want = total + (rows * torch.linspace(0.5, 1.5, rows.numel()).reshape(rows.shape)).sum()
    for rank, out in enumerate(results):
        torch.testing.assert_close(out["out"], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}: {m}")
        torch.testing.assert_close(out["grad"], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} grad: {m}")
        # traced through the vocabulary-parallel path: its all-reduces are in the graph, no gather of the logits
        assert any(name.startswith("all_reduce") for name in out["collectives"]), out["collectives"]
        assert not any(name.startswith("all_gather") for name in out["collectives"]), out["collectives"]


def test_loss_is_keras_own_on_plain_tensors():
    """Installed, the wrapper hands plain tensors to Keras' function: the same values and gradients, bit for bit."""
    import keras
    import torch

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix._keras.boundary import keras_modules

    logits, target, weights = _data(32)
    original = keras_modules.backend_nn().sparse_categorical_crossentropy

    def run():
        out = []
        for from_logits, ignore_class in ((True, None), (False, None), (True, 3)):
            source = logits if from_logits else torch.softmax(logits, dim=-1)
            leaf = source.clone().requires_grad_()
            total, rows = _loss(leaf, target, weights, from_logits, ignore_class)
            (total + rows.sum()).backward()
            out += [total.detach().numpy(), rows.detach().numpy(), leaf.grad.numpy()]
        out.append(keras.ops.convert_to_numpy(keras.ops.sparse_categorical_crossentropy(
            target[..., None], logits, from_logits=True)))  # a trailing class axis of 1 on the target
        return out

    keras_integration.uninstall()
    before = run()
    assert keras_integration.install()
    try:
        assert keras_modules.backend_nn().sparse_categorical_crossentropy is not original
        during = run()
    finally:
        keras_integration.uninstall()
    assert keras_modules.backend_nn().sparse_categorical_crossentropy is original
    for got, want in zip(during, before):
        np.testing.assert_array_equal(got, want)

"""Keras ops the integration wraps, in a model: a vocabulary-sharded embedding read twice (a layer norm), attention
with head-sharded projections, ``slice_update`` into a batch-sharded tensor, and reductions over a sharded axis read as
Python numbers, on 2 gloo ranks against one process (values and trained weights); the same model on a (2, 2)
("batch", "model") mesh with keras_hub's kind of layout (weights split over both axes, the batch over "batch"); on
plain tensors the wrapped ops are Keras' own, bit for bit. Each op family's own tests: ``test_keras_ops_*.py``.
"""

from __future__ import annotations

import numpy as np
from _keras_ops import DEPTH, HEADS, LENGTH, VOCAB

from keras_dtensor_mixfix.testing import run_on_ranks


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

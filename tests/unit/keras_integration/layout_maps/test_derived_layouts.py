"""Layout maps derived from a model's own layers, on a one-block transformer written with Keras' public layers (no
keras_hub): tensor-parallel pairs split so the activation between them stays split, the vocabulary split, norms and
the bias after a reduction whole with their reasons, the data axis on the hidden dims, and the fallbacks where heads
or the vocabulary do not divide the model axis. The expectations are the rules of
``_keras/layout_maps/derived_layouts.py``'s docstring, applied by hand to this model."""

from __future__ import annotations

import logging

import pytest

keras = pytest.importorskip("keras")

from keras_dtensor_mixfix.layouts import derive_layouts  # noqa: E402

HIDDEN, FFW = 16, 32


class Block(keras.layers.Layer):
    """Attention (query, key, value, output as EinsumDense) and a feed-forward pair (Dense), pre-norm."""

    def __init__(self, heads, head_dim, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.LayerNormalization(name="norm")
        self.query = keras.layers.EinsumDense("btd,dnh->btnh", (None, heads, head_dim), name="query")
        self.key = keras.layers.EinsumDense("bsd,dnh->bsnh", (None, heads, head_dim), name="key")
        self.value = keras.layers.EinsumDense("bsd,dnh->bsnh", (None, heads, head_dim), name="value")
        self.attention_output = keras.layers.EinsumDense("btnh,nhd->btd", (None, HIDDEN), name="attention_output")
        self.up = keras.layers.Dense(FFW, name="up")
        self.down = keras.layers.Dense(HIDDEN, name="down")

    def call(self, x):
        h = self.norm(x)
        scores = keras.ops.einsum("btnh,bsnh->bnts", self.query(h), self.key(h))
        attended = keras.ops.einsum("bnts,bsnh->btnh", keras.ops.softmax(scores), self.value(h))
        x = x + self.attention_output(attended)
        return x + self.down(keras.ops.relu(self.up(x)))


def _model(vocabulary=64, heads=4, head_dim=4):
    ids = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(vocabulary, HIDDEN, name="token_embedding")(ids)
    x = Block(heads, head_dim, name="block_0")(x)
    return keras.Model(ids, keras.layers.LayerNormalization(name="final_norm")(x), name="tiny")


def _mesh(shape):
    return keras.distribution.DeviceMesh(shape, ["batch", "model"], [f"cpu:{i}" for i in range(shape[0] * shape[1])])


NORM_REASON = "LayerNormalization: a normalization's per-feature weights"
LEFT_WHOLE = {"block_0/down/bias": "a bias added after the split inputs are summed",
              **{f"{norm}/{weight}": NORM_REASON for norm in ("block_0/norm", "final_norm")
                 for weight in ("gamma", "beta")}}


def test_projections_split_in_pairs_the_vocabulary_split_and_the_rest_whole_with_reasons():
    derived = derive_layouts(_model(), _mesh((1, 4)))
    assert derived.axes == {
        "token_embedding/embeddings": ("model", None),  # by vocabulary
        "block_0/query/kernel": (None, "model", None), "block_0/key/kernel": (None, "model", None),
        "block_0/value/kernel": (None, "model", None),  # by heads: they read the hidden state
        "block_0/attention_output/kernel": ("model", None, None),  # writes it back: by heads, its inputs
        "block_0/up/kernel": (None, "model"), "block_0/up/bias": ("model",),  # its outputs, and their bias
        "block_0/down/kernel": ("model", None),  # its inputs
    }
    assert derived.left_whole == LEFT_WHOLE
    # every float32 weight: 3184 floats; the split ones held a quarter each, the whole ones (80 floats) entirely
    assert derived.bytes_per_rank() == ((3104 // 4 + 80) * 4, 3184 * 4)
    # the map it gives ModelParallel says the same
    assert tuple(derived.layout_map["block_0/query/kernel"].axes) == (None, "model", None)


def test_a_data_axis_splits_the_hidden_dim_of_each_split_weight_too():
    derived = derive_layouts(_model(), _mesh((2, 2)))
    assert derived.data_axis == "batch"
    assert derived.axes["block_0/query/kernel"] == ("batch", "model", None)
    assert derived.axes["block_0/attention_output/kernel"] == ("model", None, "batch")
    assert derived.axes["block_0/up/kernel"] == ("batch", "model")
    assert derived.axes["block_0/down/kernel"] == ("model", "batch")
    assert derived.axes["token_embedding/embeddings"] == ("model", "batch")
    assert derived.axes["block_0/up/bias"] == ("model",)  # a vector has no hidden dim
    assert derived.left_whole == LEFT_WHOLE


def test_heads_that_do_not_divide_the_model_axis_split_the_hidden_width_instead_and_say_so(caplog):
    with caplog.at_level(logging.WARNING, logger="keras_dtensor_mixfix"):
        derived = derive_layouts(_model(heads=2, head_dim=8), _mesh((1, 4)))
    for name in ("query", "key", "value"):
        assert derived.axes[f"block_0/{name}/kernel"] == ("model", None, None)
    assert derived.axes["block_0/attention_output/kernel"] == (None, None, "model")
    assert derived.axes["block_0/up/kernel"] == (None, "model")  # the feed-forward pair is unchanged
    assert sum("2 heads do not divide mesh axis 'model' (4 ranks)" in record.getMessage()
               for record in caplog.records) == 4


def test_a_vocabulary_that_does_not_divide_the_model_axis_splits_the_embedding_by_its_hidden_dim(caplog):
    with caplog.at_level(logging.WARNING, logger="keras_dtensor_mixfix"):
        derived = derive_layouts(_model(vocabulary=62), _mesh((1, 4)))
    assert derived.axes["token_embedding/embeddings"] == (None, "model")
    assert any("the vocabulary (62) does not divide mesh axis 'model'" in record.getMessage()
               for record in caplog.records)

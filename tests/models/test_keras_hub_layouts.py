"""``keras_dtensor_mixfix.layouts``: layout maps derived from a model's layers (no ranks: the maps themselves).

That the derived maps train, evaluate, predict and generate like one process for every keras_hub CausalLM is
``tests/models/test_keras_hub.py``'s "derived" cases; here, what the derivation decides and says.
"""

from __future__ import annotations

import logging
import math

import pytest

keras = pytest.importorskip("keras", reason="the layout derivation reads Keras layers")
keras_hub = pytest.importorskip(
    "keras_hub", reason="the derivation is checked on keras_hub backbones (pip install --no-deps keras-hub==0.32.0 "
                        "tokenizers sentencepiece; pip install regex kagglehub grain)", exc_type=ImportError)

from keras_dtensor_mixfix import InvalidArgumentError  # noqa: E402
from keras_dtensor_mixfix.layouts import derive_layouts, layout_map_for  # noqa: E402

TINY = dict(vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=16,
            intermediate_dim=32)


def _mesh(shape):
    return keras.distribution.DeviceMesh(shape, ["batch", "model"], ["cpu:0"] * (shape[0] * shape[1]))


def _axes(layout_map, backbone):
    return {v.path: (layout_map[v.path].axes if layout_map[v.path] is not None else None) for v in backbone.weights}


def test_gemma_map_is_keras_hubs_own():
    mesh = _mesh((2, 2))
    config = dict(TINY, num_key_value_heads=4, head_dim=8)
    derived = layout_map_for(keras_hub.models.GemmaBackbone, mesh, config=config)
    theirs = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    backbone = keras_hub.models.GemmaBackbone(**config)
    assert _axes(derived, backbone) == _axes(theirs, backbone)


def test_llama_map_differs_from_keras_hubs_where_it_moves_less_data():
    """keras_hub's Llama map splits the query/key/value kernels along the hidden dim they contract (a gather of each
    kernel per step to re-split by heads) and leaves the untied output projection whole; the derived map splits
    them by heads and by vocabulary. Every other variable is laid out the same."""
    mesh = _mesh((2, 2))
    backbone = keras_hub.models.LlamaBackbone(**TINY)
    ours = _axes(layout_map_for(backbone, mesh), backbone)
    theirs = _axes(keras_hub.models.LlamaBackbone.get_layout_map(mesh), backbone)
    differ = {path for path in ours if ours[path] != theirs[path]}
    assert differ == {"token_embedding/reverse_embeddings"} | {
        f"transformer_layer_{i}/self_attention/{part}/kernel" for i in range(2) for part in ("query", "key", "value")}
    assert ours["token_embedding/reverse_embeddings"] == ("batch", "model") and theirs[
        "token_embedding/reverse_embeddings"] is None
    assert ours["transformer_layer_0/self_attention/key/kernel"] == ("batch", "model", None)  # (hidden, heads, depth)


def test_a_class_and_config_build_no_weights_and_leave_keras_state_as_it_was():
    from keras_dtensor_mixfix._keras.boundary import keras_modules

    before = keras_modules.uninitialized_variables()
    big = dict(vocabulary_size=32000, num_layers=2, num_query_heads=16, num_key_value_heads=4, hidden_dim=2048,
               intermediate_dim=8192)  # 0.5 GB of float32 weights if they were made
    derived = derive_layouts(keras_hub.models.Llama3CausalLM, _mesh((1, 2)), config=big)  # a task class: its backbone
    assert derived.axes["token_embedding/embeddings"] == ("model", None)  # "batch" has one rank: nothing to split
    assert keras_modules.uninitialized_variables() == before  # nothing left for Keras' next scope to initialize
    assert keras.distribution.distribution() is None


def test_keys_match_the_layers_of_a_model_built_again_with_other_names():
    """Keras numbers repeated layer names per session (``qwen_sparse_moe_block``, then ``qwen_sparse_moe_block_2``):
    a map derived from one build lays out the next one."""
    config = dict(TINY, moe_intermediate_dim=8, shared_expert_intermediate_dim=32, num_experts=4, top_k=2)
    derived = derive_layouts(keras_hub.models.QwenMoeBackbone, _mesh((1, 2)), config=config)
    again = keras_hub.models.QwenMoeBackbone(**config)
    split = [v.path for v in again.weights if derived.layout_map[v.path] is not None]
    assert len(split) == len(derived.axes) and any("experts" in path for path in split), split
    assert not set(split) & set(derived.left_whole)


def test_heads_vocabulary_or_experts_that_do_not_divide_split_another_dim_with_one_warning(caplog):
    mesh = _mesh((1, 4))
    config = dict(TINY, moe_intermediate_dim=8, num_experts=6, top_k=2, head_dim=4, vocabulary_size=66)
    with caplog.at_level(logging.WARNING, logger="keras_dtensor_mixfix"):
        derived = derive_layouts(keras_hub.models.Qwen3MoeBackbone, mesh, config=config)
        derive_layouts(keras_hub.models.Qwen3MoeBackbone, mesh, config=config)  # the same warnings: not again
    warnings = [record.getMessage() for record in caplog.records]
    assert sum("key: its 2 heads do not divide mesh axis 'model' (4 ranks), so its kernel is split along the hidden "
               "width (16) instead" in w for w in warnings) == 1, warnings
    assert sum("6 experts do not divide mesh axis 'model' (4 ranks), so each expert's weights are split along its "
               "own width" in w for w in warnings) == 1, warnings
    assert sum("the vocabulary (66) does not divide" in w and "padded to a multiple of 4" in w
               for w in warnings) == 1, warnings
    # (hidden, heads, depth): the 2 key heads do not divide 4, the hidden width does
    assert derived.axes["transformer_layer_0/self_attention/key/kernel"] == ("model", None, None)
    assert derived.axes["transformer_layer_0/self_attention/query/kernel"] == (None, "model", None)  # 4 heads divide
    assert derived.axes["token_embedding/embeddings"] == (None, "model")  # along the hidden dim instead
    experts = {path: axes for path, axes in derived.axes.items() if "layer_0" in path and "expert" in path}
    assert experts and all(axes[0] is None and "model" in axes for axes in experts.values()), experts
    assert not any("heads do not divide" in why or "experts do not divide" in why
                   for why in derived.left_whole.values() if "bias" not in why)
    # on (2, 2) the hidden dims go over "batch" too, unless told not to
    assert any("batch" in axes for axes in derive_layouts(keras_hub.models.Qwen3MoeBackbone, _mesh((2, 2)),
                                                         config=config).axes.values())
    plain = derive_layouts(keras_hub.models.Qwen3MoeBackbone, _mesh((2, 2)), config=config, data_axis=None)
    assert all("batch" not in axes for axes in plain.axes.values())


def test_where_nothing_divides_the_model_axis_weights_stay_whole_with_the_reason():
    config = dict(TINY, moe_intermediate_dim=8, num_experts=6, top_k=2, head_dim=4)
    derived = derive_layouts(keras_hub.models.Qwen3MoeBackbone, _mesh((1, 32)), config=config)  # hidden 16 < 32
    assert derived.left_whole["transformer_layer_0/self_attention/key/kernel"] == (
        "key: its 2 heads do not divide mesh axis 'model' (32 ranks)")
    assert any(why == "6 experts do not divide mesh axis 'model' (32 ranks)" for why in derived.left_whole.values())
    per_rank, whole = derived.bytes_per_rank()
    assert per_rank > whole / 32


PUBLISHED = {
    # published sizes (shapes only: nothing is made), 2 layers: the per-rank share does not depend on the depth
    "llama3_8b": ("Llama3Backbone", dict(vocabulary_size=128256, num_layers=2, num_query_heads=32,
                                         num_key_value_heads=8, hidden_dim=4096, intermediate_dim=14336)),
    "mixtral_8x7b": ("MixtralBackbone", dict(vocabulary_size=32000, num_layers=2, num_query_heads=32,
                                             num_key_value_heads=8, hidden_dim=4096, intermediate_dim=14336,
                                             num_experts=8, top_k=2, sliding_window=4096)),
}


@pytest.mark.parametrize("model", sorted(PUBLISHED))
@pytest.mark.parametrize("shape", [(1, 2), (1, 8), (1, 16), (1, 64), (8, 64)], ids=lambda s: "x".join(map(str, s)))
def test_published_sizes_hold_one_nth_per_rank_at_every_degree(model, shape):
    """Each rank's bytes of the weights under the derived map, against one process's / n (benchmarks/
    layouts_at_scale.py prints the table for eight models): at most 5% over, where 8 key/value heads or 8 experts do
    not divide 16 or 64 ranks (their kernels split along another dim)."""
    class_name, config = PUBLISHED[model]
    derived = derive_layouts(getattr(keras_hub.models, class_name), _mesh(shape), config=config)
    per_rank, whole = derived.bytes_per_rank()
    n = shape[0] * shape[1]
    expected_whole = sum(math.prod(dims) * 4 for dims, dtype in derived.variables.values())  # float32
    assert whole == expected_whole
    assert whole / n <= per_rank <= 1.05 * whole / n, (per_rank, whole / n)


def test_every_weight_is_split_or_left_whole_with_a_reason():
    backbone = keras_hub.models.LlamaBackbone(**TINY)
    derived = derive_layouts(backbone, _mesh((1, 2)))
    assert set(derived.axes) | set(derived.left_whole) == {v.path for v in backbone.weights}
    assert all(derived.left_whole.values())
    assert derived.left_whole["transformer_layer_0/self_attention_layernorm/scale"].endswith(
        "a normalization's per-feature weights")


def test_bad_input_is_named():
    mesh = _mesh((1, 2))
    with pytest.raises(InvalidArgumentError, match=r"model_axis='tensor' is not an axis of the mesh \('batch', "
                                                   r"'model'\)"):
        layout_map_for(keras_hub.models.LlamaBackbone, mesh, config=TINY, model_axis="tensor")
    with pytest.raises(InvalidArgumentError, match="data_axis='model' must be an axis of the mesh"):
        layout_map_for(keras_hub.models.LlamaBackbone, mesh, config=TINY, data_axis="model")
    backbone = keras_hub.models.LlamaBackbone(**TINY)
    with pytest.raises(InvalidArgumentError, match="config= is for a model class"):
        layout_map_for(backbone, mesh, config=TINY)
    with pytest.raises(InvalidArgumentError, match="has no weights yet; build it first"):
        layout_map_for(keras.layers.Dense(4), mesh)
    with pytest.raises(InvalidArgumentError, match="has no Embedding layer"):
        dense = keras.layers.Dense(4)
        dense.build((None, 3))
        layout_map_for(dense, mesh)

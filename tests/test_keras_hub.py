"""keras_hub causal LMs (tiny random configs) under ModelParallel on 2 gloo ranks, against one process.

Each model is sharded with its backbone's own ``get_layout_map(mesh)`` on a (1, 2) ("batch",
"model") mesh; ``train_on_batch`` (losses, metrics and the trained weights), ``predict_on_batch``
and greedy ``generate()`` must equal the same model trained and run in a single process.
"""

from __future__ import annotations

import numpy as np
import pytest

from keras_dtensor_mixfix.testing import run_on_ranks

# ImportError too: keras_hub 0.32 does not import on keras-nightly 3.16 (no keras.src.backend.get_keras_mask)
keras_hub = pytest.importorskip(
    "keras_hub", reason="needs keras_hub (pip install --no-deps keras-hub==0.32.0 tokenizers sentencepiece; "
                        "pip install regex kagglehub) on a Keras it supports (3.15.1)", exc_type=ImportError)

TINY = dict(vocabulary_size=64, num_layers=2, num_query_heads=2, num_key_value_heads=2, hidden_dim=16,
            intermediate_dim=32)
MODELS = {
    "gemma": ("GemmaBackbone", "GemmaCausalLM", dict(TINY, head_dim=8)),
    "llama3": ("Llama3Backbone", "Llama3CausalLM", TINY),
    "qwen": ("QwenBackbone", "QwenCausalLM", TINY),
}


def _batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, size=(2, 8)).astype("int32")
    mask = np.ones((2, 8), bool)
    mask[1, 6:] = False
    prompt_mask = mask.copy()
    prompt_mask[:, 4:] = False  # generate() fills positions 4..7
    return ids, mask, prompt_mask


def _causal_lm(name):
    import keras

    backbone_name, lm_name, config = MODELS[name]
    keras.utils.set_random_seed(0)
    backbone = getattr(keras_hub.models, backbone_name)(**config)
    lm = getattr(keras_hub.models, lm_name)(backbone=backbone, preprocessor=None)
    lm.compile(optimizer=keras.optimizers.Adam(0.01),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), sampler="greedy")
    return lm


def _run(lm, initial=None):
    if initial is not None:
        lm.set_weights(initial)
    ids, mask, prompt_mask = _batch()
    x = {"token_ids": ids, "padding_mask": mask}
    out = {"initial": lm.get_weights()}
    out["logs"] = [np.atleast_1d(np.asarray(lm.train_on_batch(x, ids, sample_weight=mask.astype("float32")),
                                            dtype="float64")) for _ in range(2)]
    out["trained"] = lm.get_weights()
    out["predicted"] = np.asarray(lm.predict_on_batch(x))
    generated = lm.generate({"token_ids": ids * prompt_mask, "padding_mask": prompt_mask}, stop_token_ids=None)
    out["generated"] = np.asarray(generated["token_ids"])
    return out


def sharded_causal_lm(name):
    import keras
    from torch.distributed.tensor import DTensor, Shard

    from keras_dtensor_mixfix import keras_integration

    assert keras_integration.install()
    try:
        devices = keras.distribution.list_devices()
        mesh = keras.distribution.DeviceMesh((1, len(devices)), ["batch", "model"], devices)
        layout_map = getattr(keras_hub.models, MODELS[name][0]).get_layout_map(mesh)
        keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                             batch_dim_name="batch"))
        lm = _causal_lm(name)
        out = _run(lm)
        out["sharded"] = sorted(v.path for v in lm.weights if isinstance(v.value, DTensor)
                                and any(isinstance(p, Shard) for p in v.value.placements))
    finally:
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
        keras.backend.clear_session()
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_parallel_causal_lm_equals_single_process(name):
    per_rank = run_on_ranks(sharded_causal_lm, name, world_size=2, timeout=900)
    out = per_rank[0]
    assert any("embeddings" in path for path in out["sharded"]), out["sharded"]  # vocabulary-sharded table
    assert any("decoder" in path or "transformer" in path for path in out["sharded"]), out["sharded"]
    reference = _run(_causal_lm(name), initial=out["initial"])
    for got, want in zip(out["logs"], reference["logs"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for got, want in zip(out["trained"], reference["trained"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["predicted"], reference["predicted"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out["generated"], reference["generated"])
    np.testing.assert_array_equal(per_rank[1]["generated"], out["generated"])  # every rank holds the tokens

"""keras_hub causal LMs compiled (``jit_compile=True``: inductor, static shapes) under ModelParallel on 2 ranks.

Each model (Gemma, Qwen, Llama3, Qwen MoE, Qwen3 MoE: ``tests/models/test_keras_hub.py``'s tiny config, one layer)
is built twice on a (1, 2) ("batch", "model") mesh (Gemma also on (2, 2), 4 ranks) with its backbone's
``get_layout_map``, from the same seed: once eager, once compiled. Three
``train_on_batch`` steps each; the compiled losses and trained weights must equal the eager sharded run's
(float32, rtol 1e-5: inductor fuses and reorders the same sums).

Slow: the first compiled step takes a minute or more per model (TorchDynamo traces every layer, inductor
compiles the step; the six cases: about 11 minutes on a 2-core machine). Skipped unless ``MIXFIX_TEST_SLOW=1``:

    MIXFIX_TEST_SLOW=1 KERAS_BACKEND=torch python -m pytest tests/models/test_keras_hub_compiled.py
"""

from __future__ import annotations

import traceback

import numpy as np
import pytest

from keras_dtensor_mixfix.testing import run_on_ranks

keras_hub = pytest.importorskip(
    "keras_hub", reason="needs keras_hub (pip install --no-deps keras-hub==0.32.0 tokenizers sentencepiece; "
                        "pip install regex kagglehub grain) on a Keras it supports (3.15.1)", exc_type=ImportError)

from test_keras_hub import MODELS, _distribution  # noqa: E402

pytestmark = pytest.mark.slow(reason="minutes per model (TorchDynamo traces Keras' layers)")

STEPS = 3


def _causal_lm(name, jit_compile):
    import keras

    backbone_name, lm_name, config = MODELS[name]
    keras.utils.set_random_seed(0)
    backbone = getattr(keras_hub.models, backbone_name)(**dict(config, num_layers=1))
    lm = getattr(keras_hub.models, lm_name)(backbone=backbone, preprocessor=None)
    lm.compile(optimizer=keras.optimizers.Adam(0.01, epsilon=1e-4),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit_compile)
    return lm


def eager_and_compiled(name, mesh_shape):
    """On this rank: ``{"eager"|"compiled": (losses, trained weights)}``, or the traceback."""
    import keras
    import torch

    from keras_dtensor_mixfix import keras_integration

    assert keras_integration.install()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, size=(4, 8)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones(ids.shape, bool)}
    out = {}
    try:
        for variant, jit_compile in (("eager", False), ("compiled", True)):
            keras.distribution.set_distribution(_distribution(name, "model_parallel", mesh_shape))
            lm = _causal_lm(name, jit_compile)
            losses = []
            for _ in range(STEPS):
                logs = lm.train_on_batch(x, ids)
                losses.append(float(logs[0] if isinstance(logs, (list, tuple)) else logs))
            out[variant] = (losses, lm.get_weights())
            keras.distribution.set_distribution(None)
    except Exception:  # noqa: BLE001 - the traceback goes back to the test
        return traceback.format_exc()
    finally:
        keras.distribution.set_distribution(None)
        keras_integration.uninstall()
    return out


@pytest.mark.parametrize("name, mesh_shape", [("gemma", (1, 2)), ("qwen", (1, 2)), ("llama3", (1, 2)),
                                              ("qwen_moe", (1, 2)), ("qwen3_moe", (1, 2)), ("gemma", (2, 2))])
def test_compiled_causal_lm_equals_eager_sharded_run(name, mesh_shape):
    world_size = mesh_shape[0] * mesh_shape[1]
    for rank, out in enumerate(run_on_ranks(eager_and_compiled, name, mesh_shape, world_size=world_size,
                                            timeout=1500)):
        assert isinstance(out, dict), f"rank {rank} raised:\n{out}"
        (eager_losses, eager_weights), (losses, weights) = out["eager"], out["compiled"]
        np.testing.assert_allclose(losses, eager_losses, rtol=1e-5, err_msg=f"rank {rank}")
        assert len(weights) == len(eager_weights)
        for got, want in zip(weights, eager_weights):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}")

"""The Keras workers of ``benchmarks/gpu_check.py`` (rows 4 and 5): a keras_hub Gemma in a process of its own.

    python benchmarks/gpu_check_keras.py '{"backend": "torch", "mesh": true, "jit": false, "device": "cuda", ...}'

prints one JSON line. ``KERAS_BACKEND`` is set from the spec before Keras is imported. A torch worker with ``mesh``
starts a one-rank process group (NCCL on cuda, gloo on cpu), installs the Keras integration and sets
``ModelParallel`` on a (1, 1) ("batch", "model") mesh with the layout map the package derives from Gemma
(``keras_dtensor_mixfix.layouts.layout_map_for``), its variables DTensors (``gpu_check.py`` sets
``KERAS_DTENSOR_MIXFIX_DTENSORS_ON_ONE_DEVICE=1``, checked here: by default a one-device mesh holds Keras' own plain
tensors); without ``mesh`` nothing of the package is installed. With
``correctness`` it runs a tiny Gemma (fixed weights and data) through fit (2 epochs of one batch), evaluate, predict
and greedy generate and returns every value; with ``timing`` it times ``train_on_batch`` at that size for each of
``dtypes``. fit/evaluate/predict are Keras' own (``keras.Model.fit``): with ``preprocessor=None`` keras_hub's only
batch the arrays, with grain, which the GPU machine lacks.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

TINY = dict(vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=4, hidden_dim=16,
            intermediate_dim=32, head_dim=8)
"""tests/models/test_keras_hub.py's tiny Gemma."""
SIZES = {
    # the correctness model, timed as it is (dispatch-bound: what the package adds per op shows)
    "small": dict(config=TINY, batch=4, length=8, steps=8),
    # Gemma-like, compute-bound on an H100 (~2 TFLOP per step)
    "compute": dict(config=dict(vocabulary_size=16384, num_layers=4, num_query_heads=8, num_key_value_heads=8,
                                hidden_dim=1024, intermediate_dim=8192, head_dim=128), batch=8, length=512, steps=10),
}
PROMPT_LENGTHS = (3, 5, 2, 4)


def _mesh_distribution(device: str, config: Dict[str, Any]) -> Any:
    import keras
    import torch
    import torch.distributed as dist

    from keras_dtensor_mixfix import keras_integration
    from keras_dtensor_mixfix.layouts import layout_map_for

    if not dist.is_initialized():
        if device == "cuda":
            torch.cuda.set_device(0)
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                    device_id=torch.device("cuda", 0))
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert keras_integration.install(), "the Keras integration did not install"
    import keras_hub

    mesh = keras.distribution.DeviceMesh((1, 1), ["batch", "model"], keras.distribution.list_devices())
    layout_map = layout_map_for(keras_hub.models.GemmaBackbone, mesh, config=config)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def _gemma(spec: Dict[str, Any], config: Dict[str, Any]) -> Any:
    """A GemmaCausalLM (no preprocessor) with fixed weights: the same in every worker, whatever initializers draw."""
    import keras
    import keras_hub
    import numpy as np

    if spec["mesh"]:
        keras.distribution.set_distribution(_mesh_distribution(spec["device"], config))
    keras.utils.set_random_seed(0)
    lm = keras_hub.models.GemmaCausalLM(backbone=keras_hub.models.GemmaBackbone(**config), preprocessor=None)
    rng = np.random.default_rng(0)
    lm.set_weights([(rng.normal(size=w.shape) * 0.1).astype(w.dtype) for w in lm.get_weights()])
    if spec["mesh"] and os.environ.get("KERAS_DTENSOR_MIXFIX_DTENSORS_ON_ONE_DEVICE") == "1":
        from torch.distributed.tensor import DTensor

        assert all(isinstance(w.value, DTensor) for w in lm.weights), "the mesh worker's variables are not DTensors"
    lm.compile(optimizer=keras.optimizers.Adam(0.01, epsilon=1e-4),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), sampler="greedy",
               jit_compile=spec["jit"])
    return lm


def _data(batch: int, length: int, vocabulary: int) -> Any:
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocabulary, size=(batch, length)).astype("int32")
    mask = np.ones(ids.shape, bool)
    mask[1, length - 2:] = False
    return {"token_ids": ids, "padding_mask": mask}, ids


def correctness(spec: Dict[str, Any]) -> Dict[str, Any]:
    import keras
    import numpy as np

    lm = _gemma(spec, TINY)
    x, y = _data(4, 8, TINY["vocabulary_size"])
    weights = x["padding_mask"].astype("float32")
    history = keras.Model.fit.__get__(lm)(x, y, sample_weight=weights, batch_size=4, epochs=2, shuffle=False, verbose=0)
    evaluated = keras.Model.evaluate.__get__(lm)(x, y, sample_weight=weights, batch_size=4, verbose=0, return_dict=True)
    predicted = keras.Model.predict.__get__(lm)(x, batch_size=4, verbose=0)
    prompt_mask = np.arange(8)[None, :] < np.asarray(PROMPT_LENGTHS)[:, None]
    generated = lm.generate({"token_ids": x["token_ids"] * prompt_mask, "padding_mask": prompt_mask},
                            stop_token_ids=None)
    out = {"fit": history.history["loss"], "evaluate": [float(v) for v in evaluated.values()],
           "predict": np.asarray(predicted, "float64").tolist(),
           "generate": np.asarray(generated["token_ids"]).tolist(),
           "weights": [np.asarray(w, "float64").ravel().tolist() for w in lm.get_weights()]}
    keras.distribution.set_distribution(None)
    keras.backend.clear_session()
    return out


def timing(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Per dtype: the first ``train_on_batch`` (compiling included) and the median of the later ones, in ms."""
    import keras

    size = SIZES[spec["timing"]]
    times: Dict[str, Any] = {}
    for dtype in spec["dtypes"]:
        keras.config.set_dtype_policy("mixed_bfloat16" if dtype == "bfloat16" else "float32")
        try:
            lm = _gemma(spec, size["config"])
            x, y = _data(size["batch"], size["length"], size["config"]["vocabulary_size"])
            start = time.perf_counter()
            lm.train_on_batch(x, y)  # returns NumPy: the device has finished the step
            first = (time.perf_counter() - start) * 1e3
            steps: List[float] = []
            for _ in range(size["steps"]):
                start = time.perf_counter()
                lm.train_on_batch(x, y)
                steps.append((time.perf_counter() - start) * 1e3)
            times[dtype] = {"first_ms": first, "step_ms": statistics.median(steps[1:])}
        finally:
            keras.config.set_dtype_policy("float32")
            keras.distribution.set_distribution(None)
            keras.backend.clear_session()
    return times


def main(spec: Dict[str, Any]) -> Dict[str, Any]:
    os.environ["KERAS_BACKEND"] = spec["backend"]
    out: Dict[str, Any] = {}
    if spec.get("correctness"):
        out["correctness"] = correctness(spec)
    if spec.get("timing"):
        out["timing"] = timing(spec)
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))

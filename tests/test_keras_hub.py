"""keras_hub causal LMs (tiny random configs) on 2 and 4 gloo ranks, against one process.

Every backbone of keras-hub 0.32.0 that ships ``get_layout_map`` (Gemma, Llama, Llama3, Qwen, Qwen
MoE, Qwen3 MoE), each under

- ``ModelParallel`` with its backbone's own ``get_layout_map(mesh)`` on a ("batch", "model") mesh
  of (1, 2) (2 ranks) and (2, 2) (4 ranks: the batch split over "batch", the weights over both
  axes as the map says, the vocabulary too), and
- ``DataParallel()`` (replicated weights, the batch split over the 2 or 4 ranks),

run ``fit`` (two epochs of one batch), one ``train_on_batch``, ``evaluate``, ``predict`` and
greedy ``generate()`` on prompts of different lengths. Losses, metrics, the trained weights
(``get_weights``), the predictions and the generated tokens must equal the same model run in a
single process built with the same seed (the same initial weights, checked; float32, rtol 1e-5).

The cases of one world size run in one ``run_on_ranks`` call (starting ranks costs seconds);
each case is checked by its own test. ``MIXFIX_TEST_MESHES="2x4,4x2"`` adds
ModelParallel meshes (8 ranks: slow, documented in docs/keras.md, not in CI).
"""

from __future__ import annotations

import os
import traceback

import numpy as np
import pytest

from keras_dtensor_mixfix.testing import run_on_ranks

# ImportError too: keras_hub 0.32 does not import on keras-nightly 3.16 (no keras.src.backend.get_keras_mask)
keras_hub = pytest.importorskip(
    "keras_hub", reason="needs keras_hub (pip install --no-deps keras-hub==0.32.0 tokenizers sentencepiece; "
                        "pip install regex kagglehub grain) on a Keras it supports (3.15.1)", exc_type=ImportError)

# The smallest configs whose sharded dims divide by 4: vocabulary 64, hidden 16, 4 query heads,
# intermediate 32. Gemma shards its key/value kernels on the heads axis, so it keeps 4 of them;
# Llama3 and Qwen shard theirs on the hidden axis and use grouped-query attention (2 key/value heads).
TINY = dict(vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=16,
            intermediate_dim=32)
MODELS = {
    "gemma": ("GemmaBackbone", "GemmaCausalLM", dict(TINY, num_key_value_heads=4, head_dim=8)),
    "llama": ("LlamaBackbone", "LlamaCausalLM", TINY),
    "llama3": ("Llama3Backbone", "Llama3CausalLM", TINY),
    "qwen": ("QwenBackbone", "QwenCausalLM", TINY),
    # every layer sparse (4 experts, top 2) beside a shared expert that the layout map shards
    "qwen_moe": ("QwenMoeBackbone", "QwenMoeCausalLM",
                 dict(TINY, moe_intermediate_dim=8, shared_expert_intermediate_dim=32, num_experts=4, top_k=2)),
    "qwen3_moe": ("Qwen3MoeBackbone", "Qwen3MoeCausalLM",
                  dict(TINY, moe_intermediate_dim=8, num_experts=4, top_k=2, head_dim=4)),
}

def _layouts():
    """(mode, mesh shape) pairs; the world size is the product of the shape. DataParallel's "shape"
    is just its rank count."""
    layouts = [("model_parallel", (1, 2)), ("model_parallel", (2, 2)), ("data_parallel", (2,)),
               ("data_parallel", (4,))]
    extra = os.environ.get("MIXFIX_TEST_MESHES", "")
    layouts += [("model_parallel", tuple(int(n) for n in shape.split("x"))) for shape in extra.split(",") if shape]
    return layouts


LAYOUTS = _layouts()
CASES = [(name, mode, shape) for name in sorted(MODELS) for mode, shape in LAYOUTS]
# Llama3 under keras_hub's map with the tensor-parallel rules docs/keras.md gives for speed ("Speed"): the
# query/key/value kernels split by heads and the untied output projection by vocabulary (vocabulary-split logits:
# the loss over each rank's classes)
TENSOR_PARALLEL_RULES = {
    "transformer_layer.*self_attention.*(query|key|value).kernel": ("batch", "model", None),
    "token_embedding/reverse_embeddings": ("batch", "model"),
}
CASES += [("llama3", "model_parallel_tp", (1, 2)), ("llama3", "model_parallel_tp", (2, 2))]
# keras_hub's SmolLM3 has no get_layout_map: a map written after Llama's, by hand (issue 32 derives them). On (2, 2)
# its RMSNormalization met activations split along the hidden dim over "batch" (Keras' build call and generate())
# and failed in torch's F.rms_norm ("aten.add_.Scalar: in-place operations that require placement changes")
HAND_MAPS = {
    "smollm3": {
        "token_embedding/embeddings": ("model", "batch"),
        ".*(q_proj|k_proj|v_proj)/kernel": ("batch", "model"),  # (hidden, heads x head_dim): by heads
        ".*o_proj/kernel": ("model", None, "batch"),  # (heads, head_dim, hidden)
        ".*(gate_proj|up_proj)/kernel": ("batch", "model"),
        ".*down_proj/kernel": ("model", "batch"),
    },
}
MODELS["smollm3"] = ("SmolLM3Backbone", "SmolLM3CausalLM", dict(
    vocabulary_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_dim=16,
    intermediate_dim=32, attention_bias=False, attention_dropout=0.0, rope_layer_enabled_list=[True, True],
    layer_types=["attention", "attention"], mlp_bias=False, layer_norm_epsilon=1e-6, max_position_embeddings=64,
    rope_theta=10000.0, partial_rotary_factor=1.0))
CASES += [("smollm3", "model_parallel", (1, 2)), ("smollm3", "model_parallel", (2, 2))]
# the attention kernels' layer names, where they are not keras_hub's usual query, key, value, attention_output
ATTENTION_PARTS = {"smollm3": ("q_proj", "k_proj", "v_proj", "o_proj")}
# Gemma on a (1, 4) mesh too: it failed on Keras 3.16 in DTensor's backward ("shape '[4, 8, 8, 4, 1]' is invalid
# for input of size 256") before attention ran on local pieces there
CASES.append(("gemma", "model_parallel", (1, 4)))
# kernels per block that get_layout_map shards on the "model" axis: query, key, value, attention output
# and three feed-forward kernels; Qwen MoE's map also matches its router ("sparse_feedforward_gate_dense");
# Qwen3 MoE's sparse blocks have no dense feed-forward kernels, only that router
SHARDED_PER_BLOCK = dict(gemma=7, llama=7, llama3=7, qwen=7, qwen_moe=8, qwen3_moe=5, smollm3=7)
PROMPT_LENGTHS = (3, 5, 2, 4)  # generate() fills each row from its own length up to 8


def _batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, size=(4, 8)).astype("int32")
    mask = np.ones((4, 8), bool)
    mask[1, 6:] = False
    mask[3, 5:] = False
    prompt_mask = np.arange(8)[None, :] < np.asarray(PROMPT_LENGTHS)[:, None]
    return ids, mask, prompt_mask


def _causal_lm(name, optimizer="adam", per_process_losses=False):
    import keras

    backbone_name, lm_name, config = MODELS[name]
    if per_process_losses and "num_experts" in config:
        # A mixture of experts adds a load-balancing loss over the whole batch (how its tokens spread over the
        # experts), which does not split into per-row terms: under DistributedDataParallel (Keras 3.16's
        # DataParallel) each process computes it over its own rows, so training differs from one process
        # (Qwen MoE, 2 ranks, measured: trained weights 9e-4 apart). That is DDP's meaning, not an error; the
        # comparison with one process is made without that loss (then 1e-8 apart).
        config = dict(config, router_aux_loss_coefficient=0.0)
    keras.utils.set_random_seed(0)
    backbone = getattr(keras_hub.models, backbone_name)(**config)
    lm = getattr(keras_hub.models, lm_name)(backbone=backbone, preprocessor=None)
    # Adam's epsilon raised from 1e-7: tensor-parallel partial sums add in another order than one process,
    # and Adam's m / (sqrt(v) + epsilon) turns float32 rounding in near-zero gradients into visible steps
    # (measured on Gemma: trained weights 6e-5 apart with 1e-7, 4e-7 with SGD)
    adam = keras.optimizers.Adam(0.01, epsilon=1e-4)
    lm.compile(optimizer=adam if optimizer == "adam" else keras.optimizers.SGD(0.5),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), sampler="greedy")
    return lm


def _pipeline():
    try:
        import grain  # noqa: F401
    except ImportError:
        return "keras"
    return "grain"


def _through(lm, method):
    """keras_hub's own ``fit``/``predict`` (NumPy inputs batched by grain), or without grain Keras'
    own: the same steps, since with ``preprocessor=None`` keras_hub only batches the arrays."""
    import keras

    if _pipeline() == "grain":
        return getattr(lm, method)
    return getattr(keras.Model, method).__get__(lm)


def _run(lm, initial=None, rows=slice(None)):
    """fit (2 epochs of one batch), train_on_batch, evaluate, predict and generate; every value global NumPy,
    but for ``predict``: the predictions of ``rows``, the rows this process feeds (all of them, unless Keras
    takes each process's batch as its own shard: ``_own_rows``)."""
    if initial is not None:
        lm.set_weights(initial)
    all_ids, all_mask, prompt_mask = _batch()
    ids, mask = all_ids[rows], all_mask[rows]
    x = {"token_ids": ids, "padding_mask": mask}
    weights = mask.astype("float32")
    batch_size = len(ids)  # one batch: the global one, or this process's shard of it
    out = {"initial": lm.get_weights(), "pipeline": _pipeline(), "rows": rows}
    history = _through(lm, "fit")(x, ids, sample_weight=weights, batch_size=batch_size, epochs=2, shuffle=False,
                                  verbose=0)
    out["history"] = {key: np.asarray(values, "float64") for key, values in history.history.items()}
    out["logs"] = np.atleast_1d(np.asarray(lm.train_on_batch(x, ids, sample_weight=weights), "float64"))
    out["trained"] = lm.get_weights()
    evaluated = _through(lm, "evaluate")(x, ids, sample_weight=weights, batch_size=batch_size, verbose=0,
                                         return_dict=True)
    out["evaluated"] = {key: np.float64(value) for key, value in evaluated.items()}
    out["predicted"] = np.asarray(_through(lm, "predict")(x, batch_size=batch_size, verbose=0))
    # generate() runs outside the trainer's data distribution: every process asks for every prompt
    ids = all_ids
    generated = lm.generate({"token_ids": ids * prompt_mask, "padding_mask": prompt_mask}, stop_token_ids=None)
    out["generated"] = np.asarray(generated["token_ids"])
    return out


def _distribution(name, mode, mesh_shape):
    import keras

    devices = keras.distribution.list_devices()
    if mode == "data_parallel":
        distribution = keras.distribution.DataParallel()
    else:
        mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"], devices)
        if name in HAND_MAPS:
            layout_map = keras.distribution.LayoutMap(mesh)
            for key, axes in HAND_MAPS[name].items():
                layout_map[key] = axes
        else:
            layout_map = getattr(keras_hub.models, MODELS[name][0]).get_layout_map(mesh)
        if mode == "model_parallel_tp":
            for key, axes in TENSOR_PARALLEL_RULES.items():
                if key in list(layout_map):  # the keys as written (`in` matches paths by regex)
                    del layout_map[key]
                layout_map[key] = axes
        distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    if _keras_has_own_torch_distribution():
        # Keras 3.16 takes each process's batch as its own shard (``_own_rows``) and refuses NumPy input on
        # several processes unless told that it is
        distribution.auto_shard_dataset = False
    return distribution


def _per_process_losses(mode):
    """Whether each process computes the loss over its own rows alone: Keras 3.16's DataParallel, which is
    torch's DistributedDataParallel (the package's, and every ModelParallel, compute it over the global batch)."""
    return mode == "data_parallel" and _keras_has_own_torch_distribution()


def _own_rows(mode, mesh_shape):
    """The batch rows this process feeds: all of them (the package's convention on Keras 3.15.1: each process
    feeds the global batch and keeps its slice), or on Keras 3.16 its own shard: the rows of its coordinate on
    the batch axis (under ModelParallel consecutive ranks share one, as ``DeviceMesh`` lays devices out)."""
    import torch.distributed as dist

    if not _keras_has_own_torch_distribution():
        return slice(None)
    shards, ranks_per_shard = (mesh_shape[0], mesh_shape[1]) if mode.startswith("model_parallel") else (mesh_shape[0], 1)
    per_process = len(_batch()[0]) // shards
    coordinate = dist.get_rank() // ranks_per_shard
    return slice(coordinate * per_process, (coordinate + 1) * per_process)


def _keras_has_own_torch_distribution():
    from keras_dtensor_mixfix._keras import keras_modules

    return keras_modules.native_promotion_mode()


def distributed_case(name, mode, mesh_shape, optimizer="adam"):
    """One model under one distribution on this rank: ``_run``'s values and the weights' placements."""
    import keras
    from torch.distributed.tensor import DTensor

    try:
        keras.distribution.set_distribution(_distribution(name, mode, mesh_shape))
        lm = _causal_lm(name, optimizer, _per_process_losses(mode))
        out = _run(lm, rows=_own_rows(mode, mesh_shape))
        # pairs, not a dict: two variables may share a path (SmolLM3 builds its o_proj outside the layer's scope)
        out["placements"] = [(v.path, tuple(str(p) for p in v.value.placements) if isinstance(v.value, DTensor)
                              else None) for v in lm.weights]
    finally:
        keras.distribution.set_distribution(None)
        keras.backend.clear_session()
    return out


def distributed_cases(cases):
    """Every ``(name, mode, mesh_shape[, optimizer])`` in turn; a case that raises gives its traceback and the next one runs."""
    from keras_dtensor_mixfix import keras_integration

    assert keras_integration.install()
    results = {}
    try:
        for case in cases:
            try:
                results[case] = distributed_case(*case)
            except Exception:
                results[case] = traceback.format_exc()
    finally:
        keras_integration.uninstall()
    return results


_per_world_size = {}
_references = {}


def _distributed(world_size):
    if world_size not in _per_world_size:
        cases = [case for case in CASES if int(np.prod(case[2])) == world_size]
        _per_world_size[world_size] = run_on_ranks(distributed_cases, cases, world_size=world_size, timeout=1200)
    return _per_world_size[world_size]



def _reference(name, per_process_losses=False):
    """The single-process run, built with the same seed (and losses) as the distributed ones."""
    key = (name, per_process_losses)
    if key not in _references:
        _references[key] = _run(_causal_lm(name, per_process_losses=per_process_losses))
    return _references[key]


@pytest.mark.parametrize("name,mode,shape", CASES,
                         ids=[f"{name}-{mode}-{'x'.join(map(str, shape))}" for name, mode, shape in CASES])
def test_causal_lm_equals_single_process(name, mode, shape):
    per_rank = [results[(name, mode, shape)] for results in _distributed(int(np.prod(shape)))]
    for rank, out in enumerate(per_rank):
        assert isinstance(out, dict), f"rank {rank} raised:\n{out}"
    out = per_rank[0]
    placements = out["placements"]
    if mode.startswith("model_parallel"):
        # sharded along the "model" mesh axis (the last one)
        sharded = sorted(path for path, p in placements if p and p[-1].startswith("S("))
        assert any("embeddings" in path for path in sharded), sharded  # vocabulary-sharded table
        # attention and feed-forward kernels of every block
        for part in ATTENTION_PARTS.get(name, ("query", "key", "value", "attention_output")):
            assert sum(part == path.split("/")[-2] for path in sharded) == MODELS[name][2]["num_layers"], (part, sharded)
        untied_output = mode == "model_parallel_tp"  # the output projection too
        assert len(sharded) == 1 + untied_output + MODELS[name][2]["num_layers"] * SHARDED_PER_BLOCK[name], sharded
        if mode == "model_parallel_tp":  # split by heads (dim 1 of (hidden, heads, head_dim))
            assert all(p[-1] == "S(1)" for path, p in placements if path.split("/")[-2] in ("query", "key",
                                                                                                  "value")), sharded
        # and, where the "batch" axis splits, over it too as the map says; the package replicates a size-1 axis
        # (Keras 3.16's own distribution keeps what the map says there)
        on_batch_axis = [path for path, p in placements if p and p[0].startswith("S(")]
        if shape[0] > 1 or not _keras_has_own_torch_distribution():
            assert bool(on_batch_axis) == (shape[0] > 1), on_batch_axis
    else:  # replicated DTensors (the package's DataParallel), or plain tensors (Keras 3.16's)
        assert all(p == ("R",) for _, p in placements) or all(p is None for _, p in placements), placements
    reference = _reference(name, _per_process_losses(mode))
    # the same seed gives the same initial weights, sharded or not
    assert len(out["initial"]) == len(reference["initial"])
    for got, want in zip(out["initial"], reference["initial"]):
        np.testing.assert_array_equal(got, want)
    assert sorted(out["history"]) == sorted(reference["history"]) and len(out["history"]["loss"]) == 2
    for key, want in reference["history"].items():
        np.testing.assert_allclose(out["history"][key], want, rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(out["logs"], reference["logs"], rtol=1e-5, atol=1e-6)
    assert sorted(out["evaluated"]) == sorted(reference["evaluated"])
    for key, want in reference["evaluated"].items():
        np.testing.assert_allclose(out["evaluated"][key], want, rtol=1e-5, atol=1e-6, err_msg=key)
    assert len(out["trained"]) == len(reference["trained"])
    for got, want, before in zip(out["trained"], reference["trained"], out["initial"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not all(np.array_equal(got, before) for got, before in zip(out["trained"], out["initial"]))
    for rank, got in enumerate(per_rank):  # each rank's predictions of the rows it fed
        np.testing.assert_allclose(got["predicted"], reference["predicted"][got["rows"]], rtol=1e-5, atol=1e-5,
                                   err_msg=f"rank {rank}")
    np.testing.assert_array_equal(out["generated"], reference["generated"])
    assert out["pipeline"] == reference["pipeline"]
    prompts = _batch()[0] * _batch()[2]
    for row, length in enumerate(PROMPT_LENGTHS):  # the prompt kept, the rest generated
        np.testing.assert_array_equal(out["generated"][row, :length], prompts[row, :length])
    for other in per_rank[1:]:  # every rank holds the same global values
        np.testing.assert_array_equal(other["generated"], out["generated"])
        for got, want in zip(other["trained"], out["trained"]):
            np.testing.assert_array_equal(got, want)


def test_fit_and_predict_go_through_keras_hub_input_pipeline():
    pytest.importorskip("grain", reason="keras_hub 0.32 batches NumPy inputs of fit/predict with grain (or "
                                        "tensorflow); without it the tests above call keras.Model.fit/predict")
    assert _reference("gemma")["pipeline"] == "grain"
    for results in _distributed(2):  # the cases compare their pipeline with the reference's
        for case, out in results.items():
            assert isinstance(out, dict), f"{case} raised:\n{out}"
            assert out["pipeline"] == "grain", case

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

Every keras_hub 0.32 CausalLM with a text backbone (24 models, those six among them) also runs under the map
``keras_dtensor_mixfix.layouts`` derives from the model ("derived" cases) on (1, 2) and (2, 2);
``MIXFIX_TEST_DERIVED_MODELS`` names a subset. Every model also runs under ``DataParallel()`` on 2 ranks
(``MIXFIX_TEST_DATA_PARALLEL_MODELS`` names a subset). ``-k`` selections run only the selected cases on the ranks.

The cases of one world size run in one ``run_on_ranks`` call (starting ranks costs seconds);
each case is checked by its own test. ``MIXFIX_TEST_MESHES="2x4,4x2"`` adds
ModelParallel meshes (8 ranks: slow, documented in docs/keras.md, not in CI). ``MIXFIX_TEST_MAP_MODELS``,
``MIXFIX_TEST_MAP_4_RANK_MODELS``, ``MIXFIX_TEST_DERIVED_2D_MODELS``, ``MIXFIX_TEST_COMPILED_MODELS`` and
``MIXFIX_TEST_COMPILED_MESHES`` narrow the other families (CI's choices: CONTRIBUTING.md).
"""

from __future__ import annotations

import inspect
import math
import os
import traceback

import numpy as np
import pytest

from keras_dtensor_mixfix.testing import run_on_ranks, shutdown_workers

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

def _asked(variable, name, default="all"):
    """Whether the comma-separated model names of an environment variable take ``name`` ("all": every model)."""
    names = os.environ.get(variable, default).split(",")
    return "all" in names or name in names


def _map_case_asked(name, shape):
    """Whether a case under keras_hub's own map for ``name`` runs: MIXFIX_TEST_MAP_MODELS names the model, and beyond
    2 ranks (the product of a mesh shape, or DataParallel's (n,)) MIXFIX_TEST_MAP_4_RANK_MODELS does too."""
    return _asked("MIXFIX_TEST_MAP_MODELS", name) and (math.prod(shape) == 2
                                                      or _asked("MIXFIX_TEST_MAP_4_RANK_MODELS", name))


def _meshes(variable, default=""):
    """The mesh shapes an environment variable names ("1x2,2x4")."""
    return [tuple(int(n) for n in shape.split("x")) for shape in os.environ.get(variable, default).split(",") if shape]


def _layouts():
    """(mode, mesh shape) pairs; the world size is the product of the shape. DataParallel's "shape"
    is just its rank count."""
    layouts = [("model_parallel", (1, 2)), ("model_parallel", (2, 2)), ("data_parallel", (2,)),
               ("data_parallel", (4,))]
    return layouts + [("model_parallel", shape) for shape in _meshes("MIXFIX_TEST_MESHES")]


LAYOUTS = _layouts()
# keras_hub's own maps: MIXFIX_TEST_MAP_MODELS names some of the six ("all", or unset: every one; CI's Keras 3.16
# environment runs none, its keras_hub environment all six); MIXFIX_TEST_MAP_4_RANK_MODELS narrows their cases on
# more than 2 ranks ((2, 2), DataParallel on 4, MIXFIX_TEST_MESHES') to some of those (CI's keras_hub environment: a
# dense model and a mixture of experts)
CASES = [(name, mode, shape) for name in sorted(MODELS) for mode, shape in LAYOUTS if _map_case_asked(name, shape)]
# Llama3 under keras_hub's map with the tensor-parallel rules docs/keras.md gives for speed ("Speed"): the
# query/key/value kernels split by heads and the untied output projection by vocabulary (vocabulary-split logits:
# the loss over each rank's classes)
TENSOR_PARALLEL_RULES = {
    "transformer_layer.*self_attention.*(query|key|value).kernel": ("batch", "model", None),
    "token_embedding/reverse_embeddings": ("batch", "model"),
}
# (keras_hub's map underneath: the two variables above select these as Llama3's own-map cases)
CASES += [("llama3", "model_parallel_tp", shape) for shape in ((1, 2), (2, 2)) if _map_case_asked("llama3", shape)]
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
# Every other keras_hub 0.32 CausalLM with a text backbone, from its tiniest config (Gemma4's assistant is left out:
# it is a draft model that runs only beside a target model). Aliases are covered by their class: Qwen2 is Qwen,
# SmolLM is SmolLM3.
V, L, H, FF = 64, 2, 16, 32
GQA = dict(vocabulary_size=V, num_layers=L, num_query_heads=4, num_key_value_heads=2, hidden_dim=H)
GEMMA4 = dict(GQA, intermediate_dim=FF, image_size=16, head_dim=4, global_head_dim=8, sliding_window_size=64,
              layer_types=["sliding_attention", "full_attention"], vision_encoder=None, audio_encoder=None)
QWEN3_5 = dict(GQA, head_dim=8, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=4, linear_value_head_dim=4, linear_conv_kernel_dim=4)
MODELS.update({
    "bloom": ("BloomBackbone", "BloomCausalLM", dict(vocabulary_size=V, num_layers=L, num_heads=4, hidden_dim=H,
                                                     intermediate_dim=FF)),
    "falcon": ("FalconBackbone", "FalconCausalLM", dict(vocabulary_size=V, num_layers=L, num_attention_heads=4,
                                                        hidden_dim=H, intermediate_dim=FF)),
    # dropout off (GPT2's and OPT's default is 0.1): ranks draw their masks for their own pieces, so a training step
    # is not the one process's draw, though each is a valid one
    "gpt2": ("GPT2Backbone", "GPT2CausalLM", dict(vocabulary_size=V, num_layers=L, num_heads=4, hidden_dim=H,
                                                  intermediate_dim=FF, max_sequence_length=64, dropout=0.0)),
    # rotary_percentage 0.5: the default 0.25 of a head of 4 is a rotary dim of 1, which keras_hub refuses (odd)
    "gpt_neox": ("GPTNeoXBackbone", "GPTNeoXCausalLM", dict(vocabulary_size=V, num_layers=L, num_heads=4,
                                                            hidden_dim=H, intermediate_dim=FF, max_sequence_length=64,
                                                            rotary_percentage=0.5)),
    "opt": ("OPTBackbone", "OPTCausalLM", dict(vocabulary_size=V, num_layers=L, num_heads=4, hidden_dim=H,
                                               intermediate_dim=FF, max_sequence_length=64, dropout=0.0)),
    "gemma3": ("Gemma3Backbone", "Gemma3CausalLM", dict(GQA, intermediate_dim=FF, image_size=16, head_dim=4,
                                                        use_post_ffw_norm=True, use_post_attention_norm=True,
                                                        use_sliding_window_attention=True, sliding_window_size=64,
                                                        vision_encoder=None)),
    "gemma3n": ("Gemma3nBackbone", "Gemma3nCausalLM", dict(
        text_vocab_size=V, text_hidden_size=H, num_hidden_layers=L, pad_token_id=0, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, intermediate_size=[FF, FF], hidden_activation="gelu_approximate",
        layer_types=["sliding_attention", "full_attention"], sliding_window=64, rope_theta=10000.0,
        max_position_embeddings=64, vocab_size_per_layer_input=V, hidden_size_per_layer_input=4, altup_num_inputs=2,
        laurel_rank=4)),
    "gemma4": ("Gemma4Backbone", "Gemma4CausalLM", GEMMA4),
    "gemma4_moe": ("Gemma4Backbone", "Gemma4CausalLM", dict(GEMMA4, enable_moe_block=True, num_experts=4,
                                                            expert_intermediate_dim=8, num_experts_per_token=2)),
    "gpt_oss": ("GptOssBackbone", "GptOssCausalLM", dict(GQA, intermediate_dim=8, num_experts=4, top_k=2,
                                                         head_dim=4, sliding_window=64)),
    "mistral": ("MistralBackbone", "MistralCausalLM", dict(GQA, intermediate_dim=FF, sliding_window=64, head_dim=4)),
    "mixtral": ("MixtralBackbone", "MixtralCausalLM", dict(GQA, intermediate_dim=8, num_experts=4, top_k=2,
                                                           sliding_window=64)),
    "phi3": ("Phi3Backbone", "Phi3CausalLM", dict(GQA, intermediate_dim=FF, max_sequence_length=64,
                                                  pretraining_sequence_length=64)),
    "qwen3": ("Qwen3Backbone", "Qwen3CausalLM", dict(GQA, intermediate_dim=FF, head_dim=4)),
    "qwen3_5": ("Qwen3_5Backbone", "Qwen3_5CausalLM", dict(QWEN3_5, intermediate_dim=FF)),
    "qwen3_5_moe": ("Qwen3_5MoeBackbone", "Qwen3_5MoeCausalLM", dict(
        QWEN3_5, moe_intermediate_dim=8, shared_expert_intermediate_size=8, num_experts=4, top_k=2)),
    "rwkv7": ("RWKV7Backbone", "RWKV7CausalLM", dict(hidden_size=H, head_size=4, num_layers=L, vocabulary_size=V,
                                                     intermediate_dim=FF, gate_lora=4, mv_lora=4, aaa_lora=4,
                                                     decay_lora=4)),
})
# Every model under the map the package derives from the model itself (keras_dtensor_mixfix.layouts); the
# environment variable names a subset, or none when empty (CI's Keras 3.16 environment runs four; its keras_hub
# environment runs all)
DERIVED_SHAPES = ((1, 2), (2, 2)) + tuple(shape for mode, shape in LAYOUTS[4:])  # and MIXFIX_TEST_MESHES'
DERIVED_MODELS = (sorted(MODELS) if "MIXFIX_TEST_DERIVED_MODELS" not in os.environ
                  else [name for name in os.environ["MIXFIX_TEST_DERIVED_MODELS"].split(",") if name in MODELS])
# MIXFIX_TEST_DERIVED_2D_MODELS narrows the 2-D meshes' cases to some of those (CI's keras_hub environment: models
# that cover the derivation's rule kinds; unset, the same models as on (1, 2))
CASES += [(name, "derived", shape) for name in DERIVED_MODELS for shape in DERIVED_SHAPES
          if shape[0] == 1 or _asked("MIXFIX_TEST_DERIVED_2D_MODELS", name)]
# The same with jit_compile=True ("compiled" cases: each distinct decoder block compiled once, the rest eager, or the
# whole step where a model has no repeated block), against the same eager one process: a subset by default (a compiled
# case costs 10 to 90 s of TorchDynamo and inductor on 2 cores); MIXFIX_TEST_COMPILED_MODELS=all runs every model
# (docs/keras.md), on (1, 2) and (2, 2); MIXFIX_TEST_COMPILED_MESHES names the meshes (CI: "1x2", since a cold
# compile on 4 ranks sharing 2 cores costs minutes per model)
CASES += [(name, "compiled", shape) for name in sorted(MODELS)
          if _asked("MIXFIX_TEST_COMPILED_MODELS", name, "gemma,llama3,mixtral,qwen3_moe")
          for shape in _meshes("MIXFIX_TEST_COMPILED_MESHES", "1x2,2x2")]
# DataParallel on 2 ranks for the models beyond keras_hub's six (which run it on 4 as well, above): the environment
# variable names a subset ("all", or unset: every one)
CASES += [(name, "data_parallel", (2,)) for name in sorted(MODELS)
          if _asked("MIXFIX_TEST_DATA_PARALLEL_MODELS", name)
          and (name, "data_parallel", (2,)) not in CASES]
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


def _causal_lm(name, optimizer="adam", per_process_losses=False, jit_compile=False):
    import keras

    backbone_name, lm_name, config = MODELS[name]
    if per_process_losses and "num_experts" in config:
        # A mixture of experts adds a load-balancing loss over the whole batch (how its tokens spread over the
        # experts), which does not split into per-row terms: under DistributedDataParallel (Keras 3.16's
        # DataParallel) each process computes it over its own rows, so training differs from one process
        # (Qwen MoE, 2 ranks, measured: trained weights 9e-4 apart). That is DDP's meaning, not an error; the
        # comparison with one process is made without that loss (then 1e-8 apart). Mixtral names it
        # router_aux_loss_coef (its losses 5e-3 apart with it).
        parameters = inspect.signature(getattr(keras_hub.models, backbone_name).__init__).parameters
        config = dict(config, **{name: 0.0 for name in parameters if name.startswith("router_aux_loss_coef")})
    keras.utils.set_random_seed(0)
    backbone = getattr(keras_hub.models, backbone_name)(**config)
    lm = getattr(keras_hub.models, lm_name)(backbone=backbone, preprocessor=None)
    # Adam's epsilon raised from 1e-7: tensor-parallel partial sums add in another order than one process,
    # and Adam's m / (sqrt(v) + epsilon) turns float32 rounding in near-zero gradients into visible steps
    # (measured on Gemma: trained weights 6e-5 apart with 1e-7, 4e-7 with SGD)
    adam = keras.optimizers.Adam(0.01, epsilon=1e-4)
    lm.compile(optimizer=adam if optimizer == "adam" else keras.optimizers.SGD(0.5),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), sampler="greedy",
               jit_compile=jit_compile)
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
    x = _inputs(lm, ids, mask)
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
    generated = lm.generate(_generate_inputs(lm, all_ids, prompt_mask), stop_token_ids=None)
    out["generated"] = np.asarray(generated["token_ids"])
    return out


def _inputs(lm, ids, mask):
    """The backbone's inputs: token ids and padding mask, and positions where the backbone asks for them (Gemma4)."""
    x = {"token_ids": ids, "padding_mask": mask}
    if "position_ids" in lm.backbone.input:
        x["position_ids"] = np.broadcast_to(np.arange(ids.shape[1], dtype="int32"), ids.shape).copy()
    return x


def _generate_inputs(lm, ids, prompt_mask):
    """What ``generate`` takes with ``preprocessor=None``: the prompts and their mask, but for a text-only Gemma3 an
    empty image batch (its generate step returns images None, which keras_hub cannot concatenate), and for RWKV7 the
    layout of its preprocessor's ``generate_preprocess`` (the prompt but its last token left-padded, that token
    first in ``predict_token_ids``)."""
    name = type(lm).__name__
    if name == "Gemma3CausalLM":
        size = lm.backbone.image_size
        return {"token_ids": ids * prompt_mask, "padding_mask": prompt_mask,
                "images": np.zeros((len(ids), 0, size, size, 3), "float32")}
    if name == "RWKV7CausalLM":
        tokens, token_mask = np.zeros_like(ids), np.zeros(ids.shape, bool)
        predict = np.zeros((len(ids), 6), ids.dtype)
        for row, length in enumerate(PROMPT_LENGTHS):
            tokens[row, ids.shape[1] - (length - 1):] = ids[row, :length - 1]
            token_mask[row, ids.shape[1] - (length - 1):] = True
            predict[row, 0] = ids[row, length - 1]
        return {"token_ids": tokens, "input_padding_mask": token_mask, "padding_mask": predict != 0,
                "predict_token_ids": predict}
    return {"token_ids": ids * prompt_mask, "padding_mask": prompt_mask}


def _distribution(name, mode, mesh_shape):
    import keras

    devices = keras.distribution.list_devices()
    if mode == "data_parallel":
        distribution = keras.distribution.DataParallel()
    else:
        mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"], devices)
        if mode in ("derived", "compiled"):
            from keras_dtensor_mixfix.layouts import layout_map_for

            backbone_name, _, config = MODELS[name]
            layout_map = layout_map_for(getattr(keras_hub.models, backbone_name), mesh, config=config)
        elif name in HAND_MAPS:
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
    shards, ranks_per_shard = (mesh_shape[0], mesh_shape[1]) if mode != "data_parallel" else (mesh_shape[0], 1)
    per_process = len(_batch()[0]) // shards
    coordinate = dist.get_rank() // ranks_per_shard
    return slice(coordinate * per_process, (coordinate + 1) * per_process)


def _keras_has_own_torch_distribution():
    from keras_dtensor_mixfix._keras.boundary import keras_modules

    return keras_modules.native_promotion_mode()


def distributed_case(name, mode, mesh_shape, optimizer="adam"):
    """One model under one distribution on this rank: ``_run``'s values and the weights' placements (and, compiled,
    the layers compiled once for all their kind)."""
    import keras
    from torch.distributed.tensor import DTensor

    from keras_dtensor_mixfix._keras.step import layer_compile

    try:
        keras.distribution.set_distribution(_distribution(name, mode, mesh_shape))
        lm = _causal_lm(name, optimizer, _per_process_losses(mode), jit_compile=mode == "compiled")
        out = _run(lm, rows=_own_rows(mode, mesh_shape))
        out["compiled_groups"] = [[layer.name for layer in group] for group in layer_compile.repeated_groups(lm)]
        # pairs, not a dict: two variables may share a path (SmolLM3 builds its o_proj outside the layer's scope)
        if mode in ("derived", "compiled"):
            # what the derivation asked for, read in a fresh session (other layer names)
            from keras_dtensor_mixfix.layouts import derive_layouts

            mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"], keras.distribution.list_devices())
            derived = derive_layouts(lm.backbone, mesh)
            out["derived"] = (derived.axes, derived.left_whole)
        out["placements"] = [(v.path, tuple(str(p) for p in v.value.placements) if isinstance(v.value, DTensor)
                              else None) for v in lm.weights]
    finally:
        keras.distribution.set_distribution(None)
        keras.backend.clear_session()
        if mode == "compiled":
            import torch

            torch._dynamo.reset()  # the next model's blocks compile from nothing, as in a fresh process
    return out


NOT_RUN = "not run on this rank"


def distributed_cases(cases):
    """Every ``(name, mode, mesh_shape[, optimizer])`` in turn. A case that raises gives its traceback, and the cases
    after it do not run on this rank: the other ranks may still be inside one of its collectives, and running on would
    pair their collectives with the next case's (each then waits out gloo's timeout, case after case)."""
    from keras_dtensor_mixfix import keras_integration

    assert keras_integration.install()
    results = {}
    try:
        for index, case in enumerate(cases):
            try:
                results[case] = distributed_case(*case)
            except Exception:  # noqa: BLE001 - a failing case is a result: its traceback is reported
                results[case] = traceback.format_exc()
                if (case[1] == "compiled" and case[0] in NOT_COMPILED) or _torch_2_11_cannot(case[0], case[1]):
                    continue  # torch refuses these while it traces, on every rank alike: the ranks stay in step
                for later in cases[index + 1:]:
                    results[later] = f"{NOT_RUN}: the case {case} failed before it"
                break
    finally:
        keras_integration.uninstall()
    return results


_per_world_size = {}
_references = {}


def _selected_cases(request):
    """The cases this session runs (``-k`` selects some): the ranks run only those."""
    selected = [item.callspec.params for item in request.session.items
                if getattr(item, "originalname", None) == "test_causal_lm_equals_single_process"]
    return {(params["name"], params["mode"], params["shape"]) for params in selected}


def _distributed(world_size, selected=None):
    if world_size not in _per_world_size:
        cases = [case for case in CASES if int(np.prod(case[2])) == world_size and (not selected or case in selected)]
        # minutes per compiled case on 2 cores (4 ranks: several), seconds per eager one
        timeout = 600 + sum(300 if case[1] == "compiled" else 30 for case in cases) * world_size // 2
        per_rank = run_on_ranks(distributed_cases, cases, world_size=world_size, timeout=timeout)
        if any(not isinstance(out, dict) for results in per_rank for out in results.values()):
            # a case failed: its ranks' process group may be out of step, the next test gets new ones
            shutdown_workers()
        _per_world_size[world_size] = per_rank
    return _per_world_size[world_size]



def _reference(name, per_process_losses=False):
    """The single-process run, built with the same seed (and losses) as the distributed ones, drawing the initial
    values they draw."""
    from _keras_releases import drawing_as_distributed_jobs  # here: the multi-node test's nodes import this module

    key = (name, per_process_losses)
    if key not in _references:
        with drawing_as_distributed_jobs():
            lm = _causal_lm(name, per_process_losses=per_process_losses)
        _references[key] = _run(lm)
    return _references[key]


# Logits after three Adam steps where the derived map splits the hidden dim over both axes of (2, 2): the partial
# sums add in another order than one process's, and Gemma3n's and Gemma4's predictions came out 3.7e-5 and 1.4e-5
# apart (22 and 2 of 2048 logits beyond 1e-5; losses, metrics and trained weights within the usual tolerance);
# Gemma3n on (2, 4) and (4, 2) the same 3.7e-5
PREDICTION_ATOL = {("gemma3n", (2, 2)): 1e-4, ("gemma4", (2, 2)): 1e-4, ("gemma4_moe", (2, 2)): 1e-4,
                   ("gemma3n", (2, 4)): 1e-4, ("gemma3n", (4, 2)): 1e-4,
                   # its key/value kernels split along the hidden width (2 heads over 4): 1 of 2048 logits 1.06e-5
                   # apart, the partial sums added in another order
                   ("gemma3n", "derived", (1, 4)): 1e-4,
                   # the same with its initial values drawn by position: 1 of 2048 logits 1.02e-5 apart
                   ("gemma4_moe", "derived", (1, 2)): 1e-4,
                   # compiled: inductor fuses and reorders the same sums (measured 1.3e-5 and 1.7e-5 on (1, 2))
                   ("gemma3n", "compiled", (1, 2)): 1e-4, ("gemma4", "compiled", (1, 2)): 1e-4}
# the compiled cases CI runs, each a model of identical decoder blocks: they compile as one
COMPILED_AS_ONE = {"gemma": "decoder_block", "llama3": "transformer_layer", "mixtral": "transformer_layer",
                   "qwen3_moe": "transformer_layer"}


# Models torch cannot compile under a mesh, whole step or per block (docs/keras.md "Meshes, models and Keras versions
# proven"): strict, so that a torch that compiles them shows up; seen on (1, 2), torch 2.13.0, Keras 3.15.1
NOT_COMPILED = {
    "gemma3n": "a DTensor output no gradient reaches gets a plain zero tangent "
               "(repros/torch_compile_dtensor_output_without_gradient.py)",
    "qwen3_5": "TorchDynamo fails tracing the gated delta rule's einsum on a head-split DTensor (shard_order)",
    "qwen3_5_moe": "TorchDynamo fails tracing the gated delta rule's einsum on a head-split DTensor (shard_order)",
    "rwkv7": "AOTAutograd rebuilds an output aliasing an input with as_strided, which DTensor does not support",
}


# Models whose own code torch 2.11's DTensor cannot run with their heads split (any mode but DataParallel): strict,
# on that release only; every rank fails alike, so the ranks stay in step for the next case
NOT_ON_TORCH_2_11 = {
    "rwkv7": "its time mix multiplies head-split states with Python's @ (torch.matmul), which DTensor lowers to bmm "
             "through a view flattening a split dim (repros/torch_view_flatten_split_dim.py)",
}


def _torch_2_11_cannot(name, mode):
    import torch

    from keras_dtensor_mixfix._torch.versions import has_defect

    return (name in NOT_ON_TORCH_2_11 and mode != "data_parallel"
            and has_defect("view_flatten_split_dim", torch.__version__))


def _case_param(name, mode, shape):
    marks = ()
    if mode == "compiled" and name in NOT_COMPILED:
        marks = pytest.mark.xfail(strict=True, raises=AssertionError, reason=f"torch: {NOT_COMPILED[name]}")
    elif _torch_2_11_cannot(name, mode):
        marks = pytest.mark.xfail(strict=True, raises=AssertionError, reason=f"torch 2.11: {NOT_ON_TORCH_2_11[name]}")
    return pytest.param(name, mode, shape, id=f"{name}-{mode}-{'x'.join(map(str, shape))}", marks=marks)


@pytest.mark.parametrize("name,mode,shape", [_case_param(*case) for case in CASES])
def test_causal_lm_equals_single_process(name, mode, shape, request):
    per_rank = [results[(name, mode, shape)] for results in _distributed(int(np.prod(shape)),
                                                                         _selected_cases(request))]
    failed = {rank: out for rank, out in enumerate(per_rank) if not isinstance(out, dict)}
    if failed and all(out.startswith(NOT_RUN) for out in failed.values()):
        pytest.fail(failed[min(failed)])  # not an AssertionError: a strict xfail does not take it as torch's failure
    # every rank's traceback: the rank that raised first is not always rank 0 (the others then time out waiting)
    assert not failed, "\n".join(f"rank {rank} raised:\n{out}" for rank, out in failed.items())
    out = per_rank[0]
    placements = out["placements"]
    if mode == "compiled" and name in COMPILED_AS_ONE:
        blocks = [f"{COMPILED_AS_ONE[name]}_{index}" for index in range(MODELS[name][2]["num_layers"])]
        assert out["compiled_groups"] == [blocks], out["compiled_groups"]
    if mode in ("derived", "compiled"):
        _check_derived_placements(out, shape)
    elif mode.startswith("model_parallel"):
        # sharded along the "model" mesh axis (the last one)
        sharded = sorted(path for path, p in placements if p and p[-1].startswith("S("))
        assert any("embeddings" in path for path in sharded), sharded  # vocabulary-sharded table
        # attention and feed-forward kernels of every block
        for part in ATTENTION_PARTS.get(name, ("query", "key", "value", "attention_output")):
            assert (sum(part == path.split("/")[-2] for path in sharded)
                    == MODELS[name][2]["num_layers"]), (part, sharded)
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
        np.testing.assert_allclose(got["predicted"], reference["predicted"][got["rows"]], rtol=1e-5,
                                   atol=PREDICTION_ATOL.get((name, mode, shape),
                                                            PREDICTION_ATOL.get((name, shape), 1e-5)),
                                   err_msg=f"rank {rank}")
    np.testing.assert_array_equal(out["generated"], reference["generated"])
    assert out["pipeline"] == reference["pipeline"]
    prompts = _batch()[0] * _batch()[2]
    for row, length in enumerate(PROMPT_LENGTHS if name != "rwkv7" else ()):  # the prompt kept, the rest generated
        # (RWKV7 returns its own layout: the left-padded prompt, then the predicted tokens)
        np.testing.assert_array_equal(out["generated"][row, :length], prompts[row, :length])
    for other in per_rank[1:]:  # every rank holds the same global values
        np.testing.assert_array_equal(other["generated"], out["generated"])
        for got, want in zip(other["trained"], out["trained"]):
            np.testing.assert_array_equal(got, want)


def _check_derived_placements(out, shape):
    """Every weight the derivation split is split so on its mesh, over "model" along the dim it chose (and over
    "batch" where it chose that too and the axis has more than one rank); every other weight is whole."""
    axes, left_whole = out["derived"]
    assert axes and left_whole is not None
    assert any("embeddings" in path and "model" in a for path, a in axes.items()), axes  # vocabulary-split
    for path, placements in out["placements"]:
        want = axes.get(path)
        if want is None:
            assert placements is None or all(p == "R" for p in placements), (path, placements)
            continue
        assert placements is not None, path
        model_dim = want.index("model")
        assert placements[-1] == f"S({model_dim})", (path, want, placements)
        if shape[0] > 1:
            batch = f"S({want.index('batch')})" if "batch" in want else "R"
            assert placements[0] == batch, (path, want, placements)


def test_fit_and_predict_go_through_keras_hub_input_pipeline():
    pytest.importorskip("grain", reason="keras_hub 0.32 batches NumPy inputs of fit/predict with grain (or "
                                        "tensorflow); without it the tests above call keras.Model.fit/predict")
    assert _reference("gemma")["pipeline"] == "grain"
    for results in _distributed(2):  # the cases compare their pipeline with the reference's
        for case, out in results.items():
            assert isinstance(out, dict), f"{case} raised:\n{out}"
            assert out["pipeline"] == "grain", case

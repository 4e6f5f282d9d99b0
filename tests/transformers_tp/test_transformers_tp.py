"""transformers' own tensor parallelism, a client of the package: every stage of a training loop equals one process.

A tiny random checkpoint is built in the test (a config with tiny sizes, ``save_pretrained`` into ``tmp_path``;
nothing is downloaded) and loaded twice on each of 2 gloo ranks: with
``from_pretrained(dir, distributed_config=DistributedConfig(tp_plan="auto", tp_size=2))`` (the model
transformers shards) and without it (the one-process reference, plain tensors, in the same worker). Each
stage of a hand-written training loop, run on the sharded model with the package patched, must equal the
reference: the logits and the loss, every gradient (``full_tensor`` of the DTensor ones),
``clip_grad_norm_`` (the norm it returns and the clipped gradients), two steps of ``AdamW(foreach=True)`` and of
``AdamW(fused=True)``, ``load_state_dict`` of the reference's plain state dict, a custom loss through
``F.linear(hidden, model.lm_head.weight)``, and greedy ``generate``. The models are float64 (``FLOAT32``: the
mixture-of-experts ones), so the tolerances are tight: tensor parallelism only changes the order of a few sums.

The package is needed, and changes nothing it need not: with it off the same stages fail with torch's
mixed-operand error, while the forward pass (transformers' model code never mixes) gives the same logits,
bit for bit, with and without it, and promotes nothing.

Expert parallelism (``DistributedConfig(tp_plan="auto", tp_size=2, ep_size=2)``) puts the experts on a second
mesh over the same ranks; the same stages run on both mixture-of-experts models there, and AdamW foreach and
for-loop (``UNFUSED_LOOP``) as well.

``tp_size`` is given: ``DistributedConfig`` derives it from ``WORLD_SIZE``, which torchrun sets and
``run_on_ranks`` does not, and with ``tp_size=1`` transformers would not shard at all. transformers uses the
process group that already exists (it creates one from torchrun's variables only when there is none).

Models (``MODELS``): llama, qwen2, mistral, gemma2, gemma3 (text), qwen3, phi3, olmo2, mixtral and qwen3_moe, each
with the tensor-parallel plan transformers ships for it. The whole file takes 25 to 40 s on 2 cores (measured
with other jobs on the machine; one ``run_on_ranks`` call per test, in the suite's shared 2-rank workers, which
each expected failure restarts). It is skipped, saying why, where transformers is not installed
(``pip install -e ".[transformers]"``: transformers 5.24.0, accelerate 1.15.0).
"""

from __future__ import annotations

import importlib.util

import pytest

from keras_dtensor_mixfix.testing import run_on_ranks

# (the `transformers` marker comes from the file name: tests/conftest.py)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason='transformers is not installed (pip install -e ".[transformers]")')

MIXED = "got mixed torch.Tensor and DTensor"
"""torch's own error when an op meets a plain tensor and a DTensor."""

_SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
"""What every tiny model shares: 4 attention heads and 2 key/value heads, so that both split over 2 ranks."""

MODELS = {
    # model type: (config class, its own sizes)
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": 4}),
    "gemma2": ("Gemma2Config", {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 4}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 4}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32}),
}
"""Every model type this file can test, with the config that makes a tiny random one."""

FLOAT32 = ("mixtral", "qwen3_moe")
"""Models tested in float32, not float64: their experts run on ``grouped_mm`` (transformers' default experts
implementation), which has no float64 kernel."""

LR = 1e-2
"""The optimizers' learning rate: each of the 2 AdamW steps moves a weight by about this much."""

OPTIMIZERS = {"AdamW(foreach=True)": {"foreach": True}, "AdamW(fused=True)": {"fused": True},
              "AdamW(foreach=False)": {"foreach": False}}
"""The optimizers a training loop may step with (torch's three AdamW implementations), by stage name."""

LOOP = ("AdamW(foreach=True)", "AdamW(fused=True)")
"""The optimizers of the training loop users write: AdamW foreach (the CUDA default), then fused."""

UNFUSED_LOOP = ("AdamW(foreach=True)", "AdamW(foreach=False)")
"""The optimizers of the loop that runs under expert parallelism today (docs/transformers.md): not fused."""


def stages(loop) -> tuple:
    """The stages a sharded model goes through with ``loop``'s two optimizers, in order; a rank function returns
    the ones it checked."""
    first, second = loop
    return ("forward", "backward", "clip_grad_norm_", first, "load_state_dict", second, "custom loss", "generate")


# --------------------------------------------------------------------------- inside the rank workers


def _transformers():
    """transformers, quiet: no progress bars, no advice (the workers' stderr is the test run's)."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _dtype(model_type: str):
    import torch

    return torch.float32 if model_type in FLOAT32 else torch.float64


def _build_checkpoint(model_type: str, directory: str) -> None:
    """Rank 0 saves a tiny random checkpoint of ``model_type`` into ``directory``; every rank waits for it."""
    import torch
    import torch.distributed as dist

    transformers = _transformers()
    if dist.get_rank() == 0:
        config_class, own = MODELS[model_type]
        config = getattr(transformers, config_class)(**{**_SIZES, **own})
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=_dtype(model_type))
        model.save_pretrained(directory)
    dist.barrier()


def _load(directory: str, **distributed):
    """(the model transformers shards over the 2 ranks with ``DistributedConfig(**distributed)``, the plain one)."""
    transformers = _transformers()
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(tp_plan="auto", tp_size=2, **distributed)
    sharded = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True,
                                                                distributed_config=config)
    plain = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    return sharded, plain


def _batch(vocab_size: int):
    """The same input ids on every rank (labels: the ids themselves, as a causal LM's loss takes them)."""
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab_size, (2, 8), generator=generator)


def _full(value):
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _close(actual, expected, what: str, atol=None) -> None:
    import torch

    # float64, but some layers compute in float32 inside (Gemma's RMSNorm upcasts to float32 and back)
    rtol, default_atol = (1e-5, 1e-8) if expected.dtype == torch.float64 else (1e-4, 1e-6)
    atol = default_atol if atol is None else atol
    torch.testing.assert_close(_full(actual).detach(), expected.detach(), rtol=rtol, atol=atol,
                               msg=lambda message: f"{what}: {message}")


def _named(model, what: str):
    return dict(model.named_parameters()) if what == "parameters" else {
        name: parameter.grad for name, parameter in model.named_parameters()}


def _all_close(sharded, plain, what: str, stage: str, atol=None) -> None:
    """Every parameter (``what="parameters"``) or gradient (``"gradients"``) of ``sharded`` equals ``plain``'s."""
    mine, reference = _named(sharded, what), _named(plain, what)
    assert sorted(mine) == sorted(reference), f"{stage}: not the same parameters"
    for name, expected in reference.items():
        assert expected is not None, f"{stage}: the one-process model has no gradient for {name}"
        assert mine[name] is not None, f"{stage}: no gradient for {name}"
        _close(mine[name], expected, f"{stage}: {what[:-1]} {name}", atol=atol)


def _clip(model, max_norm):
    import torch

    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def _step(model, ids, optimizer):
    """One training step of the loop users write: forward with labels, backward, clip, optimizer step."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    norm = _clip(model, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, norm


def _sharded_like_transformers_does(sharded, distributed: dict) -> None:
    """The sharded model really is sharded: DTensor weights beside plain ones (norms), on the "tp" mesh, and
    the experts on an "ep" one under expert parallelism."""
    from torch.distributed.tensor import DTensor

    kinds = {isinstance(parameter, DTensor) for parameter in sharded.parameters()}
    assert kinds == {True, False}, "expected DTensor and plain parameters side by side"
    meshes = {parameter.device_mesh.mesh_dim_names for parameter in sharded.parameters()
              if isinstance(parameter, DTensor)}
    assert meshes == ({("tp",), ("ep",)} if distributed.get("ep_size", 1) > 1 else {("tp",)}), meshes


def training_loop_equals_one_process(model_type: str, directory: str, distributed: dict, loop=LOOP):
    """Every stage of ``stages(loop)`` on the sharded model, patched, against the plain model (``loop``: the two
    optimizers, by their names in ``OPTIMIZERS``); returns the stages checked."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    import keras_dtensor_mixfix as mf

    _build_checkpoint(model_type, directory)
    sharded, plain = _load(directory, **distributed)
    _sharded_like_transformers_does(sharded, distributed)
    assert {p.dtype for p in (*sharded.parameters(), *plain.parameters())} == {_dtype(model_type)}
    ids = _batch(plain.config.vocab_size)
    initial = {name: value.detach().clone() for name, value in plain.state_dict().items()}
    checked = []
    with mf.patched():
        out, reference = sharded(input_ids=ids, labels=ids), plain(input_ids=ids, labels=ids)
        _close(out.logits, reference.logits, "logits")
        _close(out.loss, reference.loss, "loss")
        checked.append("forward")

        out.loss.backward()
        reference.loss.backward()
        _all_close(sharded, plain, "gradients", "backward")
        checked.append("backward")

        # half the true norm, so that the gradients really are scaled
        max_norm = 0.5 * torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad) for p in plain.parameters()])).item()
        norm, expected_norm = _clip(sharded, max_norm), _clip(plain, max_norm)
        _close(norm, expected_norm, "clip_grad_norm_: the total norm")
        _all_close(sharded, plain, "gradients", "clip_grad_norm_")
        checked.append("clip_grad_norm_")

        for name in loop:
            if checked[-1] != "clip_grad_norm_":
                # load_state_dict: the plain one-process state dict into the sharded model, which the steps
                # above moved away from it
                placements = {n: p.placements for n, p in sharded.named_parameters() if isinstance(p, DTensor)}
                sharded.load_state_dict(initial)
                plain.load_state_dict(initial)
                for n, parameter in sharded.named_parameters():
                    _close(parameter, initial[n], f"load_state_dict: {n}")
                    assert (parameter.placements if isinstance(parameter, DTensor) else None) == placements.get(n), n
                checked.append("load_state_dict")
            sharded.zero_grad(set_to_none=True)
            plain.zero_grad(set_to_none=True)
            optimizers = [torch.optim.AdamW(model.parameters(), lr=LR, **OPTIMIZERS[name])
                          for model in (sharded, plain)]
            for _ in range(2):
                loss, norm = _step(sharded, ids, optimizers[0])
                expected_loss, expected_norm = _step(plain, ids, optimizers[1])
                _close(loss, expected_loss, f"{name}: the loss before a step")
                _close(norm, expected_norm, f"{name}: the gradient norm before a step")
            # In float32 Adam's first steps move a weight whose gradient is near 0 by up to lr either way: a
            # rounding-sized difference in that gradient can show as a thousandth of a step. A wrong step is a
            # whole one (lr).
            _all_close(sharded, plain, "parameters", name,
                       atol=None if _dtype(model_type) == torch.float64 else LR / 100)
            checked.append(name)

        # from the checkpoint's weights again: in float32 the steps above leave rounding-sized differences
        sharded.load_state_dict(initial)
        plain.load_state_dict(initial)
        sharded.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        losses = []
        for model in (sharded, plain):  # a loss of your own over the hidden states and the output projection
            hidden = model.model(input_ids=ids).last_hidden_state
            logits = F.linear(hidden, model.lm_head.weight)
            losses.append(F.cross_entropy(logits.flatten(0, 1), ids.flatten()))
            losses[-1].backward()
        _close(losses[0], losses[1], "custom loss")
        _all_close(sharded, plain, "gradients", "custom loss")
        checked.append("custom loss")

        prompt = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                      pad_token_id=plain.config.pad_token_id)
        tokens, expected_tokens = sharded.generate(**prompt), plain.generate(**prompt)
        assert expected_tokens.shape[1] > ids.shape[1], "generate made no token"
        assert torch.equal(tokens, expected_tokens), f"generate: {tokens.tolist()} != {expected_tokens.tolist()}"
        checked.append("generate")
    return checked


def _error(fn) -> str:
    """What ``fn()`` raised (its type and whole message: load_state_dict puts the op's error on a later line)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def without_the_package(model_type: str, directory: str):
    """The same model unpatched: what fails (each training-loop stage) and what does not (forward, backward,
    generate), and whether the forward pass gives the same logits patched, promoting nothing."""
    import torch
    import torch.nn.functional as F

    import keras_dtensor_mixfix as mf

    _build_checkpoint(model_type, directory)
    sharded, plain = _load(directory)
    ids = _batch(plain.config.vocab_size)
    assert not mf.is_patched()
    found = {}
    logits = sharded(input_ids=ids).logits
    with mf.patched():
        mf.reset_stats()
        patched_logits = sharded(input_ids=ids).logits
        found["forward promotions"] = mf.stats()
    found["forward identical"] = torch.equal(logits, patched_logits)

    found["forward and backward"] = _error(lambda: sharded(input_ids=ids, labels=ids).loss.backward())
    found["clip_grad_norm_"] = _error(lambda: torch.nn.utils.clip_grad_norm_(sharded.parameters(), 1.0))
    for name, options in (("AdamW(foreach=True)", {"foreach": True}), ("AdamW(fused=True)", {"fused": True})):
        found[name] = _error(lambda: torch.optim.AdamW(sharded.parameters(), **options).step())
    found["load_state_dict"] = _error(lambda: sharded.load_state_dict(plain.state_dict()))
    found["custom loss"] = _error(lambda: F.cross_entropy(
        F.linear(sharded.model(input_ids=ids).last_hidden_state, sharded.lm_head.weight).flatten(0, 1), ids.flatten()))
    found["generate"] = _error(lambda: sharded.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0))
    return found


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("model_type", MODELS)
def test_tensor_parallel_training_loop_equals_one_process(model_type, tmp_path):
    for checked in run_on_ranks(training_loop_equals_one_process, model_type, str(tmp_path), {}, world_size=2):
        assert tuple(checked) == stages(LOOP)


@pytest.mark.parametrize("model_type", MODELS)
def test_the_loop_needs_the_package_and_the_model_does_not(model_type, tmp_path):
    for found in run_on_ranks(without_the_package, model_type, str(tmp_path), world_size=2):
        assert found["forward identical"] is True, "the forward pass gave other logits patched"
        assert found["forward promotions"] == {}, "the forward pass promoted an operand: transformers' model code mixed"
        for stage in ("forward and backward", "generate"):
            assert found[stage] == "no error", (stage, found[stage])
        for stage in ("clip_grad_norm_", "AdamW(foreach=True)", "AdamW(fused=True)", "load_state_dict", "custom loss"):
            assert found[stage].startswith("RuntimeError") and MIXED in found[stage], (stage, found[stage])


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_expert_parallel_training_loop_equals_one_process(model_type, tmp_path):
    for checked in run_on_ranks(training_loop_equals_one_process, model_type, str(tmp_path), {"ep_size": 2},
                                world_size=2):
        assert tuple(checked) == stages(LOOP)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_expert_parallel_training_loop_with_unfused_adamw_equals_one_process(model_type, tmp_path):
    for checked in run_on_ranks(training_loop_equals_one_process, model_type, str(tmp_path), {"ep_size": 2},
                                UNFUSED_LOOP, world_size=2):
        assert tuple(checked) == stages(UNFUSED_LOOP)

"""Mixed plain/DTensor failure patterns from public issue reports, each against the one-process program.

Collected from pytorch/pytorch, transformers, accelerate, torchtitan, torchtune, torchft, verl, vLLM and trl:
each program below is the pattern as reported, made small, run on real gloo meshes ((2,) on 2 ranks,
("dp", "tp") = (2, 2) on 4) with the package patched and compared, values and gradients of every input and
parameter, with the same program on plain tensors in one process. Without the package every one of them
raises torch's mixed-operand error (checked too). The patterns the package computes another way or refuses
(class-weighted losses, boolean masks, ``scatter_add``, two meshes) are in ``test_reported_patterns.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from _ranks import close, mesh_for
from keras_dtensor_mixfix._torch.versions import release_of
from keras_dtensor_mixfix.testing import run_on_ranks

MIXED = "got mixed torch.Tensor and DTensor"


def _programs():
    """name -> (program, {input name: (tensor, placements along the last mesh dim or None for plain)}).

    A program takes its inputs by name and returns the tensor whose ``sum`` is differentiated (after
    ``prepare`` where in-place writes into plain tensors are the point)."""
    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    heads, rows, keys, dim = 4, 3, 5, 8

    def attention_sinks(logits, sinks):  # GPT-OSS: a learned per-head logit joins the attention scores
        scores = torch.cat([logits, sinks.reshape(1, heads, 1, 1).expand(2, heads, rows, 1)], dim=-1)
        return torch.softmax(scores, dim=-1)[..., :-1]

    def copy_into_plain(weight):  # vLLM weight loaders: a plain destination loaded from a DTensor source
        destination = torch.zeros(8, 4)
        destination.copy_(weight)
        return destination

    def ema_into_plain(weight):  # EMA of a sharded model kept as plain copies
        average = torch.ones(8, 4)
        average.lerp_(weight, 0.25)
        return average

    def sdpa_with_plain_mask(query, key, value, mask):  # a plain additive mask beside heads split over ranks
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask)

    def rotary_as_matmul(x, rotation):  # rotary embeddings written as a matmul with a plain rotation matrix
        return x @ rotation

    def where_plain_condition(x, condition, fill):
        return torch.where(condition, x, fill)

    def embedding_plain_ids(ids, table):
        return F.embedding(ids, table)

    def index_put_plain(x, rows_index, values):
        out = x * 1.0
        out.index_put_((rows_index,), values, accumulate=True)
        return out

    def lora_beside_tensor_parallel(x, weight, lora_a, lora_b):  # adapters left plain beside a split layer
        return F.linear(x, weight) + F.linear(F.linear(x, lora_a), lora_b)

    def weight_outside_forward(weight, probe):  # an FSDP2 parameter used in a plain computation
        return probe @ weight.t()

    def stack_and_einsum(x, y):
        return torch.einsum("bij,jk->bik", torch.stack([x, y]), y.t())

    def labels_loss(logits, labels):
        return F.cross_entropy(logits, labels)

    last = lambda d: Shard(d)  # noqa: E731 - split along tensor dim d on the last mesh dim
    programs = {
        "attention sinks (cat)": (attention_sinks, {"logits": (torch.randn(2, heads, rows, keys), last(1)),
                                                    "sinks": (torch.randn(heads), None)}),
        "copy_ into a plain tensor": (copy_into_plain, {"weight": (torch.randn(8, 4), last(0))}),
        "lerp_ into a plain EMA": (ema_into_plain, {"weight": (torch.randn(8, 4), last(1))}),
        "SDPA with a plain mask": (sdpa_with_plain_mask, {
            "query": (torch.randn(2, heads, rows, dim), last(1)), "key": (torch.randn(2, heads, keys, dim), last(1)),
            "value": (torch.randn(2, heads, keys, dim), last(1)), "mask": (torch.randn(rows, keys), None)}),
        "rotary as a matmul": (rotary_as_matmul, {"x": (torch.randn(2, rows, dim), last(0)),
                                                  "rotation": (torch.randn(dim, dim), None)}),
        "where with a plain condition": (where_plain_condition, {
            "x": (torch.randn(8, 4), last(0)), "condition": (torch.rand(8, 4) > 0.5, None),
            "fill": (torch.randn(8, 4), None)}),
        "embedding with plain ids": (embedding_plain_ids, {"ids": (torch.randint(0, 8, (3, 5)), None),
                                                           "table": (torch.randn(8, 6), last(1))}),
        "index_put_ with plain indices": (index_put_plain, {
            "x": (torch.randn(8, 4), last(1)), "rows_index": (torch.tensor([0, 5, 5, 7]), None),
            "values": (torch.randn(4, 4), None)}),
        "LoRA adapters beside a column-split layer": (lora_beside_tensor_parallel, {
            "x": (torch.randn(3, dim), None), "weight": (torch.randn(8, dim), last(0)),
            "lora_a": (torch.randn(2, dim), None), "lora_b": (torch.randn(8, 2), None)}),
        "an FSDP2 weight used outside forward": (weight_outside_forward, {
            "weight": (torch.randn(8, 4), last(0)), "probe": (torch.randn(3, 4), None)}),
        "stack and einsum": (stack_and_einsum, {"x": (torch.randn(4, 6), last(0)), "y": (torch.randn(4, 6), None)}),
        "a loss with plain labels": (labels_loss, {"logits": (torch.randn(8, 5), last(0)),
                                                   "labels": (torch.randint(0, 5, (8,)), None)}),
    }
    if release_of(torch.__version__) == (2, 11):
        # torch 2.11's DTensor cannot flatten several dims when one after the first is split: CPU attention with a
        # mask views (batch, heads, ...) as (batch * heads, ...) with the heads split, and einsum's batched matmul
        # flattens the stacked operands' dims: both fail there with every operand a DTensor too
        # (repros/torch_view_flatten_split_dim.py)
        del programs["SDPA with a plain mask"], programs["stack and einsum"]
    return programs


def public_patterns(world_size):
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import DTensor, Replicate

    m = mesh_for(world_size)
    checked, refused_unpatched = [], []
    for name, (program, inputs) in _programs().items():
        # a list, in the inputs' order: every rank must check (gather) the gradients in the same order
        differentiable = [key for key, (tensor, _) in inputs.items() if tensor.is_floating_point()]
        reference = {key: t.clone().requires_grad_(key in differentiable) for key, (t, _) in inputs.items()}
        expected = program(**reference)
        expected.sum().backward()

        def build():
            built = {}
            for key, (tensor, placement) in inputs.items():
                if placement is None:
                    built[key] = tensor.clone().requires_grad_(key in differentiable)
                else:
                    from torch.distributed.tensor import distribute_tensor

                    placements = [Replicate()] * (m.ndim - 1) + [placement]
                    built[key] = distribute_tensor(tensor.clone(), m, placements).requires_grad_(key in differentiable)
            return built

        try:
            program(**build()).sum().backward()
        except RuntimeError as exc:
            if MIXED in str(exc):
                refused_unpatched.append(name)
        got_inputs = build()
        with mf.patched():
            got = program(**got_inputs)
            got.sum().backward()
        close(got, expected.detach(), f"{name}: value", rtol=1e-4, atol=1e-5)
        for key in differentiable:
            grad = got_inputs[key].grad
            assert grad is not None, f"{name}: no gradient for {key}"
            if not isinstance(got_inputs[key], DTensor):
                assert type(grad) is torch.Tensor, f"{name}: {key}'s gradient is {type(grad).__name__}"
            close(grad, reference[key].grad, f"{name}: gradient of {key}", rtol=1e-4, atol=1e-5)
        checked.append(name)
    return checked, refused_unpatched


def test_public_failure_patterns_equal_one_process_values_and_gradients(world_size):
    checked, refused_unpatched = run_on_ranks(public_patterns, world_size, world_size=world_size)[0]
    assert len(checked) == len(_programs()), checked
    assert refused_unpatched == checked, f"torch alone ran {sorted(set(checked) - set(refused_unpatched))}"

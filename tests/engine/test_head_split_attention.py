"""Attention with its heads split over the ranks, beside a plain mask or rotation, equals one process.

CPU ``scaled_dot_product_attention`` with a mask that needs no gradient runs
``_scaled_dot_product_flash_attention_for_cpu``, which torch 2.11's DTensor has no strategy for
(``repros/torch_sdpa_cpu_no_strategy.py``): with a plain mask the engine runs it on each rank's own heads there
(``_engine/corrections.py``). Later releases search DTensor's strategy for it for minutes on split operands
(``repros/torch_sdpa_cpu_sharding_search.py``), so that case runs on 2.11 as the release runs it and, on every
release, with the 2.11 form forced. A mask that needs a gradient takes the math path, and rotary ``q @ rot`` is
torch's ``matmul``: both flatten the split heads into the batch, which torch 2.11 refuses with every operand a DTensor
too (``repros/torch_view_flatten_split_dim.py``), in a view no mixed call precedes: they are checked where torch runs
them (2.12 and later) and expected to fail on 2.11. Values and gradients are compared with the same program on plain
tensors in one process (1-D mesh on 2 ranks; on 4, the (2, 2) mesh with the batch split too).
"""

from __future__ import annotations

import pytest
import torch

from _ranks import close, forced_defect, mesh_for, shard
from keras_dtensor_mixfix._torch.versions import has_defect
from keras_dtensor_mixfix.testing import RankError, run_on_ranks

WITHOUT_STRATEGY = "sdpa_cpu_without_strategy"
FLATTEN = "view_flatten_split_dim"
ON_2_11 = has_defect(WITHOUT_STRATEGY, torch.__version__)

FORCED = pytest.mark.parametrize("forced", [
    pytest.param(False, marks=pytest.mark.skipif(
        not ON_2_11, reason="DTensor's own strategy search for split CPU attention takes minutes on this release "
                            "(repros/torch_sdpa_cpu_sharding_search.py)")),
    True], ids=["as_the_release_runs", "2_11_form_forced"])
FLATTENS_ON_2_11 = pytest.mark.xfail(
    has_defect(FLATTEN, torch.__version__), strict=True, raises=RankError,
    reason="torch 2.11's DTensor cannot flatten split heads into the batch, with every operand a DTensor too "
           "(repros/torch_view_flatten_split_dim.py): the package refuses the view by name there "
           "(ReleaseLimitationError; tests/simulated/test_release_refusals.py follows its advice)")


def heads_split(m):
    """Queries, keys and values' placements: heads split on the last mesh dim, the batch on the first of two."""
    from torch.distributed.tensor import Shard

    return [Shard(0)] * (m.ndim - 1) + [Shard(1)]


def _masks():
    torch.manual_seed(11)
    return {"(rows, keys)": torch.randn(3, 5), "(batch, 1, rows, keys)": torch.randn(2, 1, 3, 5),
            "(1, heads, rows, keys)": torch.randn(1, 4, 3, 5),
            "(batch, heads, rows, keys)": torch.randn(2, 4, 3, 5), "boolean (rows, keys)": torch.rand(3, 5) > 0.3}


def _attend(world_size, masks, mask_needs_grad, forced):
    """For each mask: ``scaled_dot_product_attention`` of head-split q, k, v with the plain mask, values and the
    gradients of q, k, v (and of the mask where it needs one) against one process."""
    import torch.nn.functional as F

    import keras_dtensor_mixfix as mf

    m = mesh_for(world_size)
    torch.manual_seed(12)
    query, key, value = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
    weights = torch.randn(2, 4, 3, 8)  # (the fused CPU kernel wants one head dim for q, k and v)
    for name, mask in masks.items():
        reference = [t.clone().requires_grad_() for t in (query, key, value)]
        reference_mask = mask.clone().requires_grad_(mask_needs_grad)
        expected = F.scaled_dot_product_attention(*reference, attn_mask=reference_mask)
        (expected * weights).sum().backward()
        split = [shard(t, m, heads_split(m), True) for t in (query, key, value)]
        plain_mask = mask.clone().requires_grad_(mask_needs_grad)
        with forced_defect(WITHOUT_STRATEGY, forced), mf.patched():
            got = F.scaled_dot_product_attention(*split, attn_mask=plain_mask)
            (got * weights).sum().backward()
        close(got, expected.detach(), f"attention with mask {name}", rtol=1e-4, atol=1e-5)
        for label, tensor, like in zip("qkv", split, reference):
            close(tensor.grad, like.grad, f"gradient of {label}, mask {name}", rtol=1e-4, atol=1e-5)
        if mask_needs_grad:
            assert type(plain_mask.grad) is torch.Tensor, f"mask {name}: gradient is {type(plain_mask.grad)}"
            close(plain_mask.grad, reference_mask.grad, f"gradient of the mask {name}", rtol=1e-4, atol=1e-5)
    return "ok"


def attention_with_a_constant_mask(world_size, forced):
    return _attend(world_size, _masks(), False, forced)


def attention_with_a_learned_mask(world_size):
    masks = {name: mask for name, mask in _masks().items() if mask.is_floating_point()}
    return _attend(world_size, masks, True, False)


def rotary_as_matmul(world_size):
    """``q @ rot`` with q split along its heads and rot plain, then replicated: values and gradients."""
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import Replicate

    m = mesh_for(world_size)
    torch.manual_seed(13)
    query, rotation, weights = torch.randn(2, 4, 3, 8), torch.randn(8, 8), torch.randn(2, 4, 3, 8)
    reference, reference_rotation = query.clone().requires_grad_(), rotation.clone().requires_grad_()
    expected = reference @ reference_rotation
    (expected * weights).sum().backward()
    for replicated in (False, True):
        split = shard(query, m, heads_split(m), True)
        rot = shard(rotation, m, [Replicate()] * m.ndim, True) if replicated else rotation.clone().requires_grad_()
        with mf.patched():
            got = split @ rot
            (got * weights).sum().backward()
        what = "replicated" if replicated else "plain"
        close(got, expected.detach(), f"q @ rot, rot {what}")
        close(split.grad, reference.grad, f"gradient of q, rot {what}")
        close(rot.grad, reference_rotation.grad, f"gradient of rot {what}", rtol=1e-4, atol=1e-5)
    return "ok"


@FORCED
def test_attention_of_split_heads_with_a_plain_constant_mask_equals_one_process(world_size, forced):
    assert run_on_ranks(attention_with_a_constant_mask, world_size, forced,
                        world_size=world_size) == ["ok"] * world_size


@FLATTENS_ON_2_11
def test_attention_of_split_heads_with_a_plain_learned_mask_equals_one_process(world_size):
    assert run_on_ranks(attention_with_a_learned_mask, world_size, world_size=world_size) == ["ok"] * world_size


@FLATTENS_ON_2_11
def test_rotary_matmul_of_split_heads_equals_one_process(world_size):
    assert run_on_ranks(rotary_as_matmul, world_size, world_size=world_size) == ["ok"] * world_size

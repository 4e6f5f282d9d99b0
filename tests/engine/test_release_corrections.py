"""The corrections the engine installs on torch 2.11 only, proven on every release with the exact form forced.

torch 2.11's DTensor writes ``index_put`` into a ``self`` split along an indexed dim wrongly
(``repros/torch_index_put_split_self.py``), has no strategy for ``binary_cross_entropy_with_logits``,
``index_add`` and ``index_copy`` (``repros/torch_no_decomposition_strategy.py``), and overcounts a convolution's
weight gradient unless the input is split along its batch on the first mesh dim
(``repros/torch_conv_weight_grad_partial.py``). The engine computes the first two another way and refuses the
third (``_engine/corrections.py``, ``_rules/builtin_pack.py``). CI runs the suite on the newest torch only, so each
case runs twice: as the release runs it, and with the 2.11 form forced, each compared, values and gradients, with
the same program on plain tensors in one process (1-D mesh on 2 ranks, (2, 2) on 4).
"""

from __future__ import annotations

import pytest
import torch

from _ranks import close, forced_defect, mesh_for, shard
from keras_dtensor_mixfix.testing import run_on_ranks

FORCED = pytest.mark.parametrize("forced", [False, True], ids=["as_the_release_runs", "2_11_form_forced"])


def index_put_into_split_rows(world_size, forced):
    """``x.index_put((rows,), values)`` with x split along the rows, plain rows and values (and, the other way,
    values split and x plain): values and gradients equal one process."""
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import Replicate, Shard

    m = mesh_for(world_size)
    torch.manual_seed(5)
    whole, rows, values = torch.randn(8, 4), torch.tensor([1, 6, 6, 3]), torch.randn(4, 4)
    weights = torch.randn(8, 4)
    for accumulate in (False, True):
        reference_x, reference_values = whole.clone().requires_grad_(), values.clone().requires_grad_()
        expected = reference_x.index_put((rows,), reference_values, accumulate=accumulate)
        (expected * weights).sum().backward()
        split_rows = [Replicate()] * (m.ndim - 1) + [Shard(0)]
        # x split along the indexed rows; then plain x beside split values
        for x_placements, values_placements in ((split_rows, None), (None, split_rows)):
            x = whole.clone().requires_grad_() if x_placements is None else shard(whole, m, x_placements, True)
            v = values.clone().requires_grad_() if values_placements is None else shard(
                values, m, values_placements, True)
            with forced_defect("index_put_split_self_misplaced", forced), mf.patched():
                out = x.index_put((rows,), v, accumulate=accumulate)
                (out * weights).sum().backward()
            what = f"accumulate={accumulate}, x {x_placements}, values {values_placements}"
            close(out, expected.detach(), f"index_put value, {what}")
            close(x.grad, reference_x.grad, f"gradient of x, {what}")
            close(v.grad, reference_values.grad, f"gradient of values, {what}")
    return "ok"


@FORCED
def test_index_put_into_a_tensor_split_along_the_indexed_dim_equals_one_process(world_size, forced):
    assert run_on_ranks(index_put_into_split_rows, world_size, forced, world_size=world_size) == ["ok"] * world_size


def logits_loss_over_a_split_batch(world_size, forced):
    """``binary_cross_entropy_with_logits`` of split logits with plain targets, class weights and positive weights,
    every reduction: values and the logits' gradient equal one process."""
    import torch.nn.functional as F

    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import Replicate, Shard

    m = mesh_for(world_size)
    torch.manual_seed(6)
    logits, targets = torch.randn(6, 3) * 4, torch.rand(6, 3)  # large logits: the formula's stable form matters
    weight, pos_weight = torch.rand(3) + 0.5, torch.rand(3) + 0.5
    batch_split = [Shard(0)] + [Replicate()] * (m.ndim - 1)
    for reduction in ("mean", "sum", "none"):
        for extra in ({}, {"weight": weight}, {"pos_weight": pos_weight}, {"weight": weight, "pos_weight": pos_weight}):
            reference = logits.clone().requires_grad_()
            expected = F.binary_cross_entropy_with_logits(reference, targets, reduction=reduction, **extra)
            expected.sum().backward()
            split = shard(logits, m, batch_split, True)
            with forced_defect("no_strategy_from_decomposition", forced), mf.patched():
                got = F.binary_cross_entropy_with_logits(split, targets, reduction=reduction, **extra)
                got.sum().backward()
            what = f"reduction={reduction}, {sorted(extra)}"
            close(got, expected.detach(), f"loss, {what}", rtol=1e-5, atol=1e-6)
            close(split.grad, reference.grad, f"gradient of the logits, {what}", rtol=1e-5, atol=1e-6)
    return "ok"


@FORCED
def test_logits_loss_over_a_split_batch_equals_one_process(world_size, forced):
    assert (run_on_ranks(logits_loss_over_a_split_batch, world_size, forced, world_size=world_size)
            == ["ok"] * world_size)


def index_writes_into_plain_tensors(world_size, forced):
    """In-place and out-of-place ``index_add`` / ``index_copy`` into a plain tensor from a split index or source:
    the values equal one process (the plain result written whole)."""
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import Replicate, Shard

    m = mesh_for(world_size)
    torch.manual_seed(7)
    whole, index, source = torch.randn(4, 4), torch.tensor([2, 0, 3, 1]), torch.randn(4, 4)
    split = [Replicate()] * (m.ndim - 1) + [Shard(0)]
    for name in ("index_add", "index_copy"):
        for split_index in (True, False):
            expected = getattr(whole, name)(0, index, source)
            index_operand = shard(index, m, split) if split_index else index
            source_operand = source if split_index else shard(source, m, split)
            target = whole.clone()
            with forced_defect("no_strategy_from_decomposition", forced), mf.patched():
                getattr(target, name + "_")(0, index_operand, source_operand)
                out = getattr(whole, name)(0, index_operand, source_operand)
            what = f"{name}, the {'index' if split_index else 'source'} split"
            assert type(target) is torch.Tensor
            close(target, expected, f"in place: {what}")
            close(out, expected, f"out of place: {what}")
    return "ok"


@FORCED
def test_index_writes_into_plain_tensors_equal_one_process(world_size, forced):
    assert (run_on_ranks(index_writes_into_plain_tensors, world_size, forced, world_size=world_size)
            == ["ok"] * world_size)


def convolution_refusal(world_size):
    """With torch 2.11's convolution defect forced: a mixed convolution of a replicated input whose weight wants a
    gradient is refused with the layout that works; that layout (the input split along its batch on the first mesh
    dim) runs, values and the plain weight's gradient equal one process."""
    import torch.nn.functional as F

    import keras_dtensor_mixfix as mf
    from keras_dtensor_mixfix import MixedOperandError
    from keras_dtensor_mixfix._torch.versions import release_of
    from torch.distributed.tensor import Replicate, Shard

    m = mesh_for(world_size)
    torch.manual_seed(8)
    x, w = torch.randn(4, 4, 8), torch.randn(3, 4, 2)
    reference = w.clone().requires_grad_()
    expected = F.conv1d(x, reference, stride=2)
    expected.sum().backward()
    with forced_defect("conv_weight_grad_partial", True), mf.patched():
        with pytest.raises(MixedOperandError) as refused:
            F.conv1d(shard(x, m, [Replicate()] * m.ndim), w.clone().requires_grad_(), stride=2)
    message = str(refused.value)
    assert "Partial" in message and "x.redistribute(mesh, [Shard(0)]" in message, message
    if m.ndim == 2 and release_of(torch.__version__) in ((2, 14), (2, 15)):
        # those releases cannot plan this backward on a 2-D mesh at all (repros/torch_conv_backward_2d_mesh.py)
        return "ok"
    with forced_defect("conv_weight_grad_partial", True), mf.patched():
        weight = w.clone().requires_grad_()
        out = F.conv1d(shard(x, m, [Shard(0)] + [Replicate()] * (m.ndim - 1)), weight, stride=2)
        out.sum().backward()
    close(out, expected.detach(), "conv1d of a batch-split input")
    assert type(weight.grad) is torch.Tensor
    close(weight.grad, reference.grad, "the plain weight's gradient")
    return "ok"


def test_a_convolution_2_11_would_get_wrong_is_refused_and_the_advice_works(world_size):
    assert run_on_ranks(convolution_refusal, world_size, world_size=world_size) == ["ok"] * world_size


def not_equal_of_split_ids(world_size, forced):
    """``torch.ne`` of split token ids and a plain tensor beside them: the values of one process. (Against a plain
    0-dim tensor, which DTensor takes as it is, the call is not mixed: the Keras integration's ``not_equal`` covers
    keras_hub's padding mask, ``tests/keras_integration/test_keras_ops_tensor.py``.)"""
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import Replicate, Shard

    m = mesh_for(world_size)
    ids = torch.tensor([[3, 0, 5, 0], [0, 7, 7, 1]])
    split = shard(ids, m, [Replicate()] * (m.ndim - 1) + [Shard(1)])
    with forced_defect("ne_tensor_without_strategy", forced), mf.patched():
        against_plain = torch.ne(split, torch.tensor([[3, 1, 5, 0], [0, 0, 7, 1]]))
    close(against_plain, ids != torch.tensor([[3, 1, 5, 0], [0, 0, 7, 1]]), "ne against a plain tensor")
    return "ok"


@FORCED
@pytest.mark.parametrize("world_size", [2])  # an elementwise op: one mesh shows it
def test_not_equal_beside_a_plain_operand_equals_one_process(world_size, forced):
    assert run_on_ranks(not_equal_of_split_ids, world_size, forced, world_size=world_size) == ["ok"] * world_size

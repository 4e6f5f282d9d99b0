"""Minimal pure-torch repros of the torch bugs the package works around, each tied to the releases it was run on.

``torch_bug`` reads, per repro, the releases on which it failed (the bug is there) and those on which it passed
(fixed): on a release where it failed it runs as a strict expected failure, so that the release that fixes it
fails the suite and the workaround it names can be re-checked; on a release where it passed it must pass; on a
release it was not run on (a newer torch, opted in) it runs as a non-strict expected failure that says so.
CI runs this file on every supported minor release (CONTRIBUTING.md, "The supported torch range").
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from keras_dtensor_mixfix._torch.versions import release_of
from keras_dtensor_mixfix.testing import RankError, _run_on_ranks_rejoining, run_on_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "repros"))

import torch_activation_backward_strides  # noqa: E402
import torch_argmax_2d  # noqa: E402
import torch_boolean_mask_index  # noqa: E402
import torch_clip_grad_norm_two_meshes  # noqa: E402
import torch_compile_dtensor_output_without_gradient  # noqa: E402
import torch_compile_mutated_dtensor_input  # noqa: E402
import torch_conv_backward_2d_mesh  # noqa: E402
import torch_conv_channel_split  # noqa: E402
import torch_conv_handler_unsplit  # noqa: E402
import torch_conv_weight_grad_partial  # noqa: E402
import torch_cosine_embedding_loss_split_features  # noqa: E402
import torch_cumsum_negative_dim  # noqa: E402
import torch_dcp_load_reads_whole_saved_tensor  # noqa: E402
import torch_dtensor_argmax_compiled  # noqa: E402
import torch_dtensor_one_hot_compiled  # noqa: E402
import torch_dynamo_compiles_dtensor_unflatten  # noqa: E402
import torch_dynamo_hasattr_dtensor  # noqa: E402
import torch_embedding_mask_2d  # noqa: E402
import torch_flip_no_strategy  # noqa: E402
import torch_foreach_inplace_partial  # noqa: E402
import torch_fused_sgd_dtensor  # noqa: E402
import torch_index_put_inplace  # noqa: E402
import torch_index_put_split_self  # noqa: E402
import torch_mse_loss_mean_backward  # noqa: E402
import torch_ne_tensor_no_strategy  # noqa: E402
import torch_nll_loss_weighted_mean  # noqa: E402
import torch_no_decomposition_strategy  # noqa: E402
import torch_pad_2d_mesh  # noqa: E402
import torch_scatter_add_src_misaligned  # noqa: E402
import torch_stack_negative_dim  # noqa: E402
import torch_view_flatten_split_dim  # noqa: E402
import torch_view_two_axes_one_dim  # noqa: E402


EVERY_RELEASE = ((2, 11), (2, 12), (2, 13), (2, 14), (2, 15))
"""The supported minor releases, each run against every repro below (2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0)."""
AFTER_2_11 = EVERY_RELEASE[1:]


def torch_bug(reason, broken=EVERY_RELEASE, fixed=()):
    """The marker of a repro test: the bug was seen on the ``broken`` releases, not on the ``fixed`` ones."""
    release = release_of(torch.__version__)
    if release in fixed:
        return lambda test: test  # no marker: it must pass
    if release in broken:
        return pytest.mark.xfail(strict=True, raises=RankError, reason=f"torch {torch.__version__}: {reason}")
    return pytest.mark.xfail(strict=False, raises=RankError,
                             reason=f"torch {torch.__version__} was not checked against this repro: {reason}")


def _run_repro(repro, *expected, world_size=4, on_2_11=None):
    """Run ``repro`` on ``world_size`` ranks; a failure must be the torch bug it shows (every ``expected`` text
    in it; on torch 2.11, every ``on_2_11`` text where the same bug shows another way there)."""
    if on_2_11 is not None and release_of(torch.__version__) == (2, 11):
        expected = on_2_11
    try:
        # a failing repro (most of them, strict xfails) keeps the workers, on a new process group: pure torch
        _run_on_ranks_rejoining(repro, world_size=world_size, timeout=300)
    except RankError as error:
        assert all(text in str(error) for text in expected), error
        raise


@torch_bug("DTensor's embedding on a 2-D mesh builds the _MaskPartial "
           "mask from the ids before gathering them (IndexError); worked around in the Keras take")
def test_embedding_with_ids_split_on_the_tables_other_mesh_axis():
    _run_repro(torch_embedding_mask_2d.repro, "IndexError", "shape of the mask")


@torch_bug("DTensor's argmax over a dim split on a 2-D mesh, one row per "
           "rank, fails reshaping the gathered pieces; worked around in the Keras argmax/argmin",
           broken=EVERY_RELEASE[:-1], fixed=((2, 15),))
def test_argmax_over_a_dim_split_on_a_2d_mesh_with_one_row_per_rank():
    _run_repro(torch_argmax_2d.repro, "RuntimeError", "is invalid for input of size")


@torch_bug("TorchDynamo answers hasattr(dtensor, 'to_local') False while "
           "tracing; worked around in the Keras attention (isinstance instead)")
def test_hasattr_of_a_dtensor_method_under_torch_compile():
    _run_repro(torch_dynamo_hasattr_dtensor.repro, "AssertionError", "hasattr/isinstance compiled (False, True)",
               world_size=2)


@torch_bug("AOTAutograd gives a DTensor input modified in place under "
           "torch.compile a plain tangent (and miscounts its forward outputs); keras_hub Gemma met it "
           "after a graph break, avoided by tracing Keras' cast of a NumPy value")
def test_compiled_in_place_change_of_a_dtensor_input_that_requires_grad():
    _run_repro(torch_compile_mutated_dtensor_input.repro, "RuntimeError", "got mixed torch.Tensor and DTensor",
               world_size=2)


@torch_bug("a compiled function's DTensor output that no gradient reaches "
           "gets a plain zero tangent, which AOTAutograd refuses; keras_hub Gemma3n meets it under "
           "jit_compile=True after a graph break (docs/keras.md)")
def test_compiled_dtensor_output_that_no_gradient_reaches():
    _run_repro(torch_compile_dtensor_output_without_gradient.repro, "RuntimeError",
               "Expected a DTensor tangent but got a plain Tensor", world_size=2,
               on_2_11=("RuntimeError", "tensor subclass where we guessed its", "metadata incorrectly"))


@torch_bug("DTensor's argmax along a sharded dim reads its piece's offset "
           "from a tensor, a data-dependent graph break; worked around in the Keras integration "
           "(each piece's winner gathered while compiling)")
def test_argmax_along_a_sharded_dim_under_torch_compile_fullgraph():
    _run_repro(torch_dtensor_argmax_compiled.repro, "data-dependent expression", world_size=2)


@torch_bug("backward() inside a compiled function makes TorchDynamo compile "
           "DTensor.__tensor_unflatten__ as frames; the Keras integration runs the step's backward "
           "with torch.compiler.disable")
def test_backward_inside_torch_compile_compiles_dtensor_unflatten():
    _run_repro(torch_dynamo_compiles_dtensor_unflatten.repro, "AssertionError",
               "TorchDynamo compiled DTensor.__tensor_unflatten__ as a frame", world_size=2)


@torch_bug("one_hot of a DTensor under torch.compile meets "
           "aten._assert_async.msg, which has no DTensor sharding strategy (keras_hub Qwen MoE compiled)",
           broken=AFTER_2_11, fixed=((2, 11),))
def test_one_hot_of_a_dtensor_under_torch_compile_fullgraph():
    _run_repro(torch_dtensor_one_hot_compiled.repro, "_assert_async", world_size=2)


@torch_bug("DTensor's class-weighted mean nll_loss over a batch split across "
           "ranks averages each rank's own mean (pytorch/pytorch#185167); the package computes the "
           "mixed call right (_engine/corrections.py)",
           broken=EVERY_RELEASE[:3], fixed=((2, 14), (2, 15)))
def test_weighted_mean_nll_loss_over_a_split_batch():
    _run_repro(torch_nll_loss_weighted_mean.repro, "AssertionError", "Scalars are not close", world_size=2)


@torch_bug("DTensor runs an in-place _foreach_* op into a Partial DTensor as a no-op, so foreach "
           "optimizers and clipping over Partial gradients update wrongly; the package runs the mixed calls exactly "
           "(_engine/foreach_partial.py)",
           broken=((2, 11),), fixed=AFTER_2_11)
def test_inplace_foreach_into_a_partial_dtensor():
    _run_repro(torch_foreach_inplace_partial.repro, "AssertionError", "in-place foreach on Partial", world_size=2)


@torch_bug("DTensor's stack with a negative dim labels inputs split at or after the new dim split one "
           "dim further (a wrong full tensor); the package runs the mixed calls with the dim made non-negative "
           "(_engine/corrections.py)",
           broken=((2, 11),), fixed=AFTER_2_11)
def test_stack_along_a_negative_dim_of_inputs_split_along_their_last_dim():
    _run_repro(torch_stack_negative_dim.repro, "AssertionError", "stack along -1", world_size=2)


@torch_bug("DTensor has no sharding strategy for _fused_sgd_, so SGD(fused=True) cannot step DTensor "
           "parameters; the package's error for a mixed list names that refusal (docs/rules.md, Devices)")
def test_fused_sgd_over_dtensor_parameters():
    _run_repro(torch_fused_sgd_dtensor.repro, "NotImplementedError", "_fused_sgd_", world_size=2)


@torch_bug("DTensor has no sharding strategy for the in-place index_put_ (x[index] = values, Keras' "
           "slice_update); the package runs the mixed calls as index_put written back, and Keras' slice_update on the "
           "replicated values' local tensors (_engine/corrections.py, _keras/ops/tensor_ops.py)",
           broken=((2, 11),), fixed=AFTER_2_11)
def test_inplace_index_put_of_dtensors():
    _run_repro(torch_index_put_inplace.repro, "NotImplementedError", "index_put_", world_size=2)


def _clip_two_meshes_patched():
    """The repro with the package's patch (rank workers run unpatched otherwise)."""
    import keras_dtensor_mixfix as mf

    with mf.patched():
        torch_clip_grad_norm_two_meshes.repro()


@torch_bug("DTensor refuses ops on operands from two meshes over the same "
           "ranks, so clip_grad_norm_ over parameters on two meshes fails; the package takes a whole "
           "value on another mesh as a plain tensor (_engine/meshes.py)")
def test_clip_grad_norm_over_parameters_on_two_meshes():
    _run_repro(torch_clip_grad_norm_two_meshes.repro, "same mesh", world_size=2)  # a ValueError on 2.12


def test_clip_grad_norm_over_parameters_on_two_meshes_patched():
    """The same program with the package: it runs and equals one process."""
    run_on_ranks(_clip_two_meshes_patched, world_size=2, timeout=300)


@torch_bug("DTensor's mse_loss (and huber, smooth_l1, soft_margin, "
           "binary_cross_entropy) mean backward over a split input divides by each rank's element "
           "count; the package computes the mixed calls right (_engine/corrections.py)")
def test_mean_mse_loss_gradient_over_a_split_input():
    _run_repro(torch_mse_loss_mean_backward.repro, "AssertionError", "not close", world_size=2)


@torch_bug("DTensor's cosine_embedding_loss over inputs split along the "
           "feature dim gives a wrong value (a gap the package cannot refuse: docs/rules.md)")
def test_cosine_embedding_loss_over_inputs_split_along_features():
    _run_repro(torch_cosine_embedding_loss_split_features.repro, "AssertionError", "not close", world_size=2)


@torch_bug("DTensor's scatter_add splits a src larger than the index at "
           "other rows than the index; the package refuses the mixed call (_rules/builtin_pack.py)")
def test_scatter_add_with_a_src_larger_than_the_index_along_the_split_dim():
    _run_repro(torch_scatter_add_src_misaligned.repro, "AssertionError", "not close", world_size=2)


@torch_bug("DTensor cannot index with a boolean mask (nonzero has no "
           "strategy); the package indexes local pieces for a plain mask (_engine/corrections.py)")
def test_boolean_mask_index_of_a_replicated_dtensor():
    _run_repro(torch_boolean_mask_index.repro, "RuntimeError", "nonzero", world_size=2)


@torch_bug("torch.distributed.checkpoint reads a tensor saved whole in "
           "full on every rank that loads a piece of it (docs/keras.md, Saving, loading and memory)")
def test_dcp_load_of_a_tensor_saved_whole_reads_it_whole_on_every_rank():
    _run_repro(torch_dcp_load_reads_whole_saved_tensor.repro, "AssertionError", "bytes to load its", world_size=2)


@torch_bug("DTensor's convolution of an input split along its channels runs "
           "the kernel on the piece with the whole weight; worked around in the Keras conv")
def test_convolution_of_an_input_split_along_its_channels():
    # on 2.11 the convolution handler refuses the call before it computes (test_conv_handler_... below)
    _run_repro(torch_conv_channel_split.repro, "RuntimeError", "to have 8 channels", world_size=2,
               on_2_11=("RuntimeError", "tensor parallel convolution"))


@torch_bug("DTensor declares softplus's and elu's gradient contiguous over a "
           "piece the kernel wrote transposed, so a later reshape views it and fails; worked around in "
           "the Keras activations")
def test_reshape_of_an_activation_gradient_laid_out_transposed():
    _run_repro(torch_activation_backward_strides.repro, "RuntimeError", "view size is not compatible", world_size=2)


@torch_bug("DTensor accepts a view unflattening a dim split over both axes of "
           "a 2-D mesh into a size only the first divides, then fails viewing the pieces; worked around "
           "in the Keras reshape (the gradient laid out as the forward output was)")
def test_view_unflattening_a_dim_split_over_two_mesh_axes():
    _run_repro(torch_view_two_axes_one_dim.repro, "RuntimeError", "is invalid for input of size")


@torch_bug("DTensor's index_put into a self split along an indexed dim keeps the split and writes global indices "
           "into each piece (an IndexError, or a silently wrong row); the package replicates self for the mixed "
           "calls it promotes (_engine/corrections.py)",
           broken=((2, 11),), fixed=AFTER_2_11)
def test_index_put_into_a_self_split_along_an_indexed_dim():
    _run_repro(torch_index_put_split_self.repro, "IndexError", "out of bounds", world_size=2)


@torch_bug("DTensor has no strategy for ops later releases derive from their decompositions "
           "(binary_cross_entropy_with_logits, index_add_); the package computes the mixed calls another way "
           "(_engine/corrections.py)",
           broken=((2, 11),), fixed=AFTER_2_11)
def test_an_op_without_a_strategy_of_its_own():
    _run_repro(torch_no_decomposition_strategy.repro, "NotImplementedError", "binary_cross_entropy_with_logits",
               world_size=2)


@torch_bug("DTensor's convolution handler checks every call against the limits of its tensor-parallel "
           "convolution, so a replicated conv1d with kernel 3 and stride 1 raises; a mixed call gets the package's "
           "error naming it",
           broken=((2, 11),), fixed=AFTER_2_11)
def test_conv_handler_refuses_a_replicated_convolution():
    _run_repro(torch_conv_handler_unsplit.repro, "RuntimeError", "tensor parallel convolution", world_size=2)


@torch_bug("DTensor cannot flatten several dims when one after the first is split, so CPU attention with a mask "
           "and the heads split fails (tests/patterns/test_public_failure_patterns.py leaves that pattern out there)",
           broken=((2, 11),), fixed=AFTER_2_11)
def test_view_flattening_a_split_dim():
    _run_repro(torch_view_flatten_split_dim.repro, "RuntimeError", "flatten multiple dimensions", world_size=2)


@torch_bug("DTensor's cumsum with a negative dim ignores that the input is split along it (silently wrong); the "
           "Keras cumsum counts the axis from the start", broken=((2, 11), (2, 12), (2, 13)),
           fixed=((2, 14), (2, 15)))
def test_cumsum_along_a_negative_split_dim():
    _run_repro(torch_cumsum_negative_dim.repro, "AssertionError", "not close", world_size=2)


@torch_bug("DTensor has no strategy for ne.Tensor; the package computes a mixed one as logical_not(eq)",
           broken=((2, 11),), fixed=AFTER_2_11)
def test_not_equal_of_dtensors():
    _run_repro(torch_ne_tensor_no_strategy.repro, "NotImplementedError", "aten.ne.Tensor", world_size=2)


@torch_bug("DTensor has no strategy for flip, which cumsum's backward calls; the Keras cumsum works around it",
           broken=((2, 11),), fixed=AFTER_2_11)
def test_flip_of_a_dtensor():
    _run_repro(torch_flip_no_strategy.repro, "NotImplementedError", "aten.flip", world_size=2)


@torch_bug("DTensor's constant_pad_nd on a 2-D mesh returns one placement instead of two; the Keras pad "
           "works around it", broken=((2, 11),), fixed=AFTER_2_11)
def test_pad_on_a_two_dimensional_mesh():
    _run_repro(torch_pad_2d_mesh.repro, "placements", world_size=2)


@torch_bug("DTensor labels a convolution's weight and bias gradients Partial whatever the input's layout, so with a "
           "replicated input they come out multiplied by the ranks; the package refuses the mixed calls that would "
           "meet it (_rules/builtin_pack.py)",
           broken=((2, 11),), fixed=AFTER_2_11)
def test_convolution_weight_gradient_of_a_replicated_input():
    _run_repro(torch_conv_weight_grad_partial.repro, "AssertionError", "not close", world_size=2)


@torch_bug("DTensor cannot plan a convolution's backward on a 2-D mesh with the input split along its batch on one "
           "mesh dim; a mixed call's backward gets the package's error naming it",
           broken=((2, 14), (2, 15)), fixed=EVERY_RELEASE[:3])
def test_convolution_backward_on_a_2d_mesh_with_a_batch_split_input():
    _run_repro(torch_conv_backward_2d_mesh.repro, "AssertionError", "convolution_backward", world_size=4)

"""Minimal pure-torch repros of the torch bugs the package works around, run from the upstream-defect table.

``torch_bug`` reads, per repro, its entry of ``_upstream.DEFECTS``: the releases on which it failed (the bug is
there) and those on which it passed (fixed). On a release where it failed it runs as a strict expected failure, so
that the release that fixes it fails the suite until the table says so (and the table then stops installing the
workaround there); on a release where it passed it must pass; on a release it was not run on (a newer torch, opted
in) it runs as a non-strict expected failure that says so. CI runs this file on every supported minor release
(CONTRIBUTING.md, "The supported torch range"), the repros marked ``launches`` (each compiles in fresh processes) on
the oldest and the newest.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from keras_dtensor_mixfix._torch.versions import release_of
from keras_dtensor_mixfix._upstream import DEFECTS
from _rejoining_ranks import run_on_ranks_rejoining
from keras_dtensor_mixfix.testing import RankError, run_on_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "repros"))

import torch_activation_backward_strides
import torch_aot_autograd_cache_numpy_operator
import torch_argmax_2d
import torch_boolean_mask_index
import torch_clip_grad_norm_two_meshes
import torch_compile_dtensor_output_without_gradient
import torch_compile_mutated_dtensor_input
import torch_conv_backward_2d_mesh
import torch_conv_channel_split
import torch_conv_handler_unsplit
import torch_conv_weight_grad_partial
import torch_cosine_embedding_loss_split_features
import torch_cumsum_negative_dim
import torch_dcp_load_reads_whole_saved_tensor
import torch_dtensor_argmax_compiled
import torch_dtensor_one_hot_compiled
import torch_dynamo_compiles_dtensor_unflatten
import torch_dynamo_hasattr_dtensor
import torch_elastic_restart_stale_gloo_address
import torch_embedding_mask_2d
import torch_flip_no_strategy
import torch_foreach_inplace_partial
import torch_fused_sgd_dtensor
import torch_fx_graph_cache_device_mesh_hash
import torch_index_put_inplace
import torch_index_put_split_self
import torch_local_tensor_mesh_coordinate_per_rank
import torch_mse_loss_mean_backward
import torch_ne_tensor_no_strategy
import torch_nll_loss_weighted_mean
import torch_no_decomposition_strategy
import torch_pad_2d_mesh
import torch_scatter_add_src_misaligned
import torch_sdpa_cpu_no_strategy
import torch_stack_negative_dim
import torch_view_flatten_split_dim
import torch_view_two_axes_one_dim


REPROS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "repros")

NOT_RUN_HERE = {
    "sdpa_cpu_sharding_search": "its first call takes minutes on one core (the limitation it shows)",
    "gloo_exit_abort": "it fails about one run in eight; tests/project/test_readme.py runs a program again when it "
                       "ends that way",
}
"""Torch defects of the table whose repro this file does not run, and why."""

_TESTED: set = set()


def torch_bug(repro_module):
    """The marker of a repro test, from the upstream-defect table's entry for ``repro_module``: a strict expected
    failure on the releases the table says are ``broken``, none (it must pass) on those it says are ``fixed``, and a
    non-strict expected failure that says so on a release the table does not list (a newer torch, opted in)."""
    repro = os.path.basename(repro_module.__file__)
    defect = next(defect for defect in DEFECTS if defect.repro == repro)
    _TESTED.add(defect.name)
    release = release_of(torch.__version__)
    reason = f"{defect.summary}; {defect.workaround.value}: {defect.where}"
    if release in defect.fixed:
        return lambda test: test  # no marker: it must pass
    if release in defect.broken:
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
        run_on_ranks_rejoining(repro, world_size=world_size, timeout=300)
    except RankError as error:
        assert all(text in str(error) for text in expected), error
        raise


@torch_bug(torch_embedding_mask_2d)
def test_embedding_with_ids_split_on_the_tables_other_mesh_axis():
    _run_repro(torch_embedding_mask_2d.repro, "IndexError", "shape of the mask")


@torch_bug(torch_argmax_2d)
def test_argmax_over_a_dim_split_on_a_2d_mesh_with_one_row_per_rank():
    _run_repro(torch_argmax_2d.repro, "RuntimeError", "is invalid for input of size")


@torch_bug(torch_dynamo_hasattr_dtensor)
def test_hasattr_of_a_dtensor_method_under_torch_compile():
    _run_repro(torch_dynamo_hasattr_dtensor.repro, "AssertionError", "hasattr/isinstance compiled (False, True)",
               world_size=2)


@torch_bug(torch_compile_mutated_dtensor_input)
def test_compiled_in_place_change_of_a_dtensor_input_that_requires_grad():
    _run_repro(torch_compile_mutated_dtensor_input.repro, "RuntimeError", "got mixed torch.Tensor and DTensor",
               world_size=2)


@torch_bug(torch_compile_dtensor_output_without_gradient)
def test_compiled_dtensor_output_that_no_gradient_reaches():
    _run_repro(torch_compile_dtensor_output_without_gradient.repro, "RuntimeError",
               "Expected a DTensor tangent but got a plain Tensor", world_size=2,
               on_2_11=("RuntimeError", "tensor subclass where we guessed its", "metadata incorrectly"))


@torch_bug(torch_dtensor_argmax_compiled)
def test_argmax_along_a_sharded_dim_under_torch_compile_fullgraph():
    _run_repro(torch_dtensor_argmax_compiled.repro, "data-dependent expression", world_size=2)


@torch_bug(torch_dynamo_compiles_dtensor_unflatten)
def test_backward_inside_torch_compile_compiles_dtensor_unflatten():
    _run_repro(torch_dynamo_compiles_dtensor_unflatten.repro, "AssertionError",
               "TorchDynamo compiled DTensor.__tensor_unflatten__ as a frame", world_size=2)


@pytest.mark.launches
@torch_bug(torch_fx_graph_cache_device_mesh_hash)
def test_a_second_launch_reuses_a_compiled_graph_that_takes_a_device_mesh():
    _run_repro(torch_fx_graph_cache_device_mesh_hash.repro, "AssertionError", "did not reuse", world_size=2)


@pytest.mark.launches
def test_meshes_keyed_by_their_groups_make_a_second_launch_reuse_the_graph():
    """The package's workaround (inside compiled Keras steps): the repro's two launches, each compiling inside
    ``device_meshes_keyed_by_groups()``; the second finds the first's graph (on every release: on 2.11, which does
    not need it, it changes nothing that matters)."""
    call = "step(weight, torch.ones(4, 4))"
    assert call in torch_fx_graph_cache_device_mesh_hash.LAUNCH
    launch = torch_fx_graph_cache_device_mesh_hash.LAUNCH.replace(call, (
        "from keras_dtensor_mixfix._torch.api import device_meshes_keyed_by_groups\n"
        f"with device_meshes_keyed_by_groups():\n    {call}"))
    counts = torch_fx_graph_cache_device_mesh_hash.launched_twice(launch)
    assert counts[0].get("fxgraph_cache_miss") == 1 and counts[1] == {"fxgraph_cache_hit": 1}, counts


@pytest.mark.launches
@torch_bug(torch_elastic_restart_stale_gloo_address)
def test_a_torchrun_restart_gives_the_new_workers_a_store_without_the_dead_ones_keys():
    _run_repro(torch_elastic_restart_stale_gloo_address.repro, "AssertionError", "left in the store", world_size=1)


@pytest.mark.launches
@torch_bug(torch_aot_autograd_cache_numpy_operator)
def test_aot_autograd_cache_keeps_a_graph_with_an_operator_on_a_numpy_value():
    _run_repro(torch_aot_autograd_cache_numpy_operator.repro, "AssertionError", "did not keep the graph", world_size=2)


@torch_bug(torch_dtensor_one_hot_compiled)
def test_one_hot_of_a_dtensor_under_torch_compile_fullgraph():
    _run_repro(torch_dtensor_one_hot_compiled.repro, "_assert_async", world_size=2)


@torch_bug(torch_nll_loss_weighted_mean)
def test_weighted_mean_nll_loss_over_a_split_batch():
    _run_repro(torch_nll_loss_weighted_mean.repro, "AssertionError", "Scalars are not close", world_size=2)


@torch_bug(torch_foreach_inplace_partial)
def test_inplace_foreach_into_a_partial_dtensor():
    _run_repro(torch_foreach_inplace_partial.repro, "AssertionError", "in-place foreach on Partial", world_size=2)


@torch_bug(torch_stack_negative_dim)
def test_stack_along_a_negative_dim_of_inputs_split_along_their_last_dim():
    _run_repro(torch_stack_negative_dim.repro, "AssertionError", "stack along -1", world_size=2)


@torch_bug(torch_local_tensor_mesh_coordinate_per_rank)
def test_a_simulated_meshs_coordinate_computes_its_layout_once():
    _run_repro(torch_local_tensor_mesh_coordinate_per_rank.repro, "AssertionError", "16 times for 16 simulated ranks",
               world_size=1)


@torch_bug(torch_fused_sgd_dtensor)
def test_fused_sgd_over_dtensor_parameters():
    _run_repro(torch_fused_sgd_dtensor.repro, "NotImplementedError", "_fused_sgd_", world_size=2)


@torch_bug(torch_index_put_inplace)
def test_inplace_index_put_of_dtensors():
    _run_repro(torch_index_put_inplace.repro, "NotImplementedError", "index_put_", world_size=2)


def _clip_two_meshes_patched():
    """The repro with the package's patch (rank workers run unpatched otherwise)."""
    import keras_dtensor_mixfix as mf

    with mf.patched():
        torch_clip_grad_norm_two_meshes.repro()


@torch_bug(torch_clip_grad_norm_two_meshes)
def test_clip_grad_norm_over_parameters_on_two_meshes():
    _run_repro(torch_clip_grad_norm_two_meshes.repro, "same mesh", world_size=2)  # a ValueError on 2.12


def test_clip_grad_norm_over_parameters_on_two_meshes_patched():
    """The same program with the package: it runs and equals one process."""
    run_on_ranks(_clip_two_meshes_patched, world_size=2, timeout=300)


@torch_bug(torch_mse_loss_mean_backward)
def test_mean_mse_loss_gradient_over_a_split_input():
    _run_repro(torch_mse_loss_mean_backward.repro, "AssertionError", "not close", world_size=2)


@torch_bug(torch_cosine_embedding_loss_split_features)
def test_cosine_embedding_loss_over_inputs_split_along_features():
    _run_repro(torch_cosine_embedding_loss_split_features.repro, "AssertionError", "not close", world_size=2)


@torch_bug(torch_scatter_add_src_misaligned)
def test_scatter_add_with_a_src_larger_than_the_index_along_the_split_dim():
    _run_repro(torch_scatter_add_src_misaligned.repro, "AssertionError", "not close", world_size=2)


@torch_bug(torch_boolean_mask_index)
def test_boolean_mask_index_of_a_replicated_dtensor():
    _run_repro(torch_boolean_mask_index.repro, "RuntimeError", "nonzero", world_size=2)


@torch_bug(torch_dcp_load_reads_whole_saved_tensor)
def test_dcp_load_of_a_tensor_saved_whole_reads_it_whole_on_every_rank():
    _run_repro(torch_dcp_load_reads_whole_saved_tensor.repro, "AssertionError", "bytes to load its", world_size=2)


@torch_bug(torch_conv_channel_split)
def test_convolution_of_an_input_split_along_its_channels():
    # on 2.11 the convolution handler refuses the call before it computes (test_conv_handler_... below)
    _run_repro(torch_conv_channel_split.repro, "RuntimeError", "to have 8 channels", world_size=2,
               on_2_11=("RuntimeError", "tensor parallel convolution"))


@torch_bug(torch_activation_backward_strides)
def test_reshape_of_an_activation_gradient_laid_out_transposed():
    _run_repro(torch_activation_backward_strides.repro, "RuntimeError", "view size is not compatible", world_size=2)


@torch_bug(torch_view_two_axes_one_dim)
def test_view_unflattening_a_dim_split_over_two_mesh_axes():
    _run_repro(torch_view_two_axes_one_dim.repro, "RuntimeError", "is invalid for input of size")


@torch_bug(torch_index_put_split_self)
def test_index_put_into_a_self_split_along_an_indexed_dim():
    _run_repro(torch_index_put_split_self.repro, "IndexError", "out of bounds", world_size=2)


@torch_bug(torch_no_decomposition_strategy)
def test_an_op_without_a_strategy_of_its_own():
    _run_repro(torch_no_decomposition_strategy.repro, "NotImplementedError", "binary_cross_entropy_with_logits",
               world_size=2)


@torch_bug(torch_conv_handler_unsplit)
def test_conv_handler_refuses_a_replicated_convolution():
    _run_repro(torch_conv_handler_unsplit.repro, "RuntimeError", "tensor parallel convolution", world_size=2)


@torch_bug(torch_sdpa_cpu_no_strategy)
def test_cpu_attention_of_dtensors_with_a_mask_that_needs_no_gradient():
    _run_repro(torch_sdpa_cpu_no_strategy.repro, "NotImplementedError", "_scaled_dot_product_flash_attention_for_cpu",
               world_size=2)


@torch_bug(torch_view_flatten_split_dim)
def test_view_flattening_a_split_dim():
    _run_repro(torch_view_flatten_split_dim.repro, "RuntimeError", "flatten multiple dimensions", world_size=2)


@torch_bug(torch_cumsum_negative_dim)
def test_cumsum_along_a_negative_split_dim():
    _run_repro(torch_cumsum_negative_dim.repro, "AssertionError", "not close", world_size=2)


@torch_bug(torch_ne_tensor_no_strategy)
def test_not_equal_of_dtensors():
    _run_repro(torch_ne_tensor_no_strategy.repro, "NotImplementedError", "aten.ne.Tensor", world_size=2)


@torch_bug(torch_flip_no_strategy)
def test_flip_of_a_dtensor():
    _run_repro(torch_flip_no_strategy.repro, "NotImplementedError", "aten.flip", world_size=2)


@torch_bug(torch_pad_2d_mesh)
def test_pad_on_a_two_dimensional_mesh():
    _run_repro(torch_pad_2d_mesh.repro, "placements", world_size=2)


@torch_bug(torch_conv_weight_grad_partial)
def test_convolution_weight_gradient_of_a_replicated_input():
    _run_repro(torch_conv_weight_grad_partial.repro, "AssertionError", "not close", world_size=2)


@torch_bug(torch_conv_backward_2d_mesh)
def test_convolution_backward_on_a_2d_mesh_with_a_batch_split_input():
    _run_repro(torch_conv_backward_2d_mesh.repro, "AssertionError", "convolution_backward", world_size=4)


def test_every_torch_defect_of_the_table_is_run_here_and_every_repro_is_in_the_table():
    torch_defects = {defect.name for defect in DEFECTS if defect.upstream == "torch"}
    assert _TESTED | set(NOT_RUN_HERE) == torch_defects, "a torch defect of _upstream.DEFECTS has no repro test here"
    in_table = {defect.repro for defect in DEFECTS}
    files = {name for name in os.listdir(REPROS_DIR) if name.endswith(".py")}
    assert files == in_table, f"repros/ and the table differ: {sorted(files ^ in_table)}"

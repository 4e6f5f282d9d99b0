"""The upstream defects the package works around: one table, each with its repro, its releases and its workaround.

Each :class:`Defect` names the minimal repro in ``repros/`` that shows it (pure torch or pure Keras, no package
involved), the releases of the upstream project (torch or Keras) on which that repro was run and failed
(``broken``) or passed (``fixed``), and the package's workaround: what kind it is and where it lives. The table
decides what is installed on the running release (:func:`applies`): a workaround whose defect the running release
has fixed is not installed. ``tests/patterns/test_torch_repros.py`` runs each torch repro from this table on the
running release, as a strict expected failure where the table says ``broken`` and as a test that must pass where
it says ``fixed``, so the release that fixes a defect fails the suite until its entry says so.

A release the table does not list for a defect (a newer torch or Keras, opted in) is taken to be as the nearest listed
release before it (before every listed one: as the oldest): a defect still there on the newest checked release keeps
its workaround on a newer one, a defect fixed there does not.

This module imports nothing of the package (it sits below the torch boundary, which reads it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

Release = Tuple[int, int]
"""A (major, minor) release of torch or Keras."""

TORCH_RELEASES: Tuple[Release, ...] = ((2, 11), (2, 12), (2, 13), (2, 14), (2, 15))
"""The supported torch releases, on each of which CI runs the torch repros (2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0;
those that compile in fresh processes on the oldest and the newest, CONTRIBUTING.md)."""
KERAS_RELEASES: Tuple[Release, ...] = ((3, 12), (3, 13), (3, 14), (3, 15), (3, 16))
"""The supported Keras releases."""


class Workaround(enum.Enum):
    """The kind of a workaround."""

    ENGINE_CORRECTION = "engine correction"
    """The promoted call computed another way (``_engine/``)."""
    BUILTIN_REFUSAL = "built-in refusal"
    """The mixed call refused, naming the defect (the built-in rule pack, ``_rules/builtin_pack.py``)."""
    KERAS_OP_OVERRIDE = "Keras op override"
    """A Keras op computed another way (``_keras/ops/``, ``_keras/step/``)."""
    RELEASE_FORK = "release fork"
    """A copy of an upstream function for the releases that need it (``_keras/step/forked_train_step.py``)."""
    COMPILE_CACHE_KEY = "compile cache key"
    """What a compiled Keras step puts in torch.compile's cache keys while it compiles (``_keras/step/compile.py``,
    through ``_torch/api.py``)."""
    PROCESS_GROUP_STORE = "process group store"
    """Where the process group the package creates keeps its keys (``_keras/backend/distribution_lib.py``)."""
    DOCUMENTED = "documented"
    """Nothing the package can change: the error or limit is named in the documentation."""


@dataclass(frozen=True)
class Defect:
    """One upstream defect.

    Attributes:
        name: unique; what :func:`applies` and the code installing the workaround name it by.
        upstream: ``"torch"`` or ``"keras"``: whose releases ``broken`` and ``fixed`` are.
        repro: the file in ``repros/`` that shows it.
        broken: the releases on which the repro was run and failed.
        fixed: the releases on which the repro was run and passed.
        workaround: its kind.
        where: the package's modules (or pages), comma-separated, that hold the workaround; a workaround's modules
            ask the table for it by name (``tests/unit/torch_boundary/test_upstream_defects.py``).
        summary: what goes wrong, in one sentence.
    """

    name: str
    upstream: str
    repro: str
    broken: Tuple[Release, ...]
    fixed: Tuple[Release, ...]
    workaround: Workaround
    where: str
    summary: str

    def applies(self, release: Optional[Release]) -> bool:
        """Whether ``release`` has this defect (an unlisted release: as the nearest listed one before it)."""
        if release is None or release in self.fixed:
            return False
        if release in self.broken:
            return True
        listed = sorted(self.broken + self.fixed)
        before = [listed_release for listed_release in listed if listed_release < release]
        return (before[-1] if before else listed[0]) in self.broken


_EVERY = TORCH_RELEASES
_ONLY_2_11 = dict(broken=((2, 11),), fixed=TORCH_RELEASES[1:])

DEFECTS: Tuple[Defect, ...] = (
    # -- torch, still there on the newest release checked
    Defect("embedding_mask_2d", "torch", "torch_embedding_mask_2d.py", _EVERY, (),
           Workaround.KERAS_OP_OVERRIDE, "_keras/ops/embedding_ops.py",
           "DTensor's embedding on a 2-D mesh builds the _MaskPartial mask from the ids before gathering them "
           "(IndexError)"),
    Defect("dynamo_hasattr_dtensor", "torch", "torch_dynamo_hasattr_dtensor.py", _EVERY, (),
           Workaround.DOCUMENTED, "docs/troubleshooting.md",
           "TorchDynamo answers hasattr(dtensor, 'to_local') False while tracing"),
    Defect("compile_mutated_dtensor_input", "torch", "torch_compile_mutated_dtensor_input.py", _EVERY, (),
           Workaround.KERAS_OP_OVERRIDE, "_keras/ops/casting.py",
           "AOTAutograd gives a DTensor input modified in place under torch.compile a plain tangent"),
    Defect("compile_dtensor_output_without_gradient", "torch", "torch_compile_dtensor_output_without_gradient.py",
           _EVERY, (), Workaround.KERAS_OP_OVERRIDE, "_keras/ops/reduction_ops.py, _keras/step/forked_train_step.py",
           "a compiled function's DTensor output that no gradient reaches gets a plain zero tangent, which "
           "AOTAutograd refuses"),
    Defect("dtensor_argmax_compiled", "torch", "torch_dtensor_argmax_compiled.py", _EVERY, (),
           Workaround.KERAS_OP_OVERRIDE, "_keras/ops/reduction_ops.py",
           "DTensor's argmax along a sharded dim reads its piece's offset from a tensor: a data-dependent graph "
           "break"),
    Defect("dynamo_compiles_dtensor_unflatten", "torch", "torch_dynamo_compiles_dtensor_unflatten.py", _EVERY, (),
           Workaround.RELEASE_FORK, "_keras/step/forked_train_step.py",
           "backward() inside a compiled function makes TorchDynamo compile DTensor.__tensor_unflatten__ as frames"),
    Defect("local_tensor_mesh_coordinate_per_rank", "torch", "torch_local_tensor_mesh_coordinate_per_rank.py", _EVERY,
           (), Workaround.DOCUMENTED, "docs/testing.md",
           "under the rank simulator a mesh's coordinate computes the mesh layout once per simulated rank: O(ranks²)"),
    Defect("fused_sgd_dtensor", "torch", "torch_fused_sgd_dtensor.py", _EVERY, (),
           Workaround.DOCUMENTED, "docs/rules.md",
           "DTensor has no sharding strategy for _fused_sgd_, so SGD(fused=True) cannot step DTensor parameters"),
    Defect("clip_grad_norm_two_meshes", "torch", "torch_clip_grad_norm_two_meshes.py", _EVERY, (),
           Workaround.ENGINE_CORRECTION, "_engine/meshes.py, _engine/entry.py",
           "DTensor refuses ops on operands from two meshes over the same ranks, so clip_grad_norm_ over "
           "parameters on two meshes fails"),
    Defect("mse_loss_mean_backward", "torch", "torch_mse_loss_mean_backward.py", _EVERY, (),
           Workaround.ENGINE_CORRECTION, "_engine/corrections.py",
           "DTensor's elementwise losses' mean over a split input averages each rank's mean and divides the "
           "backward by each rank's element count"),
    Defect("cosine_embedding_loss_split_features", "torch", "torch_cosine_embedding_loss_split_features.py",
           _EVERY, (), Workaround.DOCUMENTED, "docs/rules.md",
           "DTensor's cosine_embedding_loss over inputs split along the feature dim gives a wrong value"),
    Defect("scatter_add_src_misaligned", "torch", "torch_scatter_add_src_misaligned.py", _EVERY, (),
           Workaround.BUILTIN_REFUSAL, "_rules/builtin_pack.py",
           "DTensor's scatter_add splits a src larger than the index at other rows than the index"),
    Defect("boolean_mask_index", "torch", "torch_boolean_mask_index.py", _EVERY, (),
           Workaround.ENGINE_CORRECTION, "_engine/corrections.py",
           "DTensor cannot index with a boolean mask (nonzero has no strategy)"),
    Defect("dcp_load_reads_whole_saved_tensor", "torch", "torch_dcp_load_reads_whole_saved_tensor.py", _EVERY, (),
           Workaround.DOCUMENTED, "docs/keras.md",
           "torch.distributed.checkpoint reads a tensor saved whole in full on every rank that loads a piece of it"),
    Defect("conv_channel_split", "torch", "torch_conv_channel_split.py", _EVERY, (),
           Workaround.KERAS_OP_OVERRIDE, "_keras/ops/convolution.py",
           "DTensor's convolution of an input split along its channels runs the kernel on the piece with the "
           "whole weight"),
    Defect("activation_backward_strides", "torch", "torch_activation_backward_strides.py", _EVERY, (),
           Workaround.KERAS_OP_OVERRIDE, "_keras/ops/activations.py",
           "DTensor declares softplus's and elu's gradient contiguous over a piece the kernel wrote transposed"),
    Defect("view_two_axes_one_dim", "torch", "torch_view_two_axes_one_dim.py", _EVERY, (),
           Workaround.KERAS_OP_OVERRIDE, "_keras/ops/reshape.py",
           "DTensor accepts a view unflattening a dim split over both axes of a 2-D mesh, then fails viewing the "
           "pieces"),
    Defect("sdpa_cpu_sharding_search", "torch", "torch_sdpa_cpu_sharding_search.py", ((2, 13),), (),
           Workaround.DOCUMENTED, "docs/troubleshooting.md",
           "DTensor's first CPU scaled_dot_product_attention of split operands searches placements for minutes"),
    Defect("fx_graph_cache_device_mesh_hash", "torch", "torch_fx_graph_cache_device_mesh_hash.py",
           ((2, 12), (2, 13), (2, 14), (2, 15)), ((2, 11),), Workaround.COMPILE_CACHE_KEY,
           "_keras/step/compile.py, _torch/api.py",
           "inductor's FX graph cache key pickles a DeviceMesh graph input with its per-process hash: a compiled "
           "graph that takes a mesh is never reused by the next launch"),
    Defect("aot_autograd_cache_numpy_operator", "torch", "torch_aot_autograd_cache_numpy_operator.py", _EVERY, (),
           Workaround.DOCUMENTED, "docs/keras.md",
           "AOTAutograd's on-disk cache bypasses a graph in which TorchDynamo traced an operator on a NumPy value "
           "(keras_hub Gemma's 1 / np.sqrt(head_dim)): it is traced again at every launch"),
    Defect("elastic_restart_stale_gloo_address", "torch", "torch_elastic_restart_stale_gloo_address.py", _EVERY, (),
           Workaround.PROCESS_GROUP_STORE, "_keras/backend/distribution_lib.py",
           "after torchrun restarts its workers, init_process_group reads the address a dead worker left in the "
           "agent's store and gloo fails to connect (Connection refused)"),
    Defect("gloo_exit_abort", "torch", "torch_gloo_exit_abort.py", ((2, 12), (2, 13), (2, 15)), (),
           Workaround.DOCUMENTED, "docs/troubleshooting.md",
           "a gloo program that finished correctly sometimes aborts at exit (a C++ thread still joinable)"),
    # -- torch, fixed in a later supported release
    Defect("argmax_2d_mesh_one_row_per_rank", "torch", "torch_argmax_2d.py", TORCH_RELEASES[:4], ((2, 15),),
           Workaround.KERAS_OP_OVERRIDE, "_keras/ops/reduction_ops.py",
           "DTensor's argmax over a dim split on a 2-D mesh, one row per rank, fails reshaping the gathered pieces"),
    Defect("nll_loss_weighted_mean", "torch", "torch_nll_loss_weighted_mean.py", TORCH_RELEASES[:3],
           ((2, 14), (2, 15)), Workaround.ENGINE_CORRECTION, "_engine/corrections.py",
           "DTensor's class-weighted mean nll_loss over a split batch averages each rank's own mean "
           "(pytorch/pytorch#185167)"),
    Defect("cumsum_negative_dim_ignored", "torch", "torch_cumsum_negative_dim.py", TORCH_RELEASES[:3],
           ((2, 14), (2, 15)), Workaround.KERAS_OP_OVERRIDE, "_keras/ops/tensor_ops.py",
           "DTensor's cumsum with a negative dim ignores that the input is split along it (silently wrong)"),
    Defect("inplace_foreach_on_partial_dropped", "torch", "torch_foreach_inplace_partial.py",
           broken=((2, 9), (2, 10), (2, 11)), fixed=TORCH_RELEASES[1:],
           workaround=Workaround.ENGINE_CORRECTION, where="_engine/foreach_partial.py, _torch/versions.py",
           summary="DTensor runs an in-place _foreach_* op into a Partial DTensor as a no-op"),
    Defect("stack_negative_dim_misplaced", "torch", "torch_stack_negative_dim.py", **_ONLY_2_11,
           workaround=Workaround.ENGINE_CORRECTION, where="_engine/corrections.py, _keras/ops/tensor_ops.py",
           summary="DTensor's stack with a negative dim labels inputs split at or after the new dim split one dim "
                   "further"),
    Defect("index_put_inplace_without_strategy", "torch", "torch_index_put_inplace.py", **_ONLY_2_11,
           workaround=Workaround.ENGINE_CORRECTION, where="_engine/corrections.py, _keras/ops/tensor_ops.py",
           summary="DTensor has no sharding strategy for the in-place index_put_"),
    Defect("index_put_split_self_misplaced", "torch", "torch_index_put_split_self.py", **_ONLY_2_11,
           workaround=Workaround.ENGINE_CORRECTION, where="_engine/corrections.py",
           summary="DTensor's index_put into a self split along an indexed dim writes global indices into each "
                   "piece"),
    Defect("no_strategy_from_decomposition", "torch", "torch_no_decomposition_strategy.py", **_ONLY_2_11,
           workaround=Workaround.ENGINE_CORRECTION, where="_engine/corrections.py",
           summary="DTensor has no strategy for ops later releases derive from their decompositions "
                   "(binary_cross_entropy_with_logits, index_add_, index_copy_)"),
    Defect("conv_handler_refuses_unsplit", "torch", "torch_conv_handler_unsplit.py", **_ONLY_2_11,
           workaround=Workaround.KERAS_OP_OVERRIDE, where="_keras/ops/convolution.py",
           summary="DTensor's convolution handler holds every call to its tensor-parallel convolution's limits"),
    Defect("conv_weight_grad_partial", "torch", "torch_conv_weight_grad_partial.py", **_ONLY_2_11,
           workaround=Workaround.BUILTIN_REFUSAL, where="_rules/builtin_pack.py, _keras/ops/convolution.py",
           summary="DTensor labels a convolution's weight and bias gradients Partial whatever the input's layout"),
    Defect("view_flatten_split_dim", "torch", "torch_view_flatten_split_dim.py", **_ONLY_2_11,
           workaround=Workaround.KERAS_OP_OVERRIDE,
           where="_keras/ops/local_einsum.py, _keras/ops/tensor_ops.py, _engine/release_refusals.py",
           summary="DTensor cannot flatten several dims into one when a dim after the first is split"),
    Defect("pad_2d_mesh_one_placement", "torch", "torch_pad_2d_mesh.py", **_ONLY_2_11,
           workaround=Workaround.KERAS_OP_OVERRIDE, where="_keras/ops/tensor_ops.py",
           summary="DTensor's constant_pad_nd on a 2-D mesh gives its result one placement"),
    Defect("flip_without_strategy", "torch", "torch_flip_no_strategy.py", **_ONLY_2_11,
           workaround=Workaround.KERAS_OP_OVERRIDE, where="_keras/ops/tensor_ops.py",
           summary="DTensor has no strategy for flip, which cumsum's backward calls"),
    Defect("sdpa_cpu_without_strategy", "torch", "torch_sdpa_cpu_no_strategy.py", **_ONLY_2_11,
           workaround=Workaround.ENGINE_CORRECTION, where="_engine/corrections.py, _engine/attention_corrections.py",
           summary="DTensor has no strategy for CPU's fused attention (_scaled_dot_product_flash_attention_for_cpu), "
                   "which scaled_dot_product_attention runs for a mask that needs no gradient"),
    Defect("ne_tensor_without_strategy", "torch", "torch_ne_tensor_no_strategy.py", **_ONLY_2_11,
           workaround=Workaround.ENGINE_CORRECTION, where="_engine/corrections.py, _keras/ops/tensor_ops.py",
           summary="DTensor has no strategy for ne.Tensor"),
    # -- torch, new in a later supported release
    Defect("one_hot_compiled_assert_async", "torch", "torch_dtensor_one_hot_compiled.py", TORCH_RELEASES[1:],
           ((2, 11),), Workaround.KERAS_OP_OVERRIDE, "_keras/ops/tensor_ops.py",
           "one_hot of a DTensor under torch.compile meets aten._assert_async.msg, which has no sharding strategy"),
    Defect("conv_backward_2d_mesh", "torch", "torch_conv_backward_2d_mesh.py", ((2, 14), (2, 15)),
           TORCH_RELEASES[:3], Workaround.DOCUMENTED, "docs/rules.md",
           "DTensor cannot plan a convolution's backward on a 2-D mesh with the input split along its batch on one "
           "mesh dim"),
    # -- Keras
    Defect("keras_ops_not_one_graph", "keras", "keras_ops_fullgraph.py", ((3, 12), (3, 13), (3, 14)),
           ((3, 15), (3, 16)), Workaround.DOCUMENTED, "docs/keras.md",
           "a Keras op does not trace in one graph under torch.compile (any_symbolic_tensors' tree.flatten)"),
    Defect("keras_duplicate_path_not_a_parameter", "keras", "keras_duplicate_path_not_a_torch_parameter.py",
           ((3, 12), (3, 15), (3, 16)), (), Workaround.KERAS_OP_OVERRIDE, "_keras/step/ddp.py",
           "of two variables with the same path, only one is a torch parameter of the model"),
    Defect("keras_layer_compile_no_region_reuse", "keras", "keras_layer_compile_region_reuse.py",
           ((3, 15),), (), Workaround.KERAS_OP_OVERRIDE, "_keras/step/layer_compile.py",
           "a repeated Keras layer cannot be compiled once and reused (Layer.__call__ has side effects)"),
)
"""Every upstream defect the package works around or documents, one entry each."""

BY_NAME: Dict[str, Defect] = {defect.name: defect for defect in DEFECTS}


def applies(name: str, release: Optional[Release]) -> bool:
    """Whether the upstream ``release`` (torch's or Keras', as the defect says) has the defect ``name``.

    Raises:
        KeyError: no defect has that name.
    """
    return BY_NAME[name].applies(release)

"""Convolutions of DTensors split along anything but the batch: run on whole channels and positions.

DTensor computes ``aten.convolution`` for an input split along its batch, or whole; for an input split along its
channels or positions it runs torch's kernel on this rank's piece with the whole weight (torch 2.12-2.15), which
raises ("expected input[4, 16, 11] to have 32 channels") or, for positions, mismatches shapes:
``repros/torch_conv_channel_split.py``. keras_hub's Qwen3.5 met it in its gated delta net, whose depthwise
``conv1d`` reads the output of a projection that tensor parallelism splits by features.

So an input is made whole along every dim but the batch (the batch split is kept on a mesh with one dim of more
than one rank: each sample is convolved on its own; on a 2-D mesh torch 2.15's convolution backward refuses even
that, so the input is made whole), a split kernel is made whole, and Keras' own function runs on them: one process's
values, differentiably.
Plain tensors, and DTensors already laid out so, go to Keras' function unchanged.

On torch 2.11 DTensor's own convolution cannot be used for that: it refuses a replicated input unless the stride
equals the kernel size (``repros/torch_conv_handler_unsplit.py``) and labels the kernel's gradient a partial sum
whatever the input's layout (``repros/torch_conv_weight_grad_partial.py``). There, the same whole-along-all-but-batch
operands are convolved on each rank's pieces (``local_pieces``): the input's batch piece (on any mesh) with the whole
kernel, whose gradient is then a sum over the ranks that split the batch, and a plain copy everywhere else.
"""

from __future__ import annotations

import functools
from typing import Any

from ..._lifecycle.recorder import PatchRecorder
from ..backend.local_pieces import from_pieces, piece
from ..boundary import keras_modules
from ..boundary.defects import running_release_has
from ..boundary.overrides import Override
from ..boundary.patches import rebind_everywhere
from .normalization import whole_along_axes


_DEFECTS = ("conv_channel_split", "conv_handler_refuses_unsplit", "conv_weight_grad_partial")
"""The upstream defects this override answers: whole channels and positions (the first), on local pieces (2.11)."""


def _convolution_on_batch_split_only(patches: PatchRecorder) -> None:
    from ..._torch.versions import has_defect, running_torch_version

    version = running_torch_version()
    on_pieces = has_defect("conv_handler_refuses_unsplit", version) or has_defect("conv_weight_grad_partial",
                                                                                   version)
    nn = keras_modules.backend_nn()
    for original in (nn.conv, nn.conv_transpose):
        rebind_everywhere(patches, original,
                          _on_local_pieces(original) if on_pieces else _on_batch_split_only(original))


OVERRIDE = Override(
    name="convolution", attributes=("conv", "conv_transpose"),
    description="ops: a convolution of a DTensor split along channels or positions runs on whole ones",
    apply=_convolution_on_batch_split_only,
    needed=lambda: any(running_release_has(name) for name in _DEFECTS),
    kept="ops: convolutions as Keras has them (this torch convolves split DTensors right)")


def _on_batch_split_only(original: Any) -> Any:
    @functools.wraps(original)
    def convolution(inputs: Any, kernel: Any, *args: Any, **kwargs: Any) -> Any:
        # the batch split kept on a 1-D mesh only: on a 2-D mesh torch 2.15's convolution backward refuses an input
        # split over one axis (its strategy "mixes None with placements across mesh dims"), so it runs whole there
        batch_kept = 1 if _split_over_one_mesh_dim(inputs) else 0
        inputs = whole_along_axes(inputs, tuple(range(batch_kept, getattr(inputs, "ndim", 1))))
        kernel = whole_along_axes(kernel, tuple(range(getattr(kernel, "ndim", 0))))
        return original(inputs, kernel, *args, **kwargs)

    return convolution


def _on_local_pieces(original: Any) -> Any:
    """``original`` on each rank's batch piece of the input (every other dim whole) and the whole kernel, wrapped as
    the DTensor laid out as that input: no DTensor convolution runs (torch 2.11)."""

    @functools.wraps(original)
    def convolution(inputs: Any, kernel: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        if isinstance(inputs, DTensor):
            mesh = inputs.device_mesh
            inputs = whole_along_axes(inputs, tuple(range(1, inputs.ndim)))
            layout = tuple(inputs.placements)
        elif isinstance(kernel, DTensor):
            mesh = kernel.device_mesh
            layout = (Replicate(),) * mesh.ndim
        else:
            return original(inputs, kernel, *args, **kwargs)
        whole = (Replicate(),) * mesh.ndim
        kernel_gradient = tuple(Partial() if isinstance(p, Shard) else Replicate() for p in layout)
        local = original(piece(inputs, mesh, layout), piece(kernel, mesh, whole, kernel_gradient), *args, **kwargs)
        return from_pieces(local, mesh, layout, (inputs.shape[0],) + tuple(local.shape[1:]))

    return convolution


def _split_over_one_mesh_dim(tensor: Any) -> bool:
    """A DTensor on a mesh with one dim of more than one rank (or a plain tensor: nothing to decide)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return True
    return sum(size > 1 for size in tensor.device_mesh.shape) <= 1

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
"""

from __future__ import annotations

import functools
from typing import Any

from . import keras_modules
from .._lifecycle.recorder import PatchRecorder
from .normalization import whole_along_axes
from .overrides import Kind, Override
from .patches import rebind_everywhere


def _convolution_on_batch_split_only(patches: PatchRecorder) -> None:
    nn = keras_modules.backend_nn()
    for original in (nn.conv, nn.conv_transpose):
        rebind_everywhere(patches, original, _on_batch_split_only(original))


OVERRIDE = Override(
    name="convolution", kind=Kind.OPS, family="convolution",
    owner="backend_nn() (and every Keras module importing it)",
    attributes=("conv", "conv_transpose"),
    description="ops: a convolution of a DTensor split along channels or positions runs on whole ones",
    apply=_convolution_on_batch_split_only)


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


def _split_over_one_mesh_dim(tensor: Any) -> bool:
    """A DTensor on a mesh with one dim of more than one rank (or a plain tensor: nothing to decide)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return True
    return sum(size > 1 for size in tensor.device_mesh.shape) <= 1

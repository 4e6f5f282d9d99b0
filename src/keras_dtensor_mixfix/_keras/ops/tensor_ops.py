"""Keras ops that write into, encode, stack, pad or sum along DTensors: ``slice_update``, ``one_hot``, ``stack``,
``pad``, ``cumsum``.

- ``slice_update`` clones its input and writes into the clone with ``index_put_``; DTensor refuses
  an in-place op whose strategy needs another placement ("in-place operations that require
  placement changes are not supported"), as for a prompt sharded on the batch axis (keras_hub's
  ``generate()``). A sharded input is made ``Replicate`` first, so the write is allowed; values
  are unchanged and the (small) result is replicated. On torch 2.11, whose DTensor has no strategy for
  ``index_put_`` at all, the replicated values' local tensors are updated and wrapped again.
- ``one_hot`` while compiling or tracing, on the releases the defect table lists (``one_hot_compiled_assert_async``:
  2.12 and later): DTensor has no strategy for the range check torch's ``one_hot`` makes when traced (keras_hub's
  Qwen MoE router); each rank encodes its own piece.
- ``stack`` on torch 2.11, whose DTensor normalizes a negative ``axis`` against the inputs' rank, not the result's,
  so an input split at or after the new dim comes out labelled split along the dim after it: silently wrong values
  (keras_hub's rotary embedding stacks head-split halves with ``axis=-2``; ``repros/torch_stack_negative_dim.py``).
  The axis is made non-negative: the same op.
- ``pad`` on torch 2.11, whose DTensor pads on a 2-D mesh into a result with one placement instead of one per mesh
  dim (malformed, or an ``IndexError``: ``repros/torch_pad_2d_mesh.py``; keras_hub's Qwen3.5 pads its chunks): the
  input is made whole along the padded dims and each rank pads its piece.
- ``cumsum``: on the torch releases whose DTensor ignores that the input is split along a negative ``dim``
  (``repros/torch_cumsum_negative_dim.py``: each rank sums its own piece, silently), the axis is counted from the
  start (the same op); on torch 2.11, whose DTensor has no strategy for the ``flip`` its backward calls
  (``repros/torch_flip_no_strategy.py``; keras_hub's Qwen3.5 sums its gates), the input is made whole along the
  axis and each rank sums its piece, so the backward runs on plain tensors.
- ``not_equal`` on torch 2.11, whose DTensor has no strategy for ``ne.Tensor``
  (``repros/torch_ne_tensor_no_strategy.py``; keras_hub's RWKV7 compares its token ids with 0, a 0-dim tensor DTensor
  takes as it is): ``logical_not(equal)``.
"""

from __future__ import annotations

import functools
from typing import Any

from ..._lifecycle.recorder import PatchRecorder
from ..backend.local_pieces import from_pieces, on_pieces, piece
from ..boundary import keras_modules
from ..boundary.overrides import Override
from ..boundary.patches import rebind_everywhere


def _slice_update_and_one_hot(patches: PatchRecorder) -> None:
    core = keras_modules.core()
    rebind_everywhere(patches, core.slice_update, _replicated_slice_update(core.slice_update))
    from ..._torch.versions import has_defect, running_torch_version

    version = running_torch_version()
    if has_defect("one_hot_compiled_assert_async", version):
        nn = keras_modules.backend_nn()
        rebind_everywhere(patches, nn.one_hot, _local_one_hot(nn.one_hot))
    numpy_module = keras_modules.backend_numpy()
    if has_defect("stack_negative_dim_misplaced", version):
        rebind_everywhere(patches, numpy_module.stack, _stack_on_a_non_negative_axis(numpy_module.stack))
    if has_defect("pad_2d_mesh_one_placement", version):
        rebind_everywhere(patches, numpy_module.pad, _pad_on_local_pieces(numpy_module.pad))
    if has_defect("ne_tensor_without_strategy", version):
        rebind_everywhere(patches, numpy_module.not_equal,
                          _not_equal_as_not_of_equal(numpy_module.not_equal, numpy_module.equal,
                                                     numpy_module.logical_not))
    cumsum_on_pieces = has_defect("flip_without_strategy", version)
    if cumsum_on_pieces or has_defect("cumsum_negative_dim_ignored", version):
        rebind_everywhere(patches, numpy_module.cumsum, _dtensor_cumsum(numpy_module.cumsum, cumsum_on_pieces))


OVERRIDE = Override(
    name="slice_update, one_hot, stack, pad, cumsum and not_equal",
    attributes=("slice_update", "one_hot", "stack", "pad", "cumsum", "not_equal"),
    description="ops: slice_update replicates sharded inputs; one_hot encodes local pieces while compiling; "
                "stack and cumsum take a non-negative axis, pad and cumsum run on local pieces, not_equal is "
                "logical_not(equal) (torch 2.11)",
    apply=_slice_update_and_one_hot)


def _stack_on_a_non_negative_axis(original: Any) -> Any:
    """Keras' ``stack`` with a negative ``axis`` counted from the result's end, for DTensor inputs (torch 2.11)."""

    @functools.wraps(original)
    def stack(x: Any, axis: int = 0) -> Any:
        from torch.distributed.tensor import DTensor

        if (isinstance(axis, int) and axis < 0 and isinstance(x, (list, tuple))
                and any(isinstance(item, DTensor) for item in x)):
            axis += next(item.ndim for item in x if isinstance(item, DTensor)) + 1
        return original(x, axis)

    return stack


def _pad_on_local_pieces(original: Any) -> Any:
    """Keras' ``pad`` of a DTensor on each rank's piece, whole along the padded dims (torch 2.11)."""
    from .normalization import whole_along_axes

    @functools.wraps(original)
    def pad(x: Any, pad_width: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.tensor import DTensor

        if not isinstance(x, DTensor):
            return original(x, pad_width, *args, **kwargs)
        widths = [[int(w) for w in pair] for pair in (pad_width if len(pad_width) == x.ndim
                                                        else [pad_width[0]] * x.ndim)]
        x = whole_along_axes(x, tuple(dim for dim, pair in enumerate(widths) if any(pair)))
        shape = [size + sum(pair) for size, pair in zip(x.shape, widths)]
        return on_pieces(lambda local: original(local, pad_width, *args, **kwargs), [x], x.device_mesh,
                         [x.placements], x.placements, shape)

    return pad


def _not_equal_as_not_of_equal(original: Any, equal: Any, logical_not: Any) -> Any:
    """Keras' ``not_equal`` as ``logical_not(equal)`` where an operand is a DTensor (torch 2.11)."""

    @functools.wraps(original)
    def not_equal(x1: Any, x2: Any) -> Any:
        from torch.distributed.tensor import DTensor

        if isinstance(x1, DTensor) or isinstance(x2, DTensor):
            return logical_not(equal(x1, x2))
        return original(x1, x2)

    return not_equal


def _dtensor_cumsum(original: Any, on_local_pieces: bool) -> Any:
    """Keras' ``cumsum`` of a DTensor along an axis counted from the start; with ``on_local_pieces`` (torch 2.11) on
    each rank's piece, whole along that axis."""
    from .normalization import whole_along_axes

    @functools.wraps(original)
    def cumsum(x: Any, axis: Any = None, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.tensor import DTensor

        if not isinstance(x, DTensor) or not isinstance(axis, int) or x.ndim == 0:
            return original(x, axis, *args, **kwargs)
        axis %= x.ndim
        if not on_local_pieces:
            return original(x, axis, *args, **kwargs)
        x = whole_along_axes(x, axis)
        return on_pieces(lambda local: original(local, axis, *args, **kwargs), [x], x.device_mesh, [x.placements],
                         x.placements, x.shape)

    return cumsum


def _replicated_slice_update(original: Any) -> Any:
    """Keras' ``slice_update`` with a sharded input made ``Replicate`` first; on a torch whose DTensor has no
    strategy for ``index_put_`` (2.11: ``_upstream.DEFECTS``), run on the whole values' local tensors
    (every operand replicated: the same computation as one process) and wrapped as ``Replicate`` again; a plain
    input written with DTensor updates there gets the updates' whole value and stays plain (2.11 cannot flatten
    a head-split update, as Keras' slow path does: ``repros/torch_view_flatten_split_dim.py``)."""
    from ..._torch.versions import has_defect, running_torch_version

    on_local_values = has_defect("index_put_inplace_without_strategy", running_torch_version())
    plain_takes_whole = has_defect("view_flatten_split_dim", running_torch_version())

    @functools.wraps(original)
    def slice_update(inputs: Any, start_indices: Any, updates: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate

        def local(value: Any) -> Any:
            if isinstance(value, DTensor):
                return value.redistribute(value.device_mesh, [Replicate()] * value.device_mesh.ndim).to_local()
            if isinstance(value, (list, tuple)):
                return type(value)(local(item) for item in value)
            return value

        if not isinstance(inputs, DTensor):
            if plain_takes_whole:  # a plain cache written with a DTensor update (keras_hub's generate): plain result
                return original(inputs, local(start_indices), local(updates))
            return original(inputs, start_indices, updates)
        mesh = inputs.device_mesh
        whole = [Replicate()] * mesh.ndim
        if any(not isinstance(p, Replicate) for p in inputs.placements):
            inputs = inputs.redistribute(mesh, whole)
        if not on_local_values:
            return original(inputs, start_indices, updates)
        result = original(local(inputs), local(start_indices), local(updates))
        return DTensor.from_local(result, mesh, whole, run_check=False)

    return slice_update


def _local_one_hot(original: Any) -> Any:
    """Keras' ``one_hot``; while compiling or tracing, of a DTensor's local piece, wrapped with its placements.

    Traced, torch's ``one_hot`` of a DTensor checks its input's range with ``aten._assert_async.msg``,
    which DTensor has no strategy for (``repros/torch_dtensor_one_hot_compiled.py``): a graph break
    inside Keras' ``name_scope`` (keras_hub's Qwen MoE router), and the split graph then returns a
    view of its DTensor input, which AOTAutograd replays with ``as_strided`` ("as_strided not supported
    with DTensor"). Each element is encoded on its own, so the local piece gives this rank's part of the
    result; the new class axis is whole.
    """

    @functools.wraps(original)
    def one_hot(x: Any, num_classes: Any, axis: int = -1, *args: Any, **kwargs: Any) -> Any:
        import torch
        from torch.distributed.tensor import DTensor, Replicate, Shard

        from ..._torch.api import is_exactly, is_traced

        # compiled by torch.compile, or traced by AOTAutograd alone (the block tracer): fake values
        if not (isinstance(x, DTensor) and (torch.compiler.is_compiling() or is_traced(x))
                and all(is_exactly(p, Shard, Replicate) for p in x.placements)):
            return original(x, num_classes, axis, *args, **kwargs)
        encoded = original(piece(x, x.device_mesh, x.placements), num_classes, axis, *args, **kwargs)
        class_dim = axis % encoded.ndim
        placements = [Shard(p.dim + (p.dim >= class_dim)) if isinstance(p, Shard) else p for p in x.placements]
        shape = torch.Size((*x.shape[:class_dim], encoded.shape[class_dim], *x.shape[class_dim:]))
        return from_pieces(encoded, x.device_mesh, placements, shape)

    return one_hot

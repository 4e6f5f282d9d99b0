"""``_foreach_*`` ops: split mixed lists row by row, promote within each row, run each group.

A foreach op is independent per list index ("row"). Rows that hold a DTensor are run as
DTensor foreach calls, grouped by mesh (so parameters on two meshes work); rows that are
all plain run as a plain foreach call. Results are put back in the original order.

The common optimizer case (every row has a DTensor, one mesh, plain operands only read, the
``"replicate"`` rule) has a direct path: once the first call of a shape of lists has been
re-dispatched and DTensor's propagation showed no redistribution (see ``_direct``), later calls
run the foreach kernel on the local lists, without building a DTensor per plain operand.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor

from . import direct as _direct
from . import stats as _stats
from .._rules.decisions import REPLICATE
from .._rules.ops import OpTraits
from .._torch.operators import schema_of
from .caches import remember
from .construct import local_piece, new_dtensor
from .general import promote_general
from .operands import needs_promotion
from .opstate import UNDECIDED, OpState, admission, op_state
from .placements import cached_whole_layout
from .run import call_op, wrap_result

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_NOT_DIRECT = object()


class ForeachPlan(NamedTuple):
    """The direct path's decision for one shape of foreach call (held in ``OpState.fast``)."""

    result: Any
    """``direct.plan``'s answer: the output specs, or ``NO_RESULT`` for an in-place op."""
    pieces: List[Optional[Tuple[slice, ...]]]
    """Each plain operand's local index (this rank's slice; None: all of it), in scan order."""


def _row_mesh(args: Tuple[Any, ...], lists: Tuple[int, ...], row: int) -> Tuple[Optional[Any], bool]:
    """The mesh of the row's first DTensor (None: an all-plain row) and whether the row holds a
    plain tensor."""
    mesh = None
    plain = False
    for position in lists:
        item = args[position][row]
        if isinstance(item, DTensor):
            if mesh is None:
                mesh = item.device_mesh
        elif isinstance(item, torch.Tensor):
            plain = True
    return mesh, plain


def _row_lists(args: Tuple[Any, ...], traits: OpTraits) -> Tuple[int, ...]:
    """The positions of the call's list arguments that hold one item per row (an empty list, such as a
    fused Adam's ``max_exp_avg_sqs`` without amsgrad, holds none and is passed to each group as it is)."""
    lists = tuple(position for position in traits.lists if position < len(args))
    if not lists:
        return lists
    rows = max(len(args[position]) for position in lists)
    return tuple(position for position in lists if len(args[position]) == rows)


def rows_on_several_meshes(args: Tuple[Any, ...], traits: OpTraits) -> bool:
    """Whether the rows of a foreach call hold DTensors on more than one mesh (``promote_foreach`` then runs
    one call per mesh)."""
    lists = _row_lists(args, traits)
    if not lists:
        return False
    first = None
    for row in range(len(args[lists[0]])):
        mesh, _ = _row_mesh(args, lists, row)
        if mesh is None:
            continue
        if first is None:
            first = mesh
        elif mesh is not first and mesh != first:
            return True
    return False


def promote_foreach(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], info: OpState) -> Any:
    """Promote the plain operands of the ``_foreach_*`` call ``func(*args, **kwargs)`` and run it."""
    traits = info.traits
    flags = admission(info, func) if traits.tensor_lists else None
    if flags is not None and flags.direct:
        result = _foreach_direct(func, args, kwargs, traits, info)
        if result is not _NOT_DIRECT:
            return result
    lists = _row_lists(args, traits)
    rows = len(args[lists[0]])
    # A tensor argument that is not a list: a one-element scalar (torch replicates it) or a
    # per-row tensor of scalars (addcdiv_.Tensor), which is indexed like the lists.
    per_row = [i for i, a in enumerate(args) if i not in lists and isinstance(a, torch.Tensor)
               and not isinstance(a, DTensor) and a.dim() == 1 and a.numel() == rows and rows != 1]
    fallback_mesh = next((a.device_mesh for a in args if isinstance(a, DTensor)), None)

    # Plain tensors outside the lists that torch would not take as they are (the per-row ones
    # are indexed like the lists; one-element ones torch replicates itself).
    plain_elsewhere = any(
        needs_promotion(a) for i, a in enumerate(args) if i not in lists and i not in per_row
    ) or any(isinstance(v, torch.Tensor) or isinstance(v, (list, tuple)) for v in kwargs.values())

    groups: Dict[Any, List[int]] = {}
    mixed_groups = set()
    for row in range(rows):
        mesh, has_plain = _row_mesh(args, lists, row)
        mesh = mesh or fallback_mesh  # an all-plain row runs beside a DTensor outside the lists
        groups.setdefault(mesh, []).append(row)
        if has_plain and mesh is not None:
            mixed_groups.add(mesh)

    results: List[Any] = [None] * rows
    returned_list = False
    for mesh, indices in groups.items():
        sub_args = list(args)
        for position in lists:
            sub_args[position] = [args[position][i] for i in indices]
        for position in per_row:
            sub_args[position] = args[position][indices]
        if mesh is None:
            out = func(*sub_args, **kwargs)
        else:
            call_func = func
            if per_row:
                call_func = _scalar_list_overload(func)
                for position in per_row:
                    # DTensor's foreach strategies take per-row scalars only as numbers (they must
                    # live on the CPU anyway): the ScalarList overload is the same computation.
                    sub_args[position] = sub_args[position].tolist()
            if mesh in mixed_groups or plain_elsewhere:
                out = promote_general(call_func, tuple(sub_args), kwargs, traits)
            else:
                # Only DTensors (and scalars torch takes as they are): nothing to promote, e.g. the
                # DTensor half of an optimizer's parameter list that also holds plain parameters. Run
                # as the op's state runs it (an exact form where the release needs one: corrections.py).
                out = op_state(call_func).call(*sub_args, **kwargs)
        if isinstance(out, (list, tuple)):
            returned_list = True
            for index, value in zip(indices, out):
                results[index] = value
    return results if returned_list else None


def _scalar_list_overload(func: Any) -> Any:
    packet = getattr(getattr(torch.ops, func.namespace), schema_of(func).name.split("::")[1])
    overload = getattr(packet, "ScalarList", None)
    if overload is None:
        from .._rules.errors import promotion_error

        raise promotion_error(str(func), "a per-row tensor of scalars has no ScalarList form for DTensor operands")
    return overload


def _foreach_direct(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], traits: OpTraits, info: OpState) -> Any:
    """The direct path, or ``_NOT_DIRECT`` when the call is not its case (the general path runs).

    Its case: eager; tensors only in the positional lists; every row holds a DTensor and all of
    them sit on one mesh; plain operands are read, not written, have more than one element and
    need no gradient. The plan is keyed by the op, the argument layout and every row's specs and
    plain shapes/strides/dtypes, not by scalar values (plans are refused for Partial placements,
    the only ones whose pointwise sharding could depend on a scalar).
    """
    lists = traits.tensor_lists
    for position, value in enumerate(args):
        if position not in lists and isinstance(value, _Tensor):
            return _NOT_DIRECT  # a tensor scalar or per-row tensor: the general path's business
    for value in kwargs.values():
        if isinstance(value, _Tensor) or (type(value) in (list, tuple) and any(isinstance(v, _Tensor) for v in value)):
            return _NOT_DIRECT
    if len(args) <= lists[-1]:
        return _NOT_DIRECT
    rows = len(args[lists[0]])
    if rows == 0 or any(len(args[position]) != rows for position in lists):
        return _NOT_DIRECT
    written = traits.written
    local_lists: List[List[Any]] = [[None] * rows for _ in lists]
    plains: List[Tuple[int, int, Any]] = []  # (list, row, plain tensor)
    peers: List[DTensor] = []  # each row's first DTensor: its plain operands' peer
    # Flat: a DTensor adds its spec, a plain tensor a (shape, stride, dtype) tuple, so the
    # sequence parses one way only.
    key: List[Any] = [len(args), tuple(kwargs)]
    mesh = None
    for row in range(rows):
        peer = None
        row_start = len(plains)
        for column, position in enumerate(lists):
            item = args[position][row]
            kind = type(item)
            if kind is DTensor:
                if peer is None:
                    peer = item
                local = item._local_tensor
                local_kind = type(local)
                if local_kind is not _Tensor and local_kind is not _Parameter:
                    return _NOT_DIRECT  # traced
                local_lists[column][row] = local
                key.append(item._spec)
            elif kind is _Tensor or kind is _Parameter:
                # (with the exact types: placements.layout_cacheable, unrolled over the rows)
                if position in written or item.requires_grad or item.numel() == 1:
                    return _NOT_DIRECT
                key.append((item.shape, item.stride(), item.dtype))
                plains.append((column, row, item))
            else:
                return _NOT_DIRECT
        if peer is None:
            return _NOT_DIRECT  # an all-plain row: run as a plain group by the general path
        device = peer._local_tensor.device
        for _, _, item in plains[row_start:]:
            if item.device != device:
                return _NOT_DIRECT  # on another device than the row's DTensor: the general path decides (devices.py)
        if mesh is None:
            mesh = peer._spec.mesh
        elif peer._spec.mesh is not mesh:
            return _NOT_DIRECT
        peers.append(peer)
    if not plains:
        return _NOT_DIRECT
    plan_key = tuple(key)
    found = info.fast.get(plan_key, UNDECIDED)
    if found is None:
        return _NOT_DIRECT
    new_args = list(args)
    if found is UNDECIDED:
        # First call of this shape: run the promoted call through DTensor, decide from it.
        promoted_lists = [list(args[position]) for position in lists]
        pieces: List[Any] = []
        for column, row, item in plains:
            layout = cached_whole_layout(item, peers[row], traits, (lists[column], row))
            pieces.append(layout.local_index)
            promoted_lists[column][row] = new_dtensor(local_piece(item, layout.local_index), layout.spec, True)
        for column, position in enumerate(lists):
            new_args[position] = promoted_lists[column]
        promoted_args = tuple(new_args)
        planned = _direct.plan(func, promoted_args, kwargs)
        result = _run(info, traits, promoted_args, kwargs, len(plains))
        plan = _direct.confirmed(planned, promoted_args, result)
        # The plan holds each plain operand's local piece: the key fixes all of them.
        remember(info.fast, plan_key, None if plan is None else ForeachPlan(plan, pieces))
        return result
    plan, pieces = found
    for (column, row, item), local_index in zip(plains, pieces):
        local_lists[column][row] = local_piece(item, local_index)
    for column, position in enumerate(lists):
        new_args[position] = local_lists[column]
    out = _run(info, traits, tuple(new_args), kwargs, len(plains))
    if plan is _direct.NO_RESULT:
        return None
    return [wrap_result(o, s) for o, s in zip(out, plan)]


def _run(info: OpState, traits: OpTraits, args: Tuple[Any, ...], kwargs: Dict[str, Any], promoted: int) -> Any:
    result = call_op(info.call, args, kwargs, traits, [("foreach lists", REPLICATE, ())])
    _stats.record(traits.name, [REPLICATE] * promoted)
    return result

"""``_foreach_*`` ops: split mixed lists row by row, promote within each row, run each group.

A foreach op is independent per list index ("row"). Rows that hold a DTensor are run as
DTensor foreach calls, grouped by mesh (so parameters on two meshes work); rows that are
all plain run as a plain foreach call. Results are put back in the original order.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor

from ._ops import OpTraits
from ._promotion import promote_operands, run_promoted


def _list_positions(func: Any, args: Tuple[Any, ...]) -> List[int]:
    arguments = func._schema.arguments
    return [i for i in range(len(args)) if isinstance(arguments[i].type, torch._C.ListType)]


def _row_mesh(args: Tuple[Any, ...], lists: List[int], row: int) -> Optional[Any]:
    for position in lists:
        item = args[position][row]
        if isinstance(item, DTensor):
            return item.device_mesh
    return None


def foreach_call(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], traits: OpTraits) -> Any:
    lists = _list_positions(func, args)
    rows = len(args[lists[0]])
    # A tensor argument that is not a list: a one-element scalar (torch replicates it) or a
    # per-row tensor of scalars (addcdiv_.Tensor), which is indexed like the lists.
    per_row = [i for i, a in enumerate(args) if i not in lists and isinstance(a, torch.Tensor)
               and not isinstance(a, DTensor) and a.dim() == 1 and a.numel() == rows and rows != 1]
    fallback_mesh = next((a.device_mesh for a in args if isinstance(a, DTensor)), None)

    groups: Dict[Any, List[int]] = {}
    for row in range(rows):
        mesh = _row_mesh(args, lists, row) or fallback_mesh
        groups.setdefault(mesh, []).append(row)

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
            new_args, new_kwargs, promoted = promote_operands(call_func, tuple(sub_args), kwargs, traits)
            out = run_promoted(call_func, traits, new_args, new_kwargs, promoted)
        if isinstance(out, (list, tuple)):
            returned_list = True
            for index, value in zip(indices, out):
                results[index] = value
    return results if returned_list else None


def _scalar_list_overload(func: Any) -> Any:
    packet = getattr(getattr(torch.ops, func.namespace), func._schema.name.split("::")[1])
    overload = getattr(packet, "ScalarList", None)
    if overload is None:
        from ._errors import promotion_error

        raise promotion_error(str(func), "a per-row tensor of scalars has no ScalarList form for DTensor operands")
    return overload

"""In-place ``_foreach_*`` ops that write into ``Partial`` DTensors, on torch releases whose DTensor drops the write.

torch 2.9 to 2.11 run an in-place foreach op (``_foreach_mul_``, ``_foreach_add_``, ...) whose written list holds
a DTensor with a ``Partial`` placement as a no-op: the op runs on a redistributed copy and the DTensor's own
local tensor is left as it was, silently (``repros/torch_foreach_inplace_partial.py``; which releases:
``_torch.versions.drops_inplace_foreach_on_partial``). The same op out of place is right there, and so are the
reads of a ``Partial`` operand in any other position.

A mixed call the package promotes (which torch would have refused) runs such an op here instead, exactly:

1. the op's out-of-place overload (``_foreach_mul.Scalar`` for ``_foreach_mul_.Scalar``) computes every row's
   value, as DTensors;
2. each value is written into its row as the row's own placements hold it: laid out along the row's ``Shard``
   and ``Replicate`` dims by DTensor's redistribution, and along each ``Partial`` dim held whole by the ranks
   at coordinate 0 of that dim and as zeros by the others for a ``sum`` (the others' zeros add nothing, so the
   reduced value is exactly the computed one), whole by every rank for ``max``/``min``/``avg``.

The call's other rows go the same way, so one call is one computation. It needs no autograd (optimizers and
clipping run under ``torch.no_grad()``) and runs eagerly: a written row that requires grad while grad mode is
on, or a call being traced by ``torch.compile``, is refused with what to do. Calls torch accepts unpatched
(every operand a DTensor) never come here: they are torch's, on every release.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial

from .._rules.errors import promotion_error
from .._torch.api import is_traced
from .._torch.versions import drops_inplace_foreach_on_partial, running_torch_version
from .write_back import write_into as _write_into

Call = Callable[..., Any]

_INPLACE_FOREACH = re.compile(r"^aten::(_foreach_\w+)_\.(\w+)$")
_ADVICE = ("Run the step under torch.no_grad() and outside torch.compile (optimizers and clip_grad_norm_ do), or use "
           "torch 2.12 or newer, whose DTensor writes in-place foreach results into Partial DTensors itself.")


def _partial(tensor: Any) -> bool:
    return isinstance(tensor, DTensor) and any(isinstance(p, Partial) for p in tensor._spec.placements)


def _out_of_place(name: str) -> Optional[Any]:
    """The out-of-place overload of the in-place foreach op ``name`` (``aten::_foreach_mul_.Scalar``), or None."""
    match = _INPLACE_FOREACH.match(name)
    if match is None:
        return None
    packet = getattr(torch.ops.aten, match.group(1), None)
    return None if packet is None else getattr(packet, match.group(2), None)


def corrected(name: str, call: Call) -> Optional[Call]:
    """For an in-place foreach op ``name`` on a torch release that drops its writes into ``Partial`` DTensors,
    ``call`` run exactly (see the module docstring); None for any other op or release."""
    if not drops_inplace_foreach_on_partial(running_torch_version()):
        return None
    out_of_place = _out_of_place(name)
    if out_of_place is None:
        return None

    def inplace_foreach(*args: Any, **kwargs: Any) -> Any:
        rows: Sequence[Any] = args[0] if args else ()
        if not any(_partial(row) for row in rows):
            return call(*args, **kwargs)
        if any(is_traced(row._local_tensor if isinstance(row, DTensor) else row) for row in rows):
            why = "torch.compile is tracing it"
        elif torch.is_grad_enabled() and any(row.requires_grad for row in rows):
            why = "a row it writes requires grad while grad mode is on"
        else:
            for row, value in zip(rows, out_of_place(*args, **kwargs)):
                _write_into(row, value)
            return None
        raise promotion_error(
            name, f"on torch {running_torch_version()} DTensor drops in-place foreach writes into Partial DTensors, "
                  f"and the package's exact form of the call runs only eagerly without autograd: {why}",
            peers=[row for row in rows if _partial(row)][:4], advice=_ADVICE, rule_advice=False)

    return inplace_foreach

"""The fast path: the cache hit of the general path (general.py) for its commonest case.

Its case: in eager mode, one DTensor and one plain tensor among the positional arguments (no other
tensors anywhere), the plain one not written by the op, on the DTensor's local device, with more
than one element, the op admitted by ``opstate.admit`` (the ``"replicate"`` rule given as a name and
no option that adds per-operand work). For it, the general path always decides the same thing: the operand is promoted
whole with ``placements.whole_layout``, the op runs, the plain ``.grad`` hook is attached and the
promotion counted. This path does exactly that (same placements, errors, gradient hook and stats),
with its per-call work cached per (op, plain position/shape/stride/dtype, peer spec) in a
``FastEntry``.

With exactly two positional arguments and no kwargs it goes further once the first call of a shape
has shown that DTensor needs no redistribution for it: later calls run the op on the local tensors
and wrap the result as DTensor would (see direct.py), with no re-dispatch.

This is the hot path of every mixed op (its cost: BENCHMARKS.md): what it reads is bound to locals and
module globals, and it calls no more functions than it must.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from . import direct as _direct
from . import grad as _grad
from . import stats as _stats
from .._rules.decisions import REPLICATE, Operand
from .._rules.registry import registry as _registry
from .._torch.api import DTensorSpec
from .caches import remember
from .construct import local_piece, new_dtensor
from .context import options as _current_options
from .direct import IN_PLACE
from .operands import no_tensors
from .opstate import UNDECIDED, OpState
from .opstate import admit as _admit
from .placements import whole_layout
from .run import Described, call_op, wrap_result

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter  # plain too: ``type(p) is Parameter`` for an nn.Parameter that is no DTensor
_record_key = _stats.record_key
_ensure_plain_grad = _grad.ensure_plain_grad

NOT_FAST = object()
"""``promote_fast``'s answer for a call that is not its case: the caller takes the general path."""


class FastEntry:
    """What the fast path decided for one (op, plain position/shape/stride/dtype, peer spec)."""

    __slots__ = ("placements", "local_index", "spec", "direct", "described")

    def __init__(self, placements: Tuple[Placement, ...], local_index: Optional[Tuple[slice, ...]],
                 spec: DTensorSpec, described: Described) -> None:
        self.placements = placements
        self.local_index = local_index  # this rank's slice of the plain operand; None: all of it
        self.spec = spec  # of the promoted operand
        # The direct plan (direct.py): UNDECIDED until the first two-argument call of this shape has
        # been re-dispatched, then a plan or None (re-dispatch every time).
        self.direct: Any = UNDECIDED
        self.described = described  # the operand as error messages describe it


def promote_fast(info: OpState, func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """The result of the mixed call ``func(*args, **kwargs)``, or ``NOT_FAST`` if it is not this path's case."""
    peer: Any = None
    plain: Any = None
    index = -1
    if len(args) == 2:
        # The commonest shape of call, checked without the general scan below.
        first, second = args
        kind0 = type(first)
        kind1 = type(second)
        if kind0 is DTensor and (kind1 is _Tensor or kind1 is _Parameter):
            peer, plain, index = first, second, 1
        elif kind1 is DTensor and (kind0 is _Tensor or kind0 is _Parameter):
            peer, plain, index = second, first, 0
    if index < 0:
        position = 0
        for value in args:
            kind = type(value)
            if kind is DTensor:
                if peer is not None:
                    return NOT_FAST
                peer = value
            elif kind is _Tensor or kind is _Parameter:
                if plain is not None:
                    return NOT_FAST
                plain = value
                index = position
            elif kind is list or kind is tuple:
                if any(isinstance(item, _Tensor) for item in value):
                    return NOT_FAST
            elif isinstance(value, _Tensor):
                return NOT_FAST
            position += 1
        if peer is None or plain is None:
            return NOT_FAST
    traits = info.traits
    if index in traits.written or (kwargs and not no_tensors(kwargs)):
        return NOT_FAST
    # Eager only: while torch.compile traces, the local tensor is fake/functional, and a slice
    # offset of this rank must never be baked into a graph (see construct.whole_dtensor). With the
    # scan's exact types and the written test above: placements.layout_cacheable, unrolled.
    peer_local = peer._local_tensor
    local_type = type(peer_local)
    # On another device than the peer's local piece: the general path moves a CPU scalar or refuses
    # (devices.py); the cached entries below hold no device (specs do not say where pieces sit).
    if (local_type is not _Tensor and local_type is not _Parameter) or plain.numel() == 1 \
            or plain.device != peer_local.device:
        return NOT_FAST
    # The admission (opstate.admit), as remembered for the options and rules in force; the test that it is
    # still current is opstate.admission's, inline (a Python call would be a measurable share of this path).
    admission = info.admission
    if admission.options is not _current_options() or admission.version != _registry.version:
        flags = _admit(info, func)
    else:
        flags = admission.flags
    if flags is None:
        return NOT_FAST
    key = (index, plain.shape, plain.stride(), plain.dtype, peer._spec)
    entry = info.fast.get(key)
    if entry is None:
        layout = whole_layout(Operand((index,), plain, True, False), peer, traits)  # raises the general path's errors
        entry = FastEntry(layout.placements, layout.local_index, layout.spec,
                          [(f"args[{index}]", REPLICATE, layout.placements)])
        remember(info.fast, key, entry)
    # The general path's promotion and run, without its per-call objects.
    local = local_piece(plain, entry.local_index)
    direct = entry.direct
    two = flags.direct and len(args) == 2 and not kwargs
    if two and direct is not None and direct is not UNDECIDED:
        # What DTensor would do with the promoted call, without building it (see direct.py): run
        # the op on the local tensors and wrap the result.
        if index == 1:
            out = call_op(info.call, (peer_local, local), kwargs, traits, entry.described)
        else:
            out = call_op(info.call, (local, peer_local), kwargs, traits, entry.described)
        result = peer if direct is IN_PLACE else wrap_result(out, direct)
    else:
        operand = new_dtensor(local, entry.spec, True)
        if index == 0:
            new_args = (operand,) + args[1:]
        elif index == 1 and len(args) == 2:
            new_args = (args[0], operand)
        else:
            new_args = args[:index] + (operand,) + args[index + 1:]
        if two and direct is UNDECIDED:
            # The first call of each shape: decide (before an in-place op can change anything)
            # whether the next ones may skip the re-dispatch.
            planned = _direct.plan(func, new_args)
            result = call_op(info.call, new_args, kwargs, traits, entry.described)
            entry.direct = _direct.confirmed(planned, new_args, result)
        else:
            result = call_op(info.call, new_args, kwargs, traits, entry.described)
    if plain.requires_grad and flags.plain_grads:
        _ensure_plain_grad(plain, REPLICATE, entry.placements, traits.name)
    _record_key(info.stats_key)
    return result

"""The promotion pipeline's entry point: turn the plain operands of one mixed call into DTensors and run the op.

Called from the dispatch hook (below autograd) only when a call really mixes a DTensor with
a plain tensor that torch would reject. Nothing here communicates: a plain operand is
either sliced locally (it is the whole tensor, identical on every rank) or wrapped as this
rank's piece.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch.distributed.tensor import DTensor

from . import direct as _direct
from . import grad as _grad
from . import stats as _stats
from .._rules.decisions import REPLICATE, Operand
from .construct import SLICE_CACHE, SPEC_CACHE, local_piece, new_dtensor, remember, wrap_result
from .direct import IN_PLACE
from .foreach import foreach_call
from .operands import no_tensors
from .plans import FAST_OPTIONS, OP_STATES, UNDECIDED, fast_path_options, op_state
from .promote import LOCAL_MEMO, WHOLE_CACHE, call_op, promote_operands, run_promoted, whole_entry

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter  # plain too: ``type(p) is Parameter`` for an nn.Parameter that is no DTensor

def clear_caches() -> None:
    """Forget cached slicing decisions, specs and local readings (called by unpatch)."""
    SLICE_CACHE.clear()
    SPEC_CACHE.clear()
    WHOLE_CACHE.clear()
    OP_STATES.clear()
    FAST_OPTIONS[:] = [None, False, False, False]
    LOCAL_MEMO.clear()


def promote_call(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Entry point from the dispatch hook: promote, run, and fix up gradients.

    The common case takes a fast path that does exactly what the general path does (same
    placements, same errors, same gradient hook and stats) without its per-call objects: in
    eager mode, one DTensor and one plain tensor among the positional arguments (no other
    tensors anywhere), the plain one not written by the op, under the ``"replicate"`` rule given
    as a name. Its per-call work is cached per (op, plain position/shape/stride/dtype, peer spec).
    With exactly two positional arguments and no kwargs it goes further once the first call of
    a shape has shown that DTensor needs no redistribution for it: later calls run the op on the
    local tensors and wrap the result as DTensor would (see ``_direct``), with no re-dispatch.
    """
    info = OP_STATES.get(id(func))
    if info is None or info.op is not func:
        info = op_state(func)
    traits = info.traits
    if info.may_fast:
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
                        peer = None
                        break
                    peer = value
                elif kind is _Tensor or kind is _Parameter:
                    if plain is not None:
                        peer = None
                        break
                    plain = value
                    index = position
                elif kind is list or kind is tuple:
                    if any(isinstance(item, _Tensor) for item in value):
                        peer = None
                        break
                elif isinstance(value, _Tensor):
                    peer = None
                    break
                position += 1
        if peer is not None and plain is not None and index not in traits.written \
                and (not kwargs or no_tensors(kwargs)):
            # Eager only: while torch.compile traces, the local tensor is fake/functional, and
            # a slice offset of this rank must never be baked into a graph (see promote_whole).
            peer_local = peer._local_tensor
            local_type = type(peer_local)
            # Another device than the peer's local piece: the general path moves a CPU scalar or refuses
            # (see devices.py); the cached entries below hold no device (specs do not say where pieces sit).
            if (local_type is _Tensor or local_type is _Parameter) and plain.numel() != 1 \
                    and plain.device == peer_local.device:
                options = fast_path_options(info, func)
                if options is not None:
                    key = (index, plain.shape, plain.stride(), plain.dtype, peer._spec)
                    entry = info.fast.get(key)
                    if entry is None:
                        # Raises the general path's errors.
                        placements, local_index, spec = whole_entry(Operand((index,), plain, True, False), peer, traits)
                        described = [(f"args[{index}]", REPLICATE, placements)]
                        entry = [placements, local_index, spec, UNDECIDED, described]
                        remember(info.fast, key, entry)
                    # The general path's promote_whole + run_promoted, without its per-call objects.
                    placements, local_index, spec, direct, described = entry
                    local = local_piece(plain, local_index)
                    two = len(args) == 2 and not kwargs and FAST_OPTIONS[3]
                    if two and direct is not None and direct is not UNDECIDED:
                        # What DTensor would do with the promoted call, without building it
                        # (see direct.py): run the op on the local tensors and wrap the result.
                        if index == 1:
                            out = call_op(info.call, (peer._local_tensor, local), kwargs, traits, described)
                        else:
                            out = call_op(info.call, (local, peer._local_tensor), kwargs, traits, described)
                        result = peer if direct is IN_PLACE else wrap_result(out, direct)
                    else:
                        operand = new_dtensor(local, spec, True)
                        if index == 0:
                            new_args = (operand,) + args[1:]
                        elif index == 1 and len(args) == 2:
                            new_args = (args[0], operand)
                        else:
                            new_args = args[:index] + (operand,) + args[index + 1:]
                        # The first call of each shape: decide (before an in-place op can change
                        # anything) whether the next ones may skip the re-dispatch.
                        planned = _direct.plan(func, new_args) if two and direct is UNDECIDED else None
                        result = call_op(info.call, new_args, kwargs, traits, described)
                        if two and direct is UNDECIDED:
                            entry[3] = _direct.confirmed(planned, new_args, result)
                    if plain.requires_grad and options.plain_grads:
                        _grad.ensure_plain_grad(plain, REPLICATE, placements, traits.name)
                    _stats.record_key(info.stats_key)
                    return result
    elif traits.foreach:
        return foreach_call(func, args, kwargs, traits, info)
    new_args, new_kwargs, promoted = promote_operands(func, args, kwargs, traits)
    return run_promoted(func, traits, new_args, new_kwargs, promoted)

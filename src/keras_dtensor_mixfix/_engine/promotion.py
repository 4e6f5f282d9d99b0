"""Turn the plain operands of one mixed call into DTensors and run the op.

Called from the dispatch hook (below autograd) only when a call really mixes a DTensor with
a plain tensor that torch would reject. Nothing here communicates: a plain operand is
either sliced locally (it is the whole tensor, identical on every rank) or wrapped as this
rank's piece.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard
from torch.utils.weak import WeakIdKeyDictionary

from . import direct as _direct

from . import grad as _grad

from . import stats as _stats
from .direct import IN_PLACE
from .._torch.api import compiled_promotions, is_traced
from .._rules.decisions import ERROR, REPLICATE, Decision, MixedCall, Operand, as_decision
from .._rules.decisions import PeerIndex
from .._rules.errors import MixedOperandError, describe_mesh, promotion_error
from .._rules.ops import OpTraits, op_traits
from .context import options as _current_options
from .._rules.registry import registry

log = logging.getLogger("keras_dtensor_mixfix")

Rebuilt = Tuple[Tuple[Any, ...], Dict[str, Any]]
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter  # plain too: ``type(p) is Parameter`` for an nn.Parameter that is no DTensor


def needs_promotion(value: object) -> bool:
    """A plain tensor torch itself would reject next to a DTensor (one-element ones it accepts)."""
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.numel() != 1


# --------------------------------------------------------------------------- operands


def collect_operands(args: Sequence[Any], kwargs: Dict[str, Any], traits: OpTraits) -> List[Operand]:
    operands: List[Operand] = []
    for index, value in enumerate(args):
        _collect(operands, (index,), value, index in traits.written)
    for name, value in kwargs.items():
        _collect(operands, (name,), value, name in traits.written)
    return operands


def _collect(out: List[Operand], position: Tuple[Any, ...], value: Any, written: bool) -> None:
    if isinstance(value, torch.Tensor):
        out.append(Operand(position, value, not isinstance(value, DTensor), written))
    elif isinstance(value, (list, tuple)):
        for sub, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                out.append(Operand(position + (sub,), item, not isinstance(item, DTensor), written))


# --------------------------------------------------------------------------- placements


def _shard_dim(placement: Placement, ndim: int) -> Optional[int]:
    # Only plain Shard: _StridedShard and other subclasses carry layouts we do not reproduce.
    if type(placement) is Shard:
        dim = placement.dim
        return dim + ndim if dim < 0 else dim
    return None


def aligned_placements(plain: torch.Tensor, peer: DTensor) -> Tuple[Placement, ...]:
    """Placements that make the whole tensor ``plain`` line up with ``peer`` (right-aligned dims).

    A mesh dim that shards a peer dim the plain tensor also has, at the same global size,
    shards the plain tensor there too (a local slice, no communication); anything else is
    Replicate. Any answer is correct: the DTensor still holds all of ``plain``.
    """
    offset = peer.ndim - plain.ndim
    result: List[Placement] = []
    for placement in peer.placements:
        dim = _shard_dim(placement, peer.ndim)
        plain_dim = None if dim is None else dim - offset
        if plain_dim is not None and 0 <= plain_dim < plain.ndim and plain.shape[plain_dim] == peer.shape[dim]:
            result.append(Shard(plain_dim))
        else:
            result.append(Replicate())
    return tuple(result)


def _broadcastable(a: Sequence[int], b: Sequence[int]) -> bool:
    a = tuple(a)
    b = tuple(b)
    if all(type(size) is int for size in a + b):
        # Concrete sizes (eager): the broadcasting rule itself, without torch.broadcast_shapes'
        # overhead (about 2.5 us a call).
        for x, y in zip(reversed(a), reversed(b)):
            if x != y and x != 1 and y != 1:
                return False
        return True
    try:
        torch.broadcast_shapes(a, b)
    except RuntimeError:
        return False
    return True


def _per_operand(value: Any, call: MixedCall, where: str) -> Decision:
    """One operand's answer; None means "what the default rule says"."""
    if value is not None:
        return as_decision(value, where)
    default = _current_options().default
    if callable(default) and not isinstance(default, (str, Decision)):
        default = default(call)
    if default is None or not isinstance(default, (str, Decision)):
        default = REPLICATE
    return as_decision(default, where)


_SLICE_CACHE: Dict[Tuple[Any, ...], Tuple[slice, ...]] = {}
# (mesh, placements, shape, stride, dtype) -> DTensorSpec. Specs are immutable once built
# (torch itself shares one spec between DTensors, e.g. from its sharding-propagation cache), and
# building one costs about 12 us, so promotions in eager mode reuse them. Never used while
# tracing: sizes may be symbolic there.
_SPEC_CACHE: Dict[Tuple[Any, ...], DTensorSpec] = {}
# promote_whole's eager default (foreach rows): (elementwise, plain shape, stride, dtype, peer spec)
# -> (placements, local index or None for the whole tensor, spec of the promoted operand). The
# fast path keeps the same answers per op, with its direct plan (_OpInfo.fast).
_WHOLE_CACHE: Dict[Tuple[Any, ...], Any] = {}
# Every cache is bounded: eager code with ever-changing shapes must not grow them forever.
_CACHE_LIMIT = 4096
# Placement types whose specs may be shared; anything else (_StridedShard, user subclasses) is
# built afresh each time.
_SHAREABLE_PLACEMENTS = (Shard, Replicate, Partial)


def clear_caches() -> None:
    """Forget cached slicing decisions, specs and local readings (called by unpatch)."""
    _SLICE_CACHE.clear()
    _SPEC_CACHE.clear()
    _WHOLE_CACHE.clear()
    _OP_INFO.clear()
    _fast_options[:] = [None, False, False, False]
    _LOCAL_MEMO.clear()


def _remember(cache: Dict[Any, Any], key: Any, value: Any) -> None:
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[key] = value


def _local_slice(shape: Tuple[int, ...], mesh: Any, placements: Tuple[Placement, ...]) -> Tuple[slice, ...]:
    key = (shape, mesh, placements)
    found = _SLICE_CACHE.get(key)
    if found is None:
        local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
        found = tuple(slice(o, o + s) for o, s in zip(offsets, local_shape))
        _remember(_SLICE_CACHE, key, found)
    return found


def _contiguous_stride(shape: Sequence[int]) -> Tuple[int, ...]:
    stride: List[int] = []
    running = 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(int(size), 1)
    return tuple(reversed(stride))


def _spec(mesh: Any, placements: Tuple[Placement, ...], shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype,
          cache: bool = False) -> DTensorSpec:
    """A spec; with ``cache`` (eager only: concrete sizes) an equal spec built before is reused."""
    if not cache or not all(type(p) in _SHAREABLE_PLACEMENTS for p in placements):
        return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype))
    key = (mesh, placements, tuple(shape), tuple(stride), dtype)
    found = _SPEC_CACHE.get(key)
    if found is None:
        found = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype))
        _remember(_SPEC_CACHE, key, found)
    return found


# DTensor's constructor is ``torch.Tensor._dtensor__new__`` (C++) followed by a Python ``__init__``
# that does nothing but is wrapped for dynamo and export (about 1.3 us of the 2 us a construction
# costs). Eager promotions call the C++ constructor alone; traced ones use the full constructor.
_dtensor_new: Optional[Callable[..., DTensor]] = getattr(torch.Tensor, "_dtensor__new__", None)
if _dtensor_new is None or DTensor.__new__ is not _dtensor_new:
    _dtensor_new = None


def _new_dtensor(local: torch.Tensor, spec: DTensorSpec, eager: bool) -> DTensor:
    if eager and _dtensor_new is not None:
        return _dtensor_new(DTensor, local, spec, requires_grad=False)
    return DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]


def _wrap(local: torch.Tensor, mesh: Any, placements: Tuple[Placement, ...], shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> DTensor:
    if local.requires_grad:
        # Below autograd the flag means nothing; detaching keeps DTensor from warning about it.
        local = local.detach()
    eager = not is_traced(local)
    return _new_dtensor(local, _spec(mesh, placements, shape, stride, dtype, cache=eager), eager)


# --------------------------------------------------------------------------- promotion


def promote_whole(operand: Operand, peer: DTensor, mesh: Any, traits: OpTraits, decision: Decision) -> Tuple[DTensor, Tuple[Placement, ...]]:
    """``"replicate"``: ``operand`` is the same whole tensor on every rank."""
    plain = operand.tensor
    if decision.placements is None and not operand.written and peer._spec.mesh is mesh:
        plain_type = type(plain)
        local_type = type(peer._local_tensor)
        if (plain_type is _Tensor or plain_type is _Parameter) and (local_type is _Tensor or local_type is _Parameter):
            # Eager, default decision: the fast path's cached answer (foreach rows come here).
            placements, local_index, spec = cached_whole_entry(plain, peer, traits, operand.position)
            local = plain if local_index is None else plain[local_index]
            if local.requires_grad:
                local = local.detach()
            return _new_dtensor(local, spec, True), placements
    if decision.placements is not None:
        placements = tuple(decision.placements)
        if any(isinstance(p, Partial) for p in placements):
            raise promotion_error(traits.name, "a whole-tensor ('replicate') operand cannot be Partial",
                                  operand_label=operand.label, operand=plain, peers=[peer])
    elif operand.written:
        # The op writes into this operand: its DTensor must own exactly this storage.
        placements = (Replicate(),) * mesh.ndim
    else:
        placements = _choose_whole_placements(operand, peer, mesh, traits)
    if operand.written and any(not p.is_replicate() for p in placements):
        raise promotion_error(traits.name, "an operand the op writes into can only be promoted as Replicate under "
                              "'replicate' (its storage must stay whole)", operand_label=operand.label,
                              operand=plain, peers=[peer])
    shape = tuple(plain.shape)
    if all(p.is_replicate() for p in placements):
        return _wrap(plain, mesh, placements, shape, plain.stride(), plain.dtype), placements
    if is_traced(plain):
        # torch.compile traces rank-agnostically (the mesh coordinate is symbolic): a concrete
        # slice offset baked into the graph would be this rank's and wrong on the others. DTensor's
        # own Replicate -> Shard step is traceable and local (no communication).
        replicated = _spec(mesh, (Replicate(),) * mesh.ndim, shape, plain.stride(), plain.dtype)
        target = _spec(mesh, placements, shape, plain.stride(), plain.dtype)
        local = redistribute_local_tensor(plain, replicated, target)
        return DTensor(local, target, requires_grad=False), placements  # type: ignore[call-arg]
    local = plain[_local_slice(shape, mesh, placements)]
    return _wrap(local, mesh, placements, shape, plain.stride(), plain.dtype), placements


def _choose_whole_placements(operand: Operand, peer: DTensor, mesh: Any, traits: OpTraits) -> Tuple[Placement, ...]:
    plain = operand.tensor
    if peer.device_mesh != mesh:
        return (Replicate(),) * mesh.ndim
    if traits.elementwise:
        if _broadcastable(plain.shape, peer.shape):
            return aligned_placements(plain, peer)
        local_shape = tuple(peer._local_tensor.shape)
        if local_shape != tuple(peer.shape) and _broadcastable(plain.shape, local_shape):
            raise promotion_error(
                traits.name,
                "under the 'replicate' rule a plain operand is the whole tensor, but this one has the shape of the "
                "DTensor's local shard, not of its global shape; it looks like this rank's piece",
                operand_label=operand.label, operand=plain, peers=[peer],
                advice="If it is this rank's piece, use the 'local' rule (patch(default='local') or "
                       f"register_rule({traits.name!r}, 'local')); if it is the whole tensor, its shape is wrong.",
            )
        return (Replicate(),) * mesh.ndim
    # Not elementwise: a matching shape says nothing about which dims line up (a conv weight can
    # have its input's shape), and DTensor strategies may mishandle an unexpectedly sharded
    # operand, so the operand is replicated (still no communication).
    return (Replicate(),) * mesh.ndim


def promote_local(operand: Operand, peer: DTensor, mesh: Any, traits: OpTraits, decision: Decision) -> Tuple[DTensor, Tuple[Placement, ...]]:
    """``"local"``: ``operand`` is this rank's piece; placements follow the peer's."""
    plain = operand.tensor
    memo = _LOCAL_MEMO.get(plain)
    if memo is not None and memo[0] == mesh and decision.placements is None and decision.shape is None:
        # Already read as this rank's piece (e.g. in forward, now in backward against a gradient
        # with other placements): a tensor is one piece of one global tensor, so reuse that reading.
        _, placements, shape = memo
        return _wrap(plain, mesh, placements, shape, _contiguous_stride(shape), plain.dtype), placements
    if decision.placements is not None:
        placements = tuple(decision.placements)
    else:
        if peer.device_mesh != mesh:
            raise promotion_error(traits.name, "the 'local' rule needs a DTensor peer on the op's mesh",
                                  operand_label=operand.label, operand=plain, peers=[peer])
        placements = _mapped_local_placements(plain, peer)
    if len(placements) != mesh.ndim:
        raise promotion_error(traits.name, f"{len(placements)} placements given for a {mesh.ndim}-D mesh "
                              f"{describe_mesh(mesh)}", operand_label=operand.label, operand=plain, peers=[peer])
    if decision.shape is not None:
        shape = tuple(int(s) for s in decision.shape)
    else:
        shape = _infer_global_shape(operand, peer, placements, traits, explicit=decision.placements is not None, mesh=mesh)
    if shape != tuple(plain.shape) and plain.requires_grad and torch.is_grad_enabled() and not is_traced(plain):
        # Autograd recorded this operand with its local shape and checks the gradient against it
        # before any hook can run, so a gradient for a local piece cannot be delivered from here.
        raise promotion_error(
            traits.name,
            "a 'local' operand that requires grad cannot be promoted below autograd: autograd recorded its local "
            f"shape {tuple(plain.shape)} and would reject the gradient of global shape {shape}",
            operand_label=operand.label, operand=plain, peers=[peer],
            advice=f"Wrap it yourself, differentiably: DTensor.from_local(x, mesh, {list(placements)}) (its .grad is "
                   "then this rank's piece), or detach it if it needs no gradient.",
        )
    _LOCAL_MEMO[plain] = (mesh, placements, shape)
    return _wrap(plain, mesh, placements, shape, _contiguous_stride(shape), plain.dtype), placements


# tensor -> (mesh, placements, global shape) of its "local" reading; weak, cleared by unpatch().
_LOCAL_MEMO: Any = WeakIdKeyDictionary()


def _mapped_local_placements(plain: torch.Tensor, peer: DTensor) -> Tuple[Placement, ...]:
    offset = peer.ndim - plain.ndim
    local_peer_shape = peer._local_tensor.shape
    result: List[Placement] = []
    for placement in peer.placements:
        dim = _shard_dim(placement, peer.ndim)
        if dim is not None:
            plain_dim = dim - offset
            broadcast = 0 <= plain_dim < plain.ndim and plain.shape[plain_dim] == 1 and local_peer_shape[dim] != 1
            if 0 <= plain_dim < plain.ndim and not broadcast:
                result.append(Shard(plain_dim))
            else:
                result.append(Replicate())
        elif isinstance(placement, Partial):
            result.append(placement)
        else:
            result.append(Replicate())
    return tuple(result)


def _infer_global_shape(operand: Operand, peer: DTensor, placements: Tuple[Placement, ...], traits: OpTraits, explicit: bool, mesh: Any) -> Tuple[int, ...]:
    plain = operand.tensor
    shape = list(plain.shape)
    offset = peer.ndim - plain.ndim
    sharded: Dict[int, int] = {}
    for mesh_dim, placement in enumerate(placements):
        dim = _shard_dim(placement, plain.ndim)
        if dim is not None:
            sharded[dim] = sharded.get(dim, 1) * mesh.size(mesh_dim)
    for dim, shards in sharded.items():
        peer_dim = dim + offset
        peer_sharded_same = (
            not explicit
            and 0 <= peer_dim < peer.ndim
            and plain.shape[dim] == peer._local_tensor.shape[peer_dim]
        )
        if peer_sharded_same:
            # The peer's global size also covers uneven shards, which local * shards would not.
            shape[dim] = peer.shape[peer_dim]
        elif explicit:
            shape[dim] = plain.shape[dim] * shards
        else:
            raise promotion_error(
                traits.name,
                f"under the 'local' rule dim {dim} of this operand is sharded like the DTensor's dim {peer_dim}, but "
                f"its local size {plain.shape[dim]} differs from the DTensor's local size "
                f"{tuple(peer._local_tensor.shape)[peer_dim] if 0 <= peer_dim < peer.ndim else '?'}, so the global "
                "shape cannot be inferred",
                operand_label=operand.label, operand=plain, peers=[peer],
                advice="Give the global shape with a callable rule returning Decision('local', placements=..., shape=...).",
            )
    return tuple(shape)


# --------------------------------------------------------------------------- rules


def _decide(call: MixedCall, rule: Any, traits: OpTraits) -> Dict[Tuple[Any, ...], Decision]:
    where = f"rule for {traits.name}"
    if callable(rule) and not isinstance(rule, (str, Decision)):
        answer = rule(call)
        if answer is None:
            answer = _current_options().default
            if callable(answer) and not isinstance(answer, (str, Decision)):
                answer = answer(call)
                if answer is None:
                    answer = REPLICATE
    else:
        answer = rule
    if isinstance(answer, (str, Decision)):
        decision = as_decision(answer, where)
        return {operand.position: decision for operand in call.plain}
    if isinstance(answer, dict) or hasattr(answer, "keys"):
        decisions = {}
        for operand in call.plain:
            if operand.position not in answer:  # type: ignore[operator]
                raise promotion_error(traits.name, f"the callable rule's answer has no entry for {operand.label} "
                                      f"(position {operand.position})", operand_label=operand.label, operand=operand.tensor)
            decisions[operand.position] = _per_operand(answer[operand.position], call, where)  # type: ignore[index]
        return decisions
    if isinstance(answer, (list, tuple)):
        if len(answer) != len(call.plain):
            raise MixedOperandError(f"{where}: the callable rule answered {len(answer)} decisions for "
                                    f"{len(call.plain)} plain operands ({[o.label for o in call.plain]})")
        return {operand.position: _per_operand(value, call, where) for operand, value in zip(call.plain, answer)}
    as_decision(answer, where)  # raises a TypeError naming the bad answer
    raise AssertionError("unreachable")


def build_call(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], operands: List[Operand]) -> MixedCall:
    peers = tuple(o.tensor for o in operands if not o.is_plain)
    meshes: List[Any] = []
    for peer in peers:
        mesh = peer.device_mesh  # type: ignore[attr-defined]
        if not any(mesh == known for known in meshes):
            meshes.append(mesh)
    # torch accepts one-element plain operands itself, except as the tensor an op writes into
    plain = tuple(o for o in operands if o.is_plain and (o.written or o.tensor.numel() != 1))
    return MixedCall(func, args, kwargs, tuple(operands), plain, peers, meshes[0] if len(meshes) == 1 else None, tuple(meshes))  # type: ignore[arg-type]


class _OpInfo:
    """What promotion needs per op overload, looked up once per call (keyed by ``id(op)``: the
    entry holds the op, so the id cannot be reused while the entry exists)."""

    __slots__ = ("op", "traits", "call", "may_fast", "rule", "version", "stats_key", "fast")

    def __init__(self, op: Any) -> None:
        self.op = op
        self.traits = op_traits(op)
        # OpOverload.__call__ only forwards to ``_op``; calling that directly saves a Python frame.
        self.call = op._op if type(op) is torch._ops.OpOverload else op
        self.may_fast = not self.traits.foreach
        self.rule: Any = None
        self.version = -1  # the registry's version ``rule`` was looked up at
        self.stats_key = (self.traits.name, REPLICATE)
        # The fast path's decisions for this op: (plain's position, shape, stride, dtype, the
        # DTensor's spec) -> [placements, local index, promoted spec, direct plan]; the plan is
        # _UNDECIDED until the first 2-argument call of that shape has been re-dispatched.
        self.fast: Dict[Tuple[Any, ...], List[Any]] = {}


_OP_INFO: Dict[int, _OpInfo] = {}


def _op_info(func: Any) -> _OpInfo:
    info = _OP_INFO.get(id(func))
    if info is None or info.op is not func:
        info = _OpInfo(func)
        _remember(_OP_INFO, id(func), info)
    return info


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
    info = _OP_INFO.get(id(func))
    if info is None or info.op is not func:
        info = _op_info(func)
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
                and (not kwargs or _no_tensors(kwargs)):
            # Eager only: while torch.compile traces, the local tensor is fake/functional, and
            # a slice offset of this rank must never be baked into a graph (see promote_whole).
            local_type = type(peer._local_tensor)
            if (local_type is _Tensor or local_type is _Parameter) and plain.numel() != 1:
                options = fast_path_options(info, func)
                if options is not None:
                    key = (index, plain.shape, plain.stride(), plain.dtype, peer._spec)
                    entry = info.fast.get(key)
                    if entry is None:
                        # Raises the general path's errors.
                        entry = [*_whole_entry(Operand((index,), plain, True, False), peer, traits), _UNDECIDED]
                        _remember(info.fast, key, entry)
                    # The general path's promote_whole + run_promoted, inlined (a call costs).
                    placements, local_index, spec, direct = entry
                    if local_index is not None:
                        local = plain[local_index]
                        if local.requires_grad:
                            local = local.detach()
                    elif plain.requires_grad:
                        local = plain.detach()
                    else:
                        local = plain
                    two = len(args) == 2 and not kwargs and _fast_options[3]
                    if two and direct is not None and direct is not _UNDECIDED:
                        # What DTensor would do with the promoted call, without building it
                        # (see _direct): run the op on the local tensors and wrap the result.
                        try:
                            if index == 1:
                                out = info.call(peer._local_tensor, local)
                            else:
                                out = info.call(local, peer._local_tensor)
                        except Exception as exc:
                            raise _op_failed(traits, [(f"args[{index}]", REPLICATE, placements)], args, kwargs,
                                             exc) from exc
                        if direct is IN_PLACE:
                            result = peer
                        elif _dtensor_new is not None:
                            result = _dtensor_new(DTensor, out, direct, requires_grad=out.requires_grad)
                        else:
                            result = DTensor(out, direct, requires_grad=out.requires_grad)  # type: ignore[call-arg]
                    else:
                        if _dtensor_new is not None:
                            operand = _dtensor_new(DTensor, local, spec, requires_grad=False)
                        else:
                            operand = DTensor(local, spec, requires_grad=False)  # type: ignore[call-arg]
                        if index == 0:
                            new_args = (operand,) + args[1:]
                        elif index == 1 and len(args) == 2:
                            new_args = (args[0], operand)
                        else:
                            new_args = args[:index] + (operand,) + args[index + 1:]
                        # The first call of each shape: decide (before an in-place op can change
                        # anything) whether the next ones may skip the re-dispatch.
                        planned = _direct.plan(func, new_args) if two and direct is _UNDECIDED else None
                        try:
                            result = info.call(*new_args, **kwargs)
                        except MixedOperandError:
                            raise
                        except Exception as exc:
                            raise _op_failed(traits, [(f"args[{index}]", REPLICATE, placements)], new_args, kwargs,
                                             exc) from exc
                        if two and direct is _UNDECIDED:
                            entry[3] = _direct.confirmed(planned, new_args, result)
                    if plain.requires_grad and options.plain_grads:
                        _grad.ensure_plain_grad(plain, REPLICATE, placements, traits.name)
                    _stats.record_key(info.stats_key)
                    return result
    elif traits.foreach:
        from .foreach import foreach_call

        return foreach_call(func, args, kwargs, traits, info)
    new_args, new_kwargs, promoted = promote_operands(func, args, kwargs, traits)
    return run_promoted(func, traits, new_args, new_kwargs, promoted)


# [options, default rule is "replicate" by name, fast path allowed by the options, direct plans
# allowed]. Options objects are immutable (``Options.updated`` makes a new one), so identity says
# when to recompute.
_fast_options: List[Any] = [None, False, False, False]
_UNDECIDED = object()


def fast_path_options(info: _OpInfo, func: Any) -> Any:
    """The options in force if they let ``func`` take a fast path, else None: its rule is
    ``"replicate"`` by name (registered for it, or the default) and no option adds per-operand
    work. ``direct_allowed()`` then says whether direct plans may be used."""
    version = registry.version
    if info.version != version:
        info.rule = registry.lookup(func)
        info.version = version
    rule = info.rule
    options = _current_options()
    if options is not _fast_options[0]:
        _fast_options[:] = [options, *_fast_option_flags(options)]
    if _fast_options[2] and (_fast_options[1] if rule is None else type(rule) is str and rule == REPLICATE):
        return options
    return None


def direct_allowed() -> bool:
    """Whether the options last seen by ``fast_path_options`` allow direct plans."""
    return _fast_options[3]


def _fast_option_flags(options: Any) -> Tuple[bool, bool, bool]:
    default = options.default
    # Any option that adds per-operand work (e.g. a check mode) sends every call down the general path.
    allowed = getattr(options, "check", "off") == "off"
    return type(default) is str and default == REPLICATE, allowed, bool(getattr(options, "direct", True))


def _no_tensors(kwargs: Dict[str, Any]) -> bool:
    for value in kwargs.values():
        if isinstance(value, _Tensor):
            return False
        if (type(value) is list or type(value) is tuple) and any(isinstance(item, _Tensor) for item in value):
            return False
    return True


WholeEntry = Tuple[Tuple[Placement, ...], Optional[Tuple[slice, ...]], DTensorSpec]


def cached_whole_entry(plain: torch.Tensor, peer: DTensor, traits: OpTraits, position: Tuple[Any, ...]) -> WholeEntry:
    """``_whole_entry`` for an eager plain operand (not written) at ``position``, cached."""
    key = (traits.elementwise, plain.shape, plain.stride(), plain.dtype, peer._spec)
    entry = _WHOLE_CACHE.get(key)
    if entry is None:
        entry = _whole_entry(Operand(position, plain, True, False), peer, traits)
        _remember(_WHOLE_CACHE, key, entry)
    return entry


def _whole_entry(operand: Operand, peer: DTensor, traits: OpTraits) -> WholeEntry:
    """What promote_whole decides for an eager plain operand under the default decision, for the
    cache: placements, the index of this rank's piece (None: all of it) and the spec."""
    plain = operand.tensor
    mesh = peer.device_mesh
    placements = _choose_whole_placements(operand, peer, mesh, traits)
    shape = tuple(plain.shape)
    local_index: Optional[Tuple[slice, ...]] = None
    if not all(p.is_replicate() for p in placements):
        local_index = _local_slice(shape, mesh, placements)
        if all(piece.start == 0 and piece.stop == size for piece, size in zip(local_index, shape)):
            local_index = None  # this rank's piece is all of it (e.g. a mesh dim of size 1)
    return placements, local_index, _spec(mesh, placements, shape, plain.stride(), plain.dtype, cache=True)


Promoted = List[Tuple[Operand, DTensor, Decision, Tuple[Placement, ...]]]


def promote_operands(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], traits: OpTraits) -> Tuple[Tuple[Any, ...], Dict[str, Any], Promoted]:
    operands = collect_operands(args, kwargs, traits)
    call = build_call(func, args, kwargs, operands)
    options = _current_options()
    rule = registry.lookup(func)
    if rule is None:
        rule = options.default
    try:
        decisions = _decide(call, rule, traits)
    except (TypeError, ValueError) as exc:
        # Raised inside an operator: Python would turn a TypeError from Tensor.__mul__ into
        # "unsupported operand type(s)" and lose this message.
        raise MixedOperandError(f"keras_dtensor_mixfix: {exc}") from exc
    promoted: Promoted = []
    replacements: Dict[Tuple[Any, ...], DTensor] = {}
    peers = PeerIndex(call.operands)
    for operand in call.plain:
        decision = decisions[operand.position]
        mesh = decision.mesh if decision.mesh is not None else call.mesh
        peer = peers.choose(operand)
        if decision.kind == ERROR:
            raise promotion_error(traits.name, f"the rule for this op is 'error' (operand {operand.label})",
                                  operand_label=operand.label, operand=operand.tensor, peers=call.peers)
        if mesh is None:
            raise promotion_error(
                traits.name,
                "its DTensor operands sit on different meshes ("
                + "; ".join(describe_mesh(m) for m in call.meshes) + "), so there is no single mesh to promote to",
                operand_label=operand.label, operand=operand.tensor, peers=call.peers,
                advice="Put the DTensors on one mesh, or register a callable rule that returns Decision(..., mesh=...).",
            )
        if decision.kind == REPLICATE:
            dtensor, placements = promote_whole(operand, peer, mesh, traits, decision)
        else:
            dtensor, placements = promote_local(operand, peer, mesh, traits, decision)
        replacements[operand.position] = dtensor
        promoted.append((operand, dtensor, decision, placements))
    if promoted and is_traced(promoted[0][0].tensor):
        compiled_promotions.note()  # this graph holds a promotion: keep it out of torch.compile's caches
    new_args, new_kwargs = _rebuild(args, kwargs, replacements)
    return new_args, new_kwargs, promoted


def run_promoted(func: Any, traits: OpTraits, args: Tuple[Any, ...], kwargs: Dict[str, Any], promoted: Promoted) -> Any:
    options = _current_options()
    if options.check != "off":
        # Before the op: a rank whose operand breaks the assumption may fail inside the op, and
        # every rank must reach the check's collective.
        _check_promoted(options.check, traits, promoted)
    try:
        result = _op_info(func).call(*args, **kwargs)
    except MixedOperandError:
        raise
    except Exception as exc:
        raise _op_failed(traits, [(o.label, d.kind, p) for o, _, d, p in promoted], args, kwargs, exc) from exc
    if options.plain_grads:
        for operand, _, decision, placements in promoted:
            if operand.tensor.requires_grad:
                _grad.ensure_plain_grad(operand.tensor, decision.kind, placements, traits.name)
    _stats.record(traits.name, [d.kind for _, _, d, _ in promoted])
    for operand, dtensor, _, _ in promoted:
        if operand.written and result is dtensor:
            return operand.tensor  # an in-place op on a plain tensor returns that tensor, as in torch
    return result


def _check_promoted(mode: str, traits: OpTraits, promoted: Promoted) -> None:
    from . import check as _check
    for operand, dtensor, decision, placements in promoted:
        if is_traced(operand.tensor):
            continue  # no collectives while torch.compile traces
        if decision.kind == REPLICATE:
            _check.check_replicated(mode, traits.name, operand.label, operand.tensor, dtensor.device_mesh)
        else:
            _check.check_local(mode, traits.name, operand.label, operand.tensor, dtensor.device_mesh, placements,
                               tuple(dtensor.shape))


def _op_failed(traits: OpTraits, described: List[Tuple[str, str, Tuple[Placement, ...]]], args: Tuple[Any, ...],
               kwargs: Dict[str, Any], exc: Exception) -> MixedOperandError:
    text = "; ".join(f"{label} as {kind} {tuple(placements)}" for label, kind, placements in described)
    return promotion_error(
        traits.name,
        f"after promoting the plain operand(s) ({text}) the op itself failed: {type(exc).__name__}: {exc}",
        peers=[a for a in _dtensors(args, kwargs)][:4],
        advice="If the op has no DTensor sharding strategy, register one with torch or convert the operands yourself.",
    )


def _dtensors(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[DTensor]:
    found: List[DTensor] = []
    for value in list(args) + list(kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else [value]
        found.extend(item for item in items if isinstance(item, DTensor))
    return found


def _rebuild(args: Tuple[Any, ...], kwargs: Dict[str, Any], replacements: Dict[Tuple[Any, ...], DTensor]) -> Rebuilt:
    new_args = list(args)
    new_kwargs = dict(kwargs)
    lists: Dict[Any, List[Any]] = {}
    for position, value in replacements.items():
        head = position[0]
        container: Any = new_args if isinstance(head, int) else new_kwargs
        if len(position) == 1:
            container[head] = value
        else:
            if head not in lists:
                original = container[head]
                lists[head] = list(original)
            lists[head][position[1]] = value
    for head, items in lists.items():
        container = new_args if isinstance(head, int) else new_kwargs
        original = container[head]
        container[head] = tuple(items) if isinstance(original, tuple) else items
    return tuple(new_args), new_kwargs

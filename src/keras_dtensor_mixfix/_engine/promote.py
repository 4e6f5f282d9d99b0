"""Promote the plain operands of one call (the general path) and run the op on the result."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate
from torch.utils.weak import WeakIdKeyDictionary

from . import grad as _grad
from . import stats as _stats
from .._rules.decisions import ERROR, REPLICATE, Decision, Operand, PeerIndex, check_decision
from .._rules.errors import MixedOperandError, describe_mesh, promotion_error
from .._rules.ops import OpTraits
from .._rules.registry import registry
from .._torch.api import DTensorSpec, is_traced, redistribute_local_tensor
from .construct import contiguous_stride, local_piece, local_slice, make_spec, new_dtensor, remember, wrap
from .context import options as _current_options, traced_promotions
from .decide import decide
from .devices import on_mesh_device
from .operands import build_call, collect_operands, dtensors_in, rebuild
from .placements import choose_whole_placements, infer_global_shape, mapped_local_placements
from .plans import op_state

_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter

# promote_whole's eager default (foreach rows): (elementwise, plain shape, stride, dtype, peer spec)
# -> (placements, local index or None for the whole tensor, spec of the promoted operand). The
# fast path keeps the same answers per op, with its direct plan (OpState.fast).
WHOLE_CACHE: Dict[Tuple[Any, ...], Any] = {}


def promote_whole(operand: Operand, peer: DTensor, mesh: Any, traits: OpTraits, decision: Decision) -> Tuple[DTensor, Tuple[Placement, ...]]:
    """``"replicate"``: ``operand`` is the same whole tensor on every rank."""
    plain = on_mesh_device(operand, peer, mesh, traits)
    if plain is not operand.tensor:
        operand = Operand(operand.position, plain, True, operand.written)  # a CPU scalar moved to the mesh's device
    if decision.placements is None and not operand.written and peer._spec.mesh is mesh:
        plain_type = type(plain)
        local_type = type(peer._local_tensor)
        if (plain_type is _Tensor or plain_type is _Parameter) and (local_type is _Tensor or local_type is _Parameter):
            # Eager, default decision: the fast path's cached answer (foreach rows come here).
            placements, local_index, spec = cached_whole_entry(plain, peer, traits, operand.position)
            return new_dtensor(local_piece(plain, local_index), spec, True), placements
    if decision.placements is not None:
        placements = tuple(decision.placements)
        if any(isinstance(p, Partial) for p in placements):
            raise promotion_error(traits.name, "a whole-tensor ('replicate') operand cannot be Partial",
                                  operand_label=operand.label, operand=plain, peers=[peer])
    elif operand.written:
        # The op writes into this operand: its DTensor must own exactly this storage.
        placements = (Replicate(),) * mesh.ndim
    else:
        placements = choose_whole_placements(operand, peer, mesh, traits)
    if operand.written and any(not p.is_replicate() for p in placements):
        raise promotion_error(traits.name, "an operand the op writes into can only be promoted as Replicate under "
                              "'replicate' (its storage must stay whole)", operand_label=operand.label,
                              operand=plain, peers=[peer])
    shape = tuple(plain.shape)
    if all(p.is_replicate() for p in placements):
        return wrap(plain, mesh, placements, shape, plain.stride(), plain.dtype), placements
    if is_traced(plain):
        # torch.compile traces rank-agnostically (the mesh coordinate is symbolic): a concrete
        # slice offset baked into the graph would be this rank's and wrong on the others. DTensor's
        # own Replicate -> Shard step is traceable and local (no communication).
        replicated = make_spec(mesh, (Replicate(),) * mesh.ndim, shape, plain.stride(), plain.dtype)
        target = make_spec(mesh, placements, shape, plain.stride(), plain.dtype)
        local = redistribute_local_tensor(plain, replicated, target)
        return new_dtensor(local, target, eager=False), placements
    local = plain[local_slice(shape, mesh, placements)]
    return wrap(local, mesh, placements, shape, plain.stride(), plain.dtype), placements


def promote_local(operand: Operand, peer: DTensor, mesh: Any, traits: OpTraits, decision: Decision) -> Tuple[DTensor, Tuple[Placement, ...]]:
    """``"local"``: ``operand`` is this rank's piece; placements follow the peer's."""
    plain = on_mesh_device(operand, peer, mesh, traits)
    if plain is not operand.tensor:
        operand = Operand(operand.position, plain, True, operand.written)  # a CPU scalar moved to the mesh's device
    memo = LOCAL_MEMO.get(plain)
    if memo is not None and memo[0] == mesh and decision.placements is None and decision.shape is None:
        # Already read as this rank's piece (e.g. in forward, now in backward against a gradient
        # with other placements): a tensor is one piece of one global tensor, so reuse that reading.
        _, placements, shape = memo
        return wrap(plain, mesh, placements, shape, contiguous_stride(shape), plain.dtype), placements
    if decision.placements is not None:
        placements = tuple(decision.placements)
    else:
        if peer.device_mesh != mesh:
            raise promotion_error(traits.name, "the 'local' rule needs a DTensor peer on the op's mesh",
                                  operand_label=operand.label, operand=plain, peers=[peer])
        placements = mapped_local_placements(plain, peer)
    if len(placements) != mesh.ndim:
        raise promotion_error(traits.name, f"{len(placements)} placements given for a {mesh.ndim}-D mesh "
                              f"{describe_mesh(mesh)}", operand_label=operand.label, operand=plain, peers=[peer])
    if decision.shape is not None:
        shape = tuple(int(s) for s in decision.shape)
    else:
        shape = infer_global_shape(operand, peer, placements, traits, explicit=decision.placements is not None, mesh=mesh)
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
    LOCAL_MEMO[plain] = (mesh, placements, shape)
    return wrap(plain, mesh, placements, shape, contiguous_stride(shape), plain.dtype), placements


# tensor -> (mesh, placements, global shape) of its "local" reading; weak, cleared by unpatch().
LOCAL_MEMO: Any = WeakIdKeyDictionary()


WholeEntry = Tuple[Tuple[Placement, ...], Optional[Tuple[slice, ...]], DTensorSpec]


def cached_whole_entry(plain: torch.Tensor, peer: DTensor, traits: OpTraits, position: Tuple[Any, ...]) -> WholeEntry:
    """``whole_entry`` for an eager plain operand (not written) at ``position``, cached."""
    key = (traits.elementwise, plain.shape, plain.stride(), plain.dtype, peer._spec)
    entry = WHOLE_CACHE.get(key)
    if entry is None:
        entry = whole_entry(Operand(position, plain, True, False), peer, traits)
        remember(WHOLE_CACHE, key, entry)
    return entry


def whole_entry(operand: Operand, peer: DTensor, traits: OpTraits) -> WholeEntry:
    """What promote_whole decides for an eager plain operand under the default decision, for the
    cache: placements, the index of this rank's piece (None: all of it) and the spec.

    Raises for a plain operand on another device than the peer's local piece. The entry holds no
    device (a spec does not say where local pieces sit: a meta-initialized DTensor has a CPU one's), so
    every caller compares the two devices on each call before using a cached entry; their operands are
    never 0-dim, so nothing is ever moved here."""
    plain = operand.tensor
    mesh = peer.device_mesh
    on_mesh_device(operand, peer, mesh, traits)
    placements = choose_whole_placements(operand, peer, mesh, traits)
    shape = tuple(plain.shape)
    local_index: Optional[Tuple[slice, ...]] = None
    if not all(p.is_replicate() for p in placements):
        local_index = local_slice(shape, mesh, placements)
        if all(piece.start == 0 and piece.stop == size for piece, size in zip(local_index, shape)):
            local_index = None  # this rank's piece is all of it (e.g. a mesh dim of size 1)
    return placements, local_index, make_spec(mesh, placements, shape, plain.stride(), plain.dtype, cache=True)


Promoted = List[Tuple[Operand, DTensor, Decision, Tuple[Placement, ...]]]


def promote_operands(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], traits: OpTraits) -> Tuple[Tuple[Any, ...], Dict[str, Any], Promoted]:
    operands = collect_operands(args, kwargs, traits)
    call = build_call(func, args, kwargs, operands)
    try:
        # No registration: None, which decide() resolves as the default rule.
        decisions = decide(call, registry.lookup(func), traits)
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
        decision = check_decision(decision, traits.name, operand, mesh, call.peers)
        if decision.kind == REPLICATE:
            dtensor, placements = promote_whole(operand, peer, mesh, traits, decision)
        else:
            dtensor, placements = promote_local(operand, peer, mesh, traits, decision)
        replacements[operand.position] = dtensor
        promoted.append((operand, dtensor, decision, placements))
    if promoted and is_traced(promoted[0][0].tensor):
        traced_promotions.note()  # this graph holds a promotion: keep it out of torch.compile's caches
    new_args, new_kwargs = rebuild(args, kwargs, replacements)
    return new_args, new_kwargs, promoted


def run_promoted(func: Any, traits: OpTraits, args: Tuple[Any, ...], kwargs: Dict[str, Any], promoted: Promoted) -> Any:
    options = _current_options()
    if options.check != "off":
        # Before the op: a rank whose operand breaks the assumption may fail inside the op, and
        # every rank must reach the check's collective.
        _check_promoted(options.check, traits, promoted)
    result = call_op(op_state(func).call, args, kwargs, traits, [(o.label, d.kind, p) for o, _, d, p in promoted])
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


Described = List[Tuple[str, str, Tuple[Placement, ...]]]
"""Each promoted operand as (label, rule kind, placements), for error messages."""


def call_op(call: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], traits: OpTraits, described: Described) -> Any:
    """Run the op on promoted (or local) operands; its failure names what was promoted and how."""
    try:
        return call(*args, **kwargs)
    except MixedOperandError:
        raise
    except Exception as exc:
        raise op_failed(traits, described, args, kwargs, exc) from exc


def op_failed(traits: OpTraits, described: List[Tuple[str, str, Tuple[Placement, ...]]], args: Tuple[Any, ...],
               kwargs: Dict[str, Any], exc: Exception) -> MixedOperandError:
    text = "; ".join(f"{label} as {kind} {tuple(placements)}" for label, kind, placements in described)
    return promotion_error(
        traits.name,
        f"after promoting the plain operand(s) ({text}) the op itself failed: {type(exc).__name__}: {exc}",
        peers=[a for a in dtensors_in(args, kwargs)][:4],
        advice="If the op has no DTensor sharding strategy, register one with torch or convert the operands yourself.",
    )

"""The general path: every mixed call the fast path (fast.py) does not take, one stage after another.

operands (find them) -> decide (ask the rule, check its answer) -> for each plain operand: devices
(where its piece must sit), placements (how it is laid out), construct (its DTensor) -> construct
(put the DTensors into the call) -> run (the op, then gradients and stats).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from torch.distributed.tensor import DTensor

from .._rules.decisions import REPLICATE, Operand
from .._rules.ops import OpTraits
from .._torch.api import is_traced
from .construct import local_dtensor, local_piece, new_dtensor, rebuild, whole_dtensor
from .context import traced_promotions
from .decide import decide_operands
from .devices import on_mesh_device
from .meshes import as_plain_on_one_mesh
from .operands import build_call, collect_operands
from .opstate import op_state
from .placements import cached_whole_layout, layout_cacheable, local_layout, whole_placements
from .run import Promoted, run_promoted
from .whole import replicated


def promote_general(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], traits: OpTraits) -> Any:
    """Promote the plain operands of ``func(*args, **kwargs)`` as their rule decides, and run it."""
    call = build_call(func, args, kwargs, collect_operands(args, kwargs, traits))
    if call.mesh is None and len(call.meshes) > 1:
        # DTensors on several meshes: those whose whole value each rank holds become plain (meshes.py),
        # and the call goes round again; otherwise decide.py names the meshes.
        converted = as_plain_on_one_mesh(args, kwargs)
        if converted is not None:
            return func(*converted[0], **converted[1])
    promoted: Promoted = []
    replacements: Dict[Tuple[Any, ...], DTensor] = {}
    first_plain = None
    for operand, decision, mesh, peer in decide_operands(call, traits):
        plain = on_mesh_device(operand, peer, mesh, traits)
        if plain is not operand.tensor:
            operand = Operand(operand.position, plain, True, operand.written)  # a CPU scalar moved to the mesh's device
        if decision.kind != REPLICATE:
            # "local": the operand is this rank's piece.
            placements, shape = local_layout(operand, peer, mesh, traits, decision)
            dtensor = local_dtensor(plain, mesh, placements, shape)
        elif decision.placements is None and peer._spec.mesh is mesh and layout_cacheable(plain, peer, operand.written):
            # "replicate", the default decision, on the peer's mesh: the fast path's layout, cached (foreach rows
            # come here).
            layout = cached_whole_layout(plain, peer, traits, operand.position)
            placements = layout.placements
            dtensor = new_dtensor(local_piece(plain, layout.local_index), layout.spec, True)
        else:
            # "replicate": the operand is the same whole tensor on every rank.
            placements = whole_placements(operand, peer, mesh, traits, decision)
            dtensor = whole_dtensor(plain, mesh, placements)
        replacements[operand.position] = dtensor
        promoted.append((operand, dtensor, decision, placements))
        if first_plain is None:
            first_plain = plain
    written_into = [operand for operand, _, _, _ in promoted if operand.written]
    if written_into:
        # The op writes into a plain tensor, which holds the whole value: it runs on whole values, every DTensor
        # operand Replicate, as one process runs it (DTensor's in-place strategies mishandle a Replicate output
        # beside sharded inputs for some ops: scatter_add_, index_add_, index_copy_, masked_fill_). A row-wise op
        # (foreach, fused optimizers) computes each row apart: only the rows holding such a tensor are made whole.
        rows = _rows_of(written_into, traits)
        for operand in call.operands:
            # (a DTensor the op writes into too, a foreach row, stays itself: the write must reach it)
            if not operand.is_plain and not operand.written and operand.position not in replacements \
                    and (rows is None or _row_of(operand, traits) in rows):
                whole = replicated(operand.tensor)  # type: ignore[arg-type]
                if whole is not operand.tensor:
                    replacements[operand.position] = whole
    new_args, new_kwargs = rebuild(args, kwargs, replacements)
    if first_plain is not None and is_traced(first_plain):
        traced_promotions.note()  # this graph holds a promotion: keep it out of torch.compile's caches
    return run_promoted(op_state(func).call, traits, new_args, new_kwargs, promoted)


def _row_of(operand: Operand, traits: OpTraits) -> Any:
    """The row of a row-wise op's list item (its index in the list); None for an operand outside the lists, which
    every row reads."""
    position = operand.position
    return position[1] if len(position) == 2 and position[0] in traits.lists else None


def _rows_of(written: Any, traits: OpTraits) -> Any:
    """The rows the plain tensors ``written`` sit in, for a row-wise op; None (every operand) otherwise."""
    if not traits.row_wise:
        return None
    rows = {_row_of(operand, traits) for operand in written}
    return None if None in rows else rows | {None}

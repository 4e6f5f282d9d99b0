"""Differential "unchanged" check: a call torch already accepts without the patch must give exactly
the same result patched.

The patch may only act where torch would raise. So for every call the sweep builds that torch runs
by itself, the call is made unpatched and patched from identical inputs and the two outcomes must be
identical:

* every output and every operand after the call (in-place writes): same kind (DTensor, tensor, other
  value), shape, dtype, DTensor placements and mesh, and the same bits in this rank's (local) tensor:
  NaNs equal where they sit in the same places with the same bits, ``-0.0`` differs from ``0.0``;
* or, when the unpatched call raises, the same exception type and message.

Contexts (``CONTEXTS``): every tensor operand a ``Replicate`` DTensor; every tensor operand a DTensor
with the case's operand ``Shard(d)``; the mixed call torch accepted unpatched (its own promotion of
one-element plain tensors, custom-handled ops); and every mixed call under DTensor's
``implicit_replication()``, where torch replicates plain operands itself. Each check is ``same`` or
``differs``; a ``differs`` is rerun unpatched once more, and becomes ``unstable`` when the two unpatched
runs differ from each other (the call is not reproducible, so the patch cannot be judged).

A call whose unpatched run raises torch's own mixed-operand error ("got mixed torch.Tensor and
DTensor", e.g. from a plain tensor that a composite op such as ``scaled_dot_product_attention`` makes
inside) is one torch does not accept: the patch is meant to act there. Such a run is recorded as
``not_accepted`` and is not a check.

Everything here runs inside one rank and compares that rank's values only (no collective):
``runner._merge`` makes a check ``differs`` when it differs on any rank.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .common import short
from .values import call

DIFF_CLASSES = ("same", "differs", "unstable")
NOT_ACCEPTED = "not_accepted"
TORCH_MIXED_ERROR = "got mixed torch.Tensor and DTensor"

CONTEXTS: Dict[str, str] = {
    "all_replicate": "every tensor operand a `Replicate` DTensor",
    "all_dtensor": "every tensor operand a DTensor: the case's operand `Shard(d)`, the others `Replicate`",
    "mixed_accepted": "one operand a DTensor, the others plain, a call torch accepted unpatched",
    "implicit_replication": "one operand a DTensor, the others plain, under `implicit_replication()`",
}

Outcome = Dict[str, Any]


def _snapshot_leaf(value: Any) -> Tuple[Any, ...]:
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        # _local_tensor: read without dispatching anything through DTensor (or the patch).
        return ("DTensor", tuple(value.shape), str(value.dtype), tuple(str(p) for p in value.placements),
                str(value.device_mesh), value._local_tensor.detach().clone())
    if isinstance(value, torch.Tensor):
        return ("Tensor", tuple(value.shape), str(value.dtype), None, None, value.detach().clone())
    return ("value", type(value).__name__, repr(value))


def snapshot(value: Any) -> Tuple[str, List[Tuple[Any, ...]]]:
    """(tree structure, a copy of every leaf): what a call returned or left in its operands, frozen."""
    import torch.utils._pytree as pytree

    leaves, spec = pytree.tree_flatten(value)
    return str(spec), [_snapshot_leaf(v) for v in leaves]


def capture(fn: Any, make_leaves: Callable[[], List[Any]], spec: Any, implicit: bool = False) -> Outcome:
    """Build the operands, make the call (under ``implicit_replication()`` if asked) and freeze the outcome."""
    from torch.distributed.tensor.experimental import implicit_replication

    try:
        leaves = make_leaves()
        with implicit_replication() if implicit else contextlib.nullcontext():
            out = call(fn, leaves, spec)
        return {"returned": True, "out": snapshot(out), "leaves": snapshot(leaves)}
    except Exception as exc:  # noqa: BLE001 - the error is the result, compared between phases
        kind = type(exc)
        return {"returned": False, "exc_type": f"{kind.__module__}.{kind.__qualname__}", "exc_name": kind.__name__,
                "exc_msg": str(exc)}


def outcome_label(outcome: Outcome) -> str:
    return "returned" if outcome["returned"] else f"raised {outcome['exc_name']}"


def _as_bytes(t: Any) -> Any:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _tensor_difference(a: Any, b: Any, where: str) -> Optional[str]:
    """None when ``a`` and ``b`` hold the same bits; else where and how they differ."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{where}: local tensor {list(a.shape)} {a.dtype} unpatched, {list(b.shape)} {b.dtype} patched"
    try:
        if torch.equal(_as_bytes(a), _as_bytes(b)):
            return None
    except Exception:  # noqa: BLE001 - a dtype without a byte view: values, NaNs in the same places
        if torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                 and torch.equal(a[~a.isnan()], b[~b.isnan()])):
            return None
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    if a.is_floating_point() or a.is_complex():
        bad = ~((flat_a == flat_b) | (flat_a.isnan() & flat_b.isnan()))
        if not bool(bad.any()):
            return f"{where}: equal values but different bits (signed zeros or NaN payloads)"
    else:
        bad = flat_a != flat_b
    first = int(bad.nonzero()[0, 0]) if bool(bad.any()) else 0
    return (f"{where}: {int(bad.sum())} of {flat_a.numel()} elements differ, first at flat index {first}: "
            f"{flat_a[first].item()!r} unpatched, {flat_b[first].item()!r} patched")


def _snapshot_difference(u: Tuple[str, List[Any]], p: Tuple[str, List[Any]], what: str) -> Optional[str]:
    (u_spec, u_leaves), (p_spec, p_leaves) = u, p
    if u_spec != p_spec or len(u_leaves) != len(p_leaves):
        return f"{what}: structure differs: {short(u_spec, 80)} unpatched, {short(p_spec, 80)} patched"
    for index, (a, b) in enumerate(zip(u_leaves, p_leaves)):
        where = what if len(u_leaves) == 1 else f"{what}[{index}]"
        if a[0] != b[0]:
            return f"{where}: {a[0]} unpatched, {b[0]} patched"
        if a[0] == "value":
            if a != b:
                return f"{where}: {short(a[2], 60)} unpatched, {short(b[2], 60)} patched"
            continue
        for label, slot in (("shape", 1), ("dtype", 2), ("placements", 3), ("mesh", 4)):
            if a[slot] != b[slot]:
                return f"{where}: {label} {a[slot]} unpatched, {b[slot]} patched"
        problem = _tensor_difference(a[5], b[5], where)
        if problem:
            return problem
    return None


def outcome_difference(unpatched: Outcome, patched: Outcome) -> Optional[str]:
    """None when the two outcomes are identical (values bit for bit, placements, exception); else what differs."""
    if unpatched["returned"] != patched["returned"]:
        if unpatched["returned"]:
            return short(f"unpatched returned; patched raised {patched['exc_name']}: {patched['exc_msg']}")
        return short(f"unpatched raised {unpatched['exc_name']}: {unpatched['exc_msg']}; patched returned")
    if not unpatched["returned"]:
        if unpatched["exc_type"] != patched["exc_type"]:
            return short(f"exception: {unpatched['exc_type']}: {short(unpatched['exc_msg'], 150)} unpatched; "
                         f"{patched['exc_type']}: {patched['exc_msg']} patched", 400)
        if unpatched["exc_msg"] != patched["exc_msg"]:
            return short(f"exception message: {unpatched['exc_msg']!r} unpatched, {patched['exc_msg']!r} patched", 400)
        return None
    return (_snapshot_difference(unpatched["out"], patched["out"], "output")
            or _snapshot_difference(unpatched["leaves"], patched["leaves"], "operands after the call"))


class Check:
    """One differential check: its record, how to rebuild its operands, and the outcomes seen."""

    def __init__(self, record: Dict[str, Any], fn: Any, spec: Any, make_leaves: Callable[[], List[Any]],
                 implicit: bool = False, unpatched: Optional[Outcome] = None) -> None:
        self.record, self.fn, self.spec, self.make_leaves, self.implicit = record, fn, spec, make_leaves, implicit
        self.unpatched = unpatched

    def run(self) -> Outcome:
        return capture(self.fn, self.make_leaves, self.spec, self.implicit)

    def run_unpatched(self) -> None:
        """Phase A (not patched)."""
        if self.unpatched is None:
            self.unpatched = self.run()
        self.record["unpatched"] = outcome_label(self.unpatched)

    def run_patched(self) -> None:
        """Phase B (patched): same or differs (not_accepted: torch raised its mixed-operand error)."""
        patched = self.run()
        if not self.unpatched["returned"] and TORCH_MIXED_ERROR in self.unpatched["exc_msg"]:
            self.record["cls"], self.record["msg"] = NOT_ACCEPTED, ("torch's mixed-operand error; patched "
                                                                    f"{outcome_label(patched)}")
            return
        problem = outcome_difference(self.unpatched, patched)
        self.record["cls"], self.record["msg"] = ("differs", problem) if problem else ("same", "")

    def recheck(self) -> None:
        """Phase C (not patched): a difference is real only if the call is reproducible unpatched."""
        if self.record["cls"] != "differs":
            return
        again = outcome_difference(self.unpatched, self.run())
        if again:
            self.record["cls"] = "unstable"
            self.record["msg"] = short(f"two unpatched runs differ ({again}); patched: {self.record['msg']}", 400)


def new_record(base: Dict[str, Any], context: str, pos: str = "-", placement: str = "-",
               shape: Sequence[int] = ()) -> Dict[str, Any]:
    return {"t": "diff", **base, "ctx": context, "pos": pos, "placement": placement, "shape": list(shape)}


def merge_ranks(mine: Dict[str, Any], theirs: Dict[str, Any], rank: int) -> None:
    """A check differs when it differs on any rank (each rank compares only its own local values)."""
    order = {c: i for i, c in enumerate(DIFF_CLASSES)}
    if order.get(theirs.get("cls"), 1) > order.get(mine["cls"], 0):
        mine["cls"], mine["msg"] = theirs.get("cls", "differs"), short(f"rank {rank}: {theirs.get('msg', '?')}", 400)


def summarize_diffs(records: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Totals of the differential check, overall and per context (runs torch did not accept left out)."""
    runs = [r for r in records if r["t"] == "diff"]
    checks = [r for r in runs if r["cls"] != NOT_ACCEPTED]
    per_context = {ctx: {c: sum(r["cls"] == c for r in checks if r["ctx"] == ctx) for c in DIFF_CLASSES}
                   for ctx in CONTEXTS}
    for ctx, counts in per_context.items():
        counts["checked"] = sum(r["ctx"] == ctx for r in checks)
        counts["unpatched_raised"] = sum(r["ctx"] == ctx and r["unpatched"] != "returned" for r in checks)
        counts[NOT_ACCEPTED] = sum(r["ctx"] == ctx and r["cls"] == NOT_ACCEPTED for r in runs)
    return {
        "runs": len(runs),
        NOT_ACCEPTED: [r for r in runs if r["cls"] == NOT_ACCEPTED],
        "checked": len(checks),
        "counts": {c: sum(r["cls"] == c for r in checks) for c in DIFF_CLASSES},
        "per_context": per_context,
        "differs": [r for r in checks if r["cls"] == "differs"],
        "unstable": [r for r in checks if r["cls"] == "unstable"],
        "ops": sorted({r["op"] for r in checks}),
    }

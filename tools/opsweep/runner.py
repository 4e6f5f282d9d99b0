"""Running the sweep: inside every rank (``sweep_ops``: phases unpatched / patched / DTensor alone)
and from the parent (``run_sweep``: chunks of ops on 2 gloo ranks, a failed chunk rerun op by op)."""

from __future__ import annotations

import logging
import os
import time
import traceback
import warnings
from functools import partial
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .classify import classify_exception
from .common import DEFAULT_MAX_SAMPLES, short
from .differential import Check, capture, merge_ranks, new_record
from .extra import EXTRA_TOLERANCE
from .sampling import op_infos, opinfo_tolerance, pick_positions, pick_samples, placements_for, sample_dtype, seed_for
from .values import (SeededOpFinder, all_dtensor, all_replicate, call, clone_leaves, compare, mark_leaf, to_full,
                     value_digest)

_HERE = os.path.dirname(os.path.abspath(__file__))  # frames of the sweep itself are left out of crash locations


def _gather_check(device_mesh: Any, key: str, digest: str, full_value: Any, rtol: float, atol: float) -> Optional[str]:
    """One collective per case on every rank: ranks agree on the case and on its result."""
    import torch.distributed as dist

    group = device_mesh.get_group()
    found: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, (key, digest), group=group)
    keys = {k for k, _ in found}
    if len(keys) != 1:
        raise RuntimeError(f"ranks out of step: running {sorted(keys)}")  # abort the chunk
    if len({d for _, d in found}) == 1:
        return None
    values: List[Any] = [None] * len(found)
    dist.all_gather_object(values, full_value, group=group)
    for r in range(1, len(values)):
        problem = compare(values[r], values[0], rtol, atol, f"rank {r} vs rank 0")
        if problem:
            return problem
    return None


def _run_case(item: Dict[str, Any], make_leaves: Any, device_mesh: Any, phase: str) -> Tuple[str, str]:
    """Run one case on every rank; (class, message), the ranks' results compared with each other."""
    case = item["case"]
    rtol, atol = case["rtol"], case["atol"]
    key = f"{phase}/{case['op']}/{case['kind']}/{case['s']}/{case['pos']}/{case['placement']}"
    got: Any = None
    try:
        run_leaves = make_leaves()
        out = call(item["fn"], run_leaves, item["spec"])
    except Exception as exc:  # noqa: BLE001 - the error is the result, classified
        cls, msg = classify_exception(exc)
        if cls == "crash":
            frames = [f for f in traceback.extract_tb(exc.__traceback__)
                      if os.path.dirname(os.path.abspath(f.filename)) != _HERE]
            if frames:
                msg = short(f"{msg} @ {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}")
    else:
        try:
            got = (to_full(out), to_full(run_leaves))
            problem = (compare(got[0], item["ref_out"], rtol, atol, "output")
                       or compare(got[1], item["ref_leaves"], rtol, atol, "operands after the call"))
            cls, msg = ("wrong", problem) if problem else ("correct", "")
        except Exception as exc:  # noqa: BLE001 - a failure reading the result is a crash case
            cls, msg, got = "crash", short(f"while reading the result: {type(exc).__name__}: {exc}"), None
    digest = value_digest(got) if got is not None else cls
    disagreement = _gather_check(device_mesh, key, f"{cls}:{digest}", got if got is not None else cls, rtol, atol)
    if disagreement and cls == "correct":
        cls, msg = "wrong", f"ranks disagree: {disagreement}"
    elif disagreement and cls == "wrong":
        msg = f"{msg} (and the ranks disagree)"
    return cls, short(msg)


def sweep_ops(op_names: Sequence[str], max_samples: int = DEFAULT_MAX_SAMPLES, shard_dims: str = "all",
              extra: str = "all") -> List[Dict[str, Any]]:
    """Run inside every rank (identical work): the records of the cases of ``op_names``.

    ``shard_dims``: which dims of OpInfo's samples are sharded (``sampling.placements_for``); ``extra``:
    the sweep's own samples (``extra.extra_samples``: "all", "key" or "none"), sharded on every dim.

    Records are dicts with ``t`` = "op" (per op: swept or why not), "sample" (per usable sample:
    description, DTensor support) or "case" (op, kind, sample, operand, placement, cls, msg, ...).
    """
    import keras_dtensor_mixfix as mf
    from keras_dtensor_mixfix.testing import mesh

    device_mesh = mesh()
    infos = op_infos()
    # Phase A must see torch unpatched (auto-activation may have patched this process); the
    # state found is restored at the end.
    was_patched = mf.is_patched()
    if was_patched:
        mf.unpatch()
    noisy = logging.getLogger("torch._subclasses.fake_tensor")  # logs every shape error it re-raises
    level = noisy.level
    noisy.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _sweep_ops(op_names, max_samples, device_mesh, infos, shard_dims, extra)
    finally:
        noisy.setLevel(level)
        if was_patched and not mf.is_patched():
            mf.patch()


def _sweep_ops(op_names: Sequence[str], max_samples: int, device_mesh: Any, infos: Dict[str, Any],
               shard_dims: str, extra: str) -> List[Dict[str, Any]]:
    import torch
    import torch.distributed as dist
    import keras_dtensor_mixfix as mf

    records: List[Dict[str, Any]] = []
    pending: List[Dict[str, Any]] = []   # cases to run patched (phase B)
    checks: List[Check] = []             # differential checks: calls torch accepts unpatched (phase B too)

    # ---------------------------------------------------------------- phase A: no patch
    for name in op_names:
        info = infos[name]
        dtype = sample_dtype(info)
        op_rtol, op_atol = opinfo_tolerance(info, dtype)
        torch.manual_seed(seed_for(name))
        kinds = [("op", info.op)] + ([("inplace", info.inplace_variant)] if info.inplace_variant is not None else [])
        swept, skipped = 0, {}
        payload = pick_samples(info, dtype, max_samples, shard_dims, extra) if dist.get_rank() == 0 else None
        # Rank 0's samples for every rank: some sample_inputs iterate sets (order varies with the
        # per-process hash seed), and every rank must run exactly the same inputs.
        box = [payload]
        dist.broadcast_object_list(box, src=0, group=device_mesh.get_group())
        picked, skipped, error = box[0]
        if error:
            records.append({"t": "op", "op": name, "status": "skipped", "reason": error})
            continue
        for index, desc, leaves, labels, spec, tensors, shard_mode, tag in picked:
            rtol, atol = op_rtol, op_atol
            if tag:  # the sweep's own sample (extra.py): what it is for, and a tolerance that sees a biased mean
                desc = f"{desc} [{tag}]"
                rtol, atol = min(rtol, EXTRA_TOLERANCE), min(atol, EXTRA_TOLERANCE)
            for kind, fn in kinds:
                base = {"op": name, "kind": kind, "s": index}
                # reference: all plain (twice, to detect random ops the name did not give away)
                try:
                    ref_leaves = clone_leaves(leaves)
                    with SeededOpFinder() as seeded:
                        ref_out = call(fn, ref_leaves, spec)
                    again_leaves = clone_leaves(leaves)
                    again = call(fn, again_leaves, spec)
                except Exception as exc:  # noqa: BLE001 - a sample the plain op refuses is skipped
                    records.append({"t": "sample", **base, "desc": desc, "status": "skipped",
                                    "reason": short(f"plain reference raised {type(exc).__name__}: {exc}")})
                    continue
                ref_out, ref_leaves = to_full(ref_out), to_full(ref_leaves)
                if seeded.found:
                    records.append({"t": "sample", **base, "desc": desc, "status": "skipped",
                                    "reason": short(f"random: dispatches {sorted(set(seeded.found))[0]}")})
                    continue
                if (compare(to_full(again), ref_out, rtol, atol, "out")
                        or compare(to_full(again_leaves), ref_leaves, rtol, atol, "args")):
                    records.append({"t": "sample", **base, "desc": desc, "status": "skipped",
                                    "reason": "nondeterministic: two plain runs differ (random op)"})
                    continue
                # does DTensor itself support it? every tensor operand Replicate, no patch
                try:
                    dt_leaves = all_replicate(leaves, device_mesh)
                    dt_out = call(fn, dt_leaves, spec)
                    dt_full, dt_leaves_full = to_full(dt_out), to_full(dt_leaves)
                    diff = (compare(dt_full, ref_out, rtol, atol, "out")
                            or compare(dt_leaves_full, ref_leaves, rtol, atol, "args"))
                    support, support_msg = "supported", ("values differ from plain: " + diff) if diff else ""
                except Exception as exc:  # noqa: BLE001 - what DTensor alone refuses is the result
                    support, support_msg = "unsupported", short(f"{type(exc).__name__}: {exc}")
                records.append({"t": "sample", **base, "desc": desc, "status": "swept", "dtensor": support,
                                "dtensor_msg": short(support_msg)})
                swept += 1
                checks.append(Check(new_record(base, "all_replicate", placement="R (all)"), fn, spec,
                                    partial(all_replicate, leaves, device_mesh)))
                for position in pick_positions(tensors):
                    for placement in placements_for(leaves[position], shard_mode):
                        case = {"t": "case", **base, "pos": labels[position], "placement": str(placement),
                                "shape": list(leaves[position].shape), "rtol": rtol, "atol": atol}
                        # did torch accept the mixed call without the patch?
                        mixed = partial(mark_leaf, leaves, position, placement, device_mesh)
                        unpatched = capture(fn, mixed, spec)
                        case["unpatched_ok"] = unpatched["returned"]
                        case["unpatched"] = "ok" if unpatched["returned"] else \
                            short(f"{unpatched['exc_name']}: {unpatched['exc_msg']}", 120)
                        where = {"pos": case["pos"], "placement": case["placement"], "shape": case["shape"]}
                        if unpatched["returned"]:
                            checks.append(Check(new_record(base, "mixed_accepted", **where), fn, spec, mixed,
                                                unpatched=unpatched))
                        if case["placement"] != "R":  # with R it is the all-Replicate call above
                            checks.append(Check(new_record(base, "all_dtensor", **where), fn, spec,
                                                partial(all_dtensor, leaves, position, placement, device_mesh)))
                        checks.append(Check(new_record(base, "implicit_replication", **where), fn, spec, mixed,
                                            implicit=True))
                        pending.append({"case": case, "fn": fn, "leaves": leaves, "spec": spec, "index": position,
                                        "placement": placement, "ref_out": ref_out, "ref_leaves": ref_leaves})
        status = "swept" if swept else "skipped"
        reason = "" if swept else ("no usable sample ("
                                   + ", ".join(f"{k}: {v}" for k, v in sorted(skipped.items())) + ")"
                                   if skipped else "no usable sample")
        if not swept and picked:
            reason = "plain reference raised or was random for every usable sample"
        records.append({"t": "op", "op": name, "status": status, "reason": reason, "dtype": str(dtype)})
    for check in checks:
        check.run_unpatched()

    # ---------------------------------------------------------------- phase B: patched
    with mf.patched():
        for item in pending:
            case = item["case"]
            def run_leaves(item: Dict[str, Any] = item) -> Any:
                return mark_leaf(item["leaves"], item["index"], item["placement"], device_mesh)

            cls, msg = _run_case(item, run_leaves, device_mesh, "patched")
            case["cls"], case["msg"] = cls, msg
        for check in checks:
            check.run_patched()
    # ---------------------------------------------------------------- phase C: DTensor alone
    # For each case that is not correct: the same call with every other operand a Replicate
    # DTensor (what "replicate" promotion amounts to), unpatched. Tells torch's bugs and limits
    # from the patch's.
    for item in pending:
        case = item["case"]
        if case["cls"] != "correct":
            alone = partial(all_dtensor, item["leaves"], item["index"], item["placement"], device_mesh)
            cls, msg = _run_case(item, alone, device_mesh, "alone")
            case["dtensor_alone"] = short(f"{cls}: {msg}" if msg else cls, 160)
        del case["rtol"], case["atol"]
        records.append(case)
    # A difference counts only if the call is reproducible unpatched: rerun those, unpatched.
    for check in checks:
        check.recheck()
        records.append(check.record)
    return records


# ============================================================================ parent side


def _merge(per_rank: List[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """Rank 0's records; a case whose class differs on another rank becomes 'wrong', a differential
    check that differs (or is unstable) on another rank does so here too."""
    main = per_rank[0]
    for other_rank, other in enumerate(per_rank[1:], start=1):
        if len(other) != len(main):
            for record in main:
                if record["t"] == "case" and record["cls"] == "correct":
                    record["cls"], record["msg"] = "wrong", (f"rank {other_rank} returned {len(other)} records, "
                                                             f"rank 0 {len(main)}")
                elif record["t"] == "diff" and record["cls"] == "same":
                    record["cls"], record["msg"] = "differs", (f"rank {other_rank} returned {len(other)} records, "
                                                               f"rank 0 {len(main)}")
            continue
        for mine, theirs in zip(main, other):
            if mine["t"] == "diff":
                merge_ranks(mine, theirs, other_rank)
            elif mine["t"] == "case" and theirs.get("cls") != mine["cls"]:
                mine["msg"] = short(f"ranks disagree: rank 0 {mine['cls']} ({mine['msg']}); rank {other_rank} "
                                     f"{theirs.get('cls')} ({theirs.get('msg')})")
                mine["cls"] = "wrong"
    return main


def run_sweep(op_names: Sequence[str], max_samples: int = DEFAULT_MAX_SAMPLES, chunk_size: int = 50,
              chunk_timeout: float = 900.0, op_timeout: float = 300.0,
              log: Any = print, shard_dims: str = "all", extra: str = "all") -> List[Dict[str, Any]]:
    """Sweep ``op_names`` on 2 ranks, one ``run_on_ranks`` call per chunk; a failed chunk is rerun op by op.
    ``shard_dims`` and ``extra``: see ``sweep_ops``."""
    from keras_dtensor_mixfix.testing import RankError, run_on_ranks

    records: List[Dict[str, Any]] = []
    chunks = [list(op_names[i: i + chunk_size]) for i in range(0, len(op_names), chunk_size)]
    for number, chunk in enumerate(chunks, start=1):
        started = time.monotonic()
        try:
            got = _merge(run_on_ranks(sweep_ops, chunk, max_samples, shard_dims, extra, world_size=2,
                                      timeout=chunk_timeout))
            records.extend(got)
            log(f"chunk {number}/{len(chunks)}: {len(chunk)} ops, {sum(r['t'] == 'case' for r in got)} cases, "
                f"{time.monotonic() - started:.0f}s")
            continue
        except RankError as exc:
            log(f"chunk {number}/{len(chunks)} failed ({exc.exc_type}: {short(exc.message, 150)}); rerunning op by op")
        for name in chunk:
            try:
                records.extend(_merge(run_on_ranks(sweep_ops, [name], max_samples, shard_dims, extra, world_size=2,
                                                   timeout=op_timeout)))
            except RankError as exc:
                log(f"  {name}: {exc.exc_type}: {short(exc.message, 150)}")
                tail = short(exc.remote_traceback.strip().splitlines()[-1] if exc.remote_traceback.strip() else "", 80)
                records.append({"t": "op", "op": name, "status": "worker_failed"})
                records.append({"t": "case", "op": name, "kind": "op", "s": -1, "pos": "-", "placement": "-",
                                "shape": [], "unpatched_ok": False, "cls": "crash",
                                "msg": short(f"worker failed on rank {exc.rank}: {exc.exc_type}: "
                                             f"{exc.message} {tail}")})
    return records

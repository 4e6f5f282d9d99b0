"""OP_SWEEP.md from the sweep's records."""

from __future__ import annotations

import datetime
import re
import sys
from typing import Any, Dict, List, Optional, Sequence

from .classify import CLASSES, alone_class, attribution, summarize
from .common import MAX_POSITIONS, short
from .differential import CONTEXTS, DIFF_CLASSES, NOT_ACCEPTED, summarize_diffs
from .extra import EXTRA_BASE, EXTRA_TOLERANCE
from .sampling import NOT_RANDOM


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "n/a"


def cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _count(items: Any) -> Dict[str, int]:
    found: Dict[str, int] = {}
    for item in items:
        found[item] = found.get(item, 0) + 1
    return found


def differential_section(records: Sequence[Dict[str, Any]], command: str) -> List[str]:
    """The report's section on the differential check: totals per context and every check not ``same``."""
    d = summarize_diffs(records)
    samples = {(r["op"], r["kind"], r["s"]): r for r in records if r["t"] == "sample"}
    lines: List[str] = ["## Differential check: calls torch accepts unpatched are unchanged by the patch", ""]
    add = lines.append
    if not d["runs"]:
        add("Not run: these records predate the differential check.")
        add("")
        return lines
    add(f"Produced by the same run: `{command}`. For every swept sample and case, each call below that torch makes "
        "without the patch was run unpatched and then patched (`keras_dtensor_mixfix.patched()`), from identical "
        "inputs, on both ranks. `same` = identical outcome: every output and every operand after the call (in-place "
        "writes) of the same kind, shape, dtype, DTensor placements and mesh, with bit-for-bit equal local values "
        "(NaNs in the same places), or, where the unpatched call raised, the same exception type and message. "
        "`differs` = anything else, on either rank. A `differs` is rerun unpatched once more: `unstable` = the two "
        "unpatched runs differ too (not reproducible, so the patch is not judged). A run whose unpatched call "
        "raised torch's own mixed-operand error (\"got mixed torch.Tensor and DTensor\", from a plain tensor a "
        "composite op makes inside) is a call torch does not accept, where the patch is meant to act: it is counted "
        "as *not accepted* and is no check.")
    add("")
    add("| context | calls | runs | not accepted | checked | unpatched raised | same | differs | unstable |")
    add("|---|---|---|---|---|---|---|---|---|")
    for ctx, what in CONTEXTS.items():
        c = d["per_context"][ctx]
        add(f"| `{ctx}` | {what} | {c['checked'] + c[NOT_ACCEPTED]} | {c[NOT_ACCEPTED]} | {c['checked']} | "
            f"{c['unpatched_raised']} | " + " | ".join(str(c[k]) for k in DIFF_CLASSES) + " |")
    add(f"| **all** | | {d['runs']} | {len(d[NOT_ACCEPTED])} | **{d['checked']}** | "
        f"{sum(c['unpatched_raised'] for c in d['per_context'].values())} | "
        + " | ".join(f"**{d['counts'][k]}**" for k in DIFF_CLASSES) + " |")
    add("")
    add(f"- ops checked: {len(d['ops'])}; ops with a `differs`: {len({r['op'] for r in d['differs']})} "
        f"({', '.join(f'`{op}`' for op in sorted({r['op'] for r in d['differs']})) or 'none'})")
    add("- `all_replicate` / `all_dtensor` / `mixed_accepted`: calls torch accepts as they are; "
        "`implicit_replication`: every mixed case again, under DTensor's own implicit replication of plain operands.")
    if d[NOT_ACCEPTED]:
        add("- not accepted (torch's mixed-operand error unpatched): "
            + ", ".join(f"`{op}` {n}" for op, n in sorted(_count(r["op"] for r in d[NOT_ACCEPTED]).items())))
    add("")
    if d["differs"]:
        add("### Differs by op")
        add("")
        add("| op | context | differs where torch returned | differs where torch raised | first difference |")
        add("|---|---|---|---|---|")
        groups: Dict[Any, List[Dict[str, Any]]] = {}
        for r in d["differs"]:
            groups.setdefault((r["op"], r["ctx"]), []).append(r)
        for (op, ctx), rows in sorted(groups.items()):
            back = sum(r["unpatched"] == "returned" for r in rows)
            add(f"| `{op}` | {ctx} | {back} | {len(rows) - back} | {cell(short(rows[0]['msg'], 160))} |")
        add("")
    returned = [r for r in d["differs"] if r["unpatched"] == "returned"]
    raised = [r for r in d["differs"] if r["unpatched"] != "returned"]
    header = ("| op | variant | sample | sample operands | context | DTensor operand [shape] | placement | unpatched | "
              "what differs (unpatched vs patched) |")
    for title, rows in ((f"Differs where torch returned a result (the patch changed it): {len(returned)}", returned),
                        (f"Differs where torch raised (the patch replaced its exception): {len(raised)}", raised),
                        (f"Unstable (two unpatched runs differ): {len(d['unstable'])}", d["unstable"])):
        add(f"### {title}")
        add("")
        if not rows:
            add("None.")
            add("")
            continue
        add(header)
        add("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            desc = samples.get((r["op"], r["kind"], r["s"]), {}).get("desc", "")
            add(f"| `{r['op']}` | {r['kind']} | {r['s']} | `{cell(desc)}` | {r['ctx']} | {r['pos']} {r['shape']} | "
                f"{r['placement']} | {cell(r['unpatched'])} | {cell(short(r['msg']))} |")
        add("")
    return lines


SHARD_TEXT = {
    "first-even": "`Shard(d)` on the first dim of even size",
    "even": "`Shard(d)` on every dim of even size in turn (the dims the op reduces over included)",
    "all": "`Shard(d)` on every dim of size >= 2 in turn (uneven shards included)",
}


def extra_section(records: Sequence[Dict[str, Any]]) -> List[str]:
    """Per op, the cases on the sweep's own samples (extra.py) by class: where reductions were probed."""
    cases = [r for r in records if r["t"] == "case" and r["s"] >= EXTRA_BASE]
    if not cases:
        return []
    samples = {(r["op"], r["s"]) for r in records
               if r["t"] == "sample" and r["s"] >= EXTRA_BASE and r["status"] == "swept"}
    lines = [f"## The sweep's own samples (reduction keywords, reduced and indexed dims): {len(cases)} cases", "",
             "Wrong cases and clear errors on them are in the tables above and below with the rest; the sample "
             "column there ends with what the sample is for, in brackets. `clear, alone correct` = a clear error where "
             "DTensor alone (other operands Replicate DTensors, unpatched) gives the right values.", "",
             "| op | samples | cases | correct | clear_error | clear, alone correct | wrong | crash |",
             "|---|---|---|---|---|---|---|---|"]
    by_op: Dict[str, List[Dict[str, Any]]] = {}
    for r in cases:
        by_op.setdefault(r["op"], []).append(r)
    for op, rows in sorted(by_op.items()):
        n = {c: sum(r["cls"] == c for r in rows) for c in CLASSES}
        could = sum(r["cls"] == "clear_error" and alone_class(r) == "correct" for r in rows)
        lines.append(f"| `{op}` | {sum(o == op for o, _ in samples)} | {len(rows)} | {n['correct']} | "
                     f"{n['clear_error']} | {could} | {n['wrong']} | {n['crash']} |")
    lines.append("")
    return lines


def write_report(records: Sequence[Dict[str, Any]], path: str, command: str, random_ops: Sequence[str],
                 max_samples: int, elapsed: float, date: Optional[str] = None, note: str = "",
                 shard_dims: str = "all", extra: str = "all") -> Dict[str, Any]:
    import torch

    s = summarize(records)
    samples = {(r["op"], r["kind"], r["s"]): r for r in records if r["t"] == "sample"}
    op_recs = {r["op"]: r for r in records if r["t"] == "op"}
    cases = [r for r in records if r["t"] == "case"]
    lines: List[str] = []
    add = lines.append
    add("# OpInfo sweep: ops mixing plain tensors and DTensors under `keras_dtensor_mixfix.patched()`")
    add("")
    add(f"- command: `{command}`")
    add(f"- torch {torch.__version__}, Python {sys.version.split()[0]}, "
        f"{date or now_utc()}, {elapsed:.0f}s on 2 gloo CPU ranks (127.0.0.1)" + (f"; {note}" if note else ""))
    add(f"- up to {max_samples} samples per op from `op.sample_inputs('cpu', float32)` (ops without float32: int64, "
        "else bool), keeping those with >= 2 tensor operands, all float32/int64/bool and non-empty; up to "
        f"{MAX_POSITIONS} operands per sample take a turn as the one DTensor, as `R` = `Replicate()` and as `S(d)` = "
        f"{SHARD_TEXT[shard_dims]}, built by `distribute_tensor` from the same full tensor on both ranks; "
        "the other operands stay plain. `op.op` and, where it exists, `op.inplace_variant` (variant `inplace`).")
    extra_ops = sorted({r["op"] for r in records if r["t"] == "sample" and r["s"] >= EXTRA_BASE})
    if extra != "none" and extra_ops:
        add(f"- and the sweep's own samples ({'all' if extra == 'all' else 'the CI subset'} of "
            f"`tools/opsweep/extra.py`, numbered from {EXTRA_BASE}, in {len(extra_ops)} ops), seeded: the keywords "
            "that change a reduction "
            "(`reduction` mean/sum/none, `weight`, `pos_weight`, `ignore_index` with targets that hit it, "
            "`label_smoothing`, probability targets) on losses at batch 4 and at batch 3 (uneven shards), and the dims "
            "scatter/index ops, masked reductions (plain mask), norms (plain weight, bias, running stats) and "
            "contractions reduce over at size 4; every dim of size >= 2 of their operands is sharded in turn "
            f"(uneven shards included), and results are compared with rtol and atol at most {EXTRA_TOLERANCE:g} "
            "(OpInfo's float32 overrides, up to 3e-3, would hide a mean biased by a few percent). Their sample column "
            "ends with what the sample is for, in brackets.")
    add("- compared with the all-plain run: outputs and every operand after the call (in-place writes), "
        "`assert_close(equal_nan=True)` with the OpInfo's largest float32 tolerance override or rtol=1.3e-6/atol=1e-5; "
        "the two ranks' results are compared with each other too.")
    add("- classes: `correct`; `clear_error` = `MixedOperandError`, or a RuntimeError/NotImplementedError from DTensor "
        "saying the op has no sharding strategy / is unsupported; `wrong` = no error but values, structure or ranks "
        "differ; `crash` = any other exception, or a worker that died or hung.")
    add("- \"DTensor supports\" a sample when the same call with every tensor operand a `Replicate` DTensor runs "
        "unpatched. For every case that is not correct, the same call was also run unpatched with the other operands "
        "made `Replicate` DTensors (\"DTensor alone\"): what the patch's promotion amounts to, without the patch.")
    add("- differential check: every call torch makes without the patch (all operands DTensors, mixed calls torch "
        "accepts, mixed calls under `implicit_replication()`) must give the same outcome patched, bit for bit; see "
        "the section below the totals.")
    add("")
    add("## Totals")
    add("")
    add("| class | cases | ops with such a case |")
    add("|---|---|---|")
    for c in CLASSES:
        add(f"| {c} | {s['counts'][c]} | {len({r['op'] for r in cases if r['cls'] == c})} |")
    add(f"| **all** | {s['cases']} | {len(s['ops_swept'])} |")
    add("")
    add(f"- ops swept: {len(s['ops_swept'])}; ops whose every case is correct: {len(s['ops_all_correct'])}")
    add(f"- **correct among cases on samples DTensor supports: {s['supported_cases_correct']}/{s['supported_cases']} = "
        f"{pct(s['supported_cases_correct'], s['supported_cases'])}**")
    add(f"- **ops DTensor supports (on >= 1 swept sample): {len(s['supported_ops'])}; every case on their supported "
        f"samples correct: {len(s['supported_ops_correct'])} = "
        f"{pct(len(s['supported_ops_correct']), len(s['supported_ops']))}**")
    bad = [r for r in cases if r["cls"] in ("wrong", "crash")]
    blame: Dict[str, int] = {}
    for r in bad:
        who = attribution(r).split(":")[0]
        blame[who] = blame.get(who, 0) + 1
    add(f"- wrong or crash: {len(bad)} cases, by where the fault is (see the last column of the tables below): "
        + ", ".join(f"{who} {n}" for who, n in sorted(blame.items())))
    clear = [r for r in cases if r["cls"] == "clear_error"]
    could = [r for r in clear if alone_class(r) == "correct"]
    add(f"- clear errors: {len(clear)} cases; in {len(could)} of them DTensor alone (other operands Replicate "
        "DTensors, unpatched) gives the right values, so the promotion could have succeeded")
    add(f"- cases torch already accepted unpatched (no promotion needed): {s['no_promotion_cases']}, in "
        f"{len(s['no_promotion_needed'])} ops")
    add("")
    lines.extend(differential_section(records, command))

    def case_row(r: Dict[str, Any]) -> str:
        desc = samples.get((r["op"], r["kind"], r["s"]), {}).get("desc", "")
        who = attribution(r) if r["cls"] in ("wrong", "crash") else "patch: DTensor alone is correct"
        return (f"| `{r['op']}` | {r['kind']} | {r['s']} | `{cell(desc)}` | {r['pos']} {r['shape']} | "
                f"{r['placement']} | {cell(r['msg'])} | {cell(r.get('unpatched', ''))} | "
                f"{cell(r.get('dtensor_alone', ''))} | {who} |")

    add("## Wrong and crash cases by op")
    add("")
    add("| op | wrong | crash | fault |")
    add("|---|---|---|---|")
    bad_ops: Dict[str, List[Dict[str, Any]]] = {}
    for r in bad:
        bad_ops.setdefault(r["op"], []).append(r)
    for op, rows in sorted(bad_ops.items()):
        whos = sorted({attribution(r) for r in rows})
        add(f"| `{op}` | {sum(r['cls'] == 'wrong' for r in rows)} | {sum(r['cls'] == 'crash' for r in rows)} | "
            f"{cell('; '.join(whos))} |")
    add("")
    header = ("| op | variant | sample | sample operands | DTensor operand [shape] | placement | "
              "what happened (patched) | same call unpatched | DTensor alone (others Replicate DTensors), unpatched | "
              "fault |")
    for title, rows in (("Wrong (no error, values differ)", [r for r in cases if r["cls"] == "wrong"]),
                        ("Crash (unclear exception, dead or hung worker)", [r for r in cases if r["cls"] == "crash"]),
                        ("Clear errors where DTensor alone gives the right values", could)):
        add(f"## {title}: {len(rows)}")
        add("")
        if rows:
            add(header)
            add("|---|---|---|---|---|---|---|---|---|---|")
            lines.extend(case_row(r) for r in rows)
        else:
            add("None.")
        add("")

    lines.extend(extra_section(records))
    add(f"## Clear errors by op: {len(clear)} cases in {len({r['op'] for r in clear})} ops")
    add("")
    add("| op | clear / cases | DTensor supports the sample (all Replicate) | DTensor alone, same placements | "
        "first message |")
    add("|---|---|---|---|---|")
    by_op: Dict[str, List[Dict[str, Any]]] = {}
    for r in cases:
        by_op.setdefault(r["op"], []).append(r)
    for op in sorted({r["op"] for r in clear}):
        mine = [r for r in by_op[op] if r["cls"] == "clear_error"]
        support = sorted({samples.get((r["op"], r["kind"], r["s"]), {}).get("dtensor", "?") for r in mine})
        alone: Dict[str, int] = {}
        for r in mine:
            alone[alone_class(r) or "?"] = alone.get(alone_class(r) or "?", 0) + 1
        add(f"| `{op}` | {len(mine)}/{len(by_op[op])} | {', '.join(support)} | "
            f"{', '.join(f'{k} {v}' for k, v in sorted(alone.items()))} | {cell(mine[0]['msg'])} |")
    add("")
    add("## Ops torch accepted unpatched (no promotion needed in at least one case)")
    add("")
    add("Mostly one-element plain operands, which torch itself treats as replicated.")
    add("")
    add(", ".join(f"`{op}`" for op in s["no_promotion_needed"]) or "None.")
    add("")
    unsupported = sorted({op for (op, _, _), r in samples.items() if r.get("dtensor") == "unsupported"}
                         - set(s["supported_ops"]))
    add(f"## Ops DTensor itself does not support on any swept sample: {len(unsupported)}")
    add("")
    add(", ".join(f"`{op}`" for op in unsupported) or "None.")
    add("")
    dt_wrong = sorted({op for (op, _, _), r in samples.items() if r.get("dtensor_msg", "").startswith("values differ")})
    if dt_wrong:
        add("DTensor alone (all Replicate, no patch) gave values different from plain torch for: "
            + ", ".join(f"`{op}`" for op in dt_wrong) + " (counted as supported).")
        add("")
    add("## Not swept")
    add("")
    add(f"- random ops, by name ({len(random_ops)}): " + ", ".join(f"`{o}`" for o in random_ops))
    add("- swept although the name contains such a word (deterministic): "
        + ", ".join(f"`{o}`" for o in sorted(NOT_RANDOM)))
    nondet = sorted({r["op"] for r in samples.values()
                     if r.get("reason", "").startswith(("nondeterministic", "random"))})
    add("- samples skipped as random (they dispatch an op tagged `nondeterministic_seeded`, or two plain runs differ): "
        + (", ".join(f"`{o}`" for o in nondet) or "none"))
    ref_failed = sorted({r["op"] for r in samples.values() if r.get("reason", "").startswith("plain reference raised")})
    add(f"- samples whose plain run raised (mostly in-place variants whose input cannot hold the broadcast result), in "
        f"{len(ref_failed)} ops: skipped")
    skipped_ops = sorted((op, r.get("reason", "")) for op, r in op_recs.items()
                         if r["status"] != "swept" and op not in s["ops_swept"])
    reasons: Dict[str, List[str]] = {}
    for op, reason in skipped_ops:
        key = re.sub(r"\d+", "N", reason) if reason.startswith("no usable sample") else reason
        reasons.setdefault(short(key, 160), []).append(op)
    add(f"- ops without a usable sample ({len(skipped_ops)}), by reason:")
    for reason, ops in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
        add(f"  - {cell(reason) or 'no reason'} ({len(ops)}): " + ", ".join(f"`{o}`" for o in ops))
    add("")
    with open(path, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return s

"""CI subset of the OpInfo sweep (``tools/op_sweep.py``): representative ops that mix plain tensors and DTensors.

For each op, up to 3 OpInfo samples with two or more tensor operands, and the sweep's own key samples
(``tools/opsweep/extra.py``: a loss's ``weight`` / ``ignore_index`` / ``pos_weight`` with ``reduction="mean"``
at batch 4 and at batch 3, the scatter / index dim of size 4, ...); each tensor operand in turn is made
the one DTensor (``Replicate()`` and ``Shard(d)`` on every dim of size >= 2, uneven shards included) on
2 gloo ranks, the rest stay plain, and ``op.op`` / ``op.inplace_variant`` run under
``keras_dtensor_mixfix.patched()``. Every case must be correct or a clear error: no wrong values and
no unclear exception; and a clear error only where DTensor alone fails too.

Differential check on the same samples: every call torch makes without the patch (every operand a
DTensor, ``Replicate`` and with the case's ``Shard``; mixed calls torch accepts itself; mixed calls
under ``implicit_replication()``) must give the same outcome patched, bit for bit, placements and
in-place writes included, or the same exception.

The whole subset runs in one ``run_on_ranks`` call. ``python tools/op_sweep.py`` sweeps every
OpInfo and writes OP_SWEEP.md.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

# Imported at collection time, before any rank worker starts: the workers are spawned with this
# process's sys.path, so they can import op_sweep to run its functions.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import op_sweep

SUBSET = [
    "add", "mul", "sub", "div.no_rounding_mode", "where", "addcmul", "lerp", "maximum",
    "matmul", "mm", "bmm", "cat", "stack", "index_select", "gather", "masked_fill",
    "nn.functional.embedding", "nn.functional.linear", "nn.functional.cross_entropy", "nn.functional.mse_loss",
    "clamp",  # tensor min/max bounds
    "pow", "atan2", "logaddexp", "einsum",
    # reductions a sharded operand changes (issue 29): class weights / ignored targets with a mean over a
    # batch-sharded input, the scatter / index dim sharded, a masked reduction with a plain mask
    "nn.functional.nll_loss", "nn.functional.binary_cross_entropy_with_logits", "scatter_add", "index_add",
    "index_put", "masked.sum",
]
MAX_SAMPLES = 3
EXTRA = "key"        # the sweep's own samples: only those marked key
SHARD_DIMS = "all"   # every dim of size >= 2, uneven shards included

# (op, variant, sample index, DTensor operand, placement) -> why it is expected to be wrong/crash (or
# a clear error where DTensor alone is right). Add an entry (with the reason) only for a bug that cannot
# be fixed at once; it is then excluded from the checks above, and test_known_bugs_still_fail fails once
# the case is fixed, so that the entry is removed. Samples numbered from 100 are the sweep's own
# (tools/opsweep/extra.py). None today.
KNOWN_BUGS: Dict[Tuple[str, str, int, str, str], str] = {}

# Found by the sweep of issue 29 (every dim sharded, uneven shards included) as wrong, then fixed: an
# elementwise loss's mean over a batch split unevenly (DTensor averages the ranks' own means), and in-place
# writes into a plain self beside a sharded index, src or mask (they now run on whole values). They must stay
# correct. (The in-place scatter_add_ / index_add_ into a self split where DTensor cannot write it are refused:
# the checks above hold them to DTensor alone failing too.)
WRITE_AND_MEAN_FIXES = [
    *[("nn.functional.mse_loss", "op", s, pos, "S(0)") for s in (1, 103) for pos in ("input", "args[0]")],
    *[("nn.functional.binary_cross_entropy_with_logits", "op", s, pos, "S(0)")
      for s in (2, 108) for pos in ("input", "args[0]")],
    ("masked_fill", "inplace", 1, "args[0]", "S(0)"),
    ("masked_fill", "inplace", 1, "args[0]", "S(1)"),
    *[("scatter_add", "inplace", s, pos, "S(1)") for s in (0, 100) for pos in ("args[1]", "args[2]")],
    ("index_add", "inplace", 100, "args[1]", "S(0)"),
    ("index_add", "inplace", 100, "args[2]", "S(1)"),
]

# Issue 29's silently wrong means and broad refusals, fixed: they must stay correct. A mean nll_loss /
# cross_entropy over a batch-sharded input with class weights, ignore_index hit by the targets (one
# rank's whole piece ignored, or one row), uneven batch; scatter_add out of place along any dim.
REDUCTION_FIXES = WRITE_AND_MEAN_FIXES + [
    *[("nn.functional.nll_loss", "op", s, "input", "S(0)") for s in (101, 103, 113, 117)],
    *[("nn.functional.cross_entropy", "op", s, "input", "S(0)") for s in (101, 103, 119, 124, 131)],
    ("scatter_add", "op", 100, "input", "S(0)"),
    ("scatter_add", "op", 100, "input", "S(1)"),
    ("scatter_add", "op", 0, "input", "S(0)"),
]

# Cases that once crashed (an in-place op writing into a plain one-element tensor next to a
# DTensor: torch's DTensor dispatch raised a bare AssertionError): they must stay correct.
REGRESSIONS = [
    ("add", "inplace", 0, "args[0]", "R"),
    ("mul", "inplace", 0, "args[0]", "R"),
    ("sub", "inplace", 0, "args[0]", "R"),
    ("div.no_rounding_mode", "inplace", 0, "args[0]", "R"),
    ("lerp", "inplace", 2, "args[0]", "R"),
    ("pow", "inplace", 0, "args[0]", "R"),
    ("atan2", "inplace", 0, "args[0]", "R"),
]


def _key(record: Dict[str, Any]) -> Tuple[str, str, int, str, str]:
    return (record["op"], record["kind"], record["s"], record["pos"], record["placement"])


def _describe(record: Dict[str, Any], samples: Dict[Any, Dict[str, Any]]) -> str:
    sample = samples.get((record["op"], record["kind"], record["s"]), {})
    return (f"{record['op']} [{record['kind']}] sample {record['s']} ({sample.get('desc', '?')}): DTensor operand "
            f"{record['pos']} {record['shape']} as {record['placement']} -> {record['cls']}: {record['msg']}")


@pytest.fixture(scope="module")
def sweep() -> Dict[str, Any]:
    names, random_ops = op_sweep.select_ops(SUBSET)
    assert not random_ops and len(names) == len(SUBSET), (names, random_ops)
    records = op_sweep.run_sweep(names, MAX_SAMPLES, chunk_size=len(names), log=lambda message: None,
                                 shard_dims=SHARD_DIMS, extra=EXTRA)
    cases = [r for r in records if r["t"] == "case"]
    samples = {(r["op"], r["kind"], r["s"]): r for r in records if r["t"] == "sample"}
    diffs = [r for r in records if r["t"] == "diff"]
    return {"records": records, "cases": cases, "samples": samples, "diffs": diffs}


@pytest.mark.parametrize("op", SUBSET)
def test_mixed_operands_are_correct_or_a_clear_error(sweep: Dict[str, Any], op: str) -> None:
    cases: List[Dict[str, Any]] = [r for r in sweep["cases"] if r["op"] == op]
    assert cases, f"{op}: no case was swept: {[r for r in sweep['records'] if r['op'] == op]}"
    bad = [r for r in cases if r["cls"] in ("wrong", "crash") and _key(r) not in KNOWN_BUGS]
    assert not bad, f"{op}: {len(bad)} wrong/crash case(s) of {len(cases)}:\n" + "\n".join(
        _describe(r, sweep["samples"]) for r in bad)


@pytest.mark.parametrize("op", SUBSET)
def test_patch_works_wherever_dtensor_alone_does(sweep: Dict[str, Any], op: str) -> None:
    """A case may be a clear error only where DTensor itself fails too.

    For every case that is not correct, the sweep reruns it unpatched with the other operands made
    Replicate DTensors by hand; if that gives the right values, the promotion should have too.
    """
    failed = [r for r in sweep["cases"] if r["op"] == op and r["cls"] != "correct"
              and r.get("dtensor_alone", "").split(":")[0] == "correct" and _key(r) not in KNOWN_BUGS]
    assert not failed, f"{op}: {len(failed)} case(s) fail only through the patch:\n" + "\n".join(
        _describe(r, sweep["samples"]) for r in failed)


@pytest.mark.parametrize("case", REGRESSIONS, ids=["/".join(map(str, c)) for c in REGRESSIONS])
def test_fixed_inplace_write_into_plain_scalar(sweep: Dict[str, Any], case: Tuple[str, str, int, str, str]) -> None:
    found = [r for r in sweep["cases"] if _key(r) == case]
    assert found, f"case {case} was not swept (OpInfo samples changed?): update REGRESSIONS"
    assert found[0]["cls"] == "correct", _describe(found[0], sweep["samples"])


@pytest.mark.parametrize("case", REDUCTION_FIXES, ids=["/".join(map(str, c)) for c in REDUCTION_FIXES])
def test_fixed_reduction_over_a_sharded_dim(sweep: Dict[str, Any], case: Tuple[str, str, int, str, str]) -> None:
    found = [r for r in sweep["cases"] if _key(r) == case]
    assert found, f"case {case} was not swept (samples changed?): update REDUCTION_FIXES"
    assert found[0]["cls"] == "correct", _describe(found[0], sweep["samples"])


def test_known_bugs_still_fail(sweep: Dict[str, Any]) -> None:
    """Every KNOWN_BUGS entry is swept and still fails; a fixed one must leave the list (its checks then apply)."""
    by_key = {_key(r): r for r in sweep["cases"]}
    missing = [key for key in KNOWN_BUGS if key not in by_key]
    assert not missing, f"KNOWN_BUGS entries not swept (samples changed?): {missing}"
    fixed = [by_key[key] for key in KNOWN_BUGS
             if not (by_key[key]["cls"] in ("wrong", "crash") or (by_key[key]["cls"] == "clear_error" and
                     by_key[key].get("dtensor_alone", "").split(":")[0] == "correct"))]
    assert not fixed, "fixed, remove from KNOWN_BUGS:\n" + "\n".join(_describe(r, sweep["samples"]) for r in fixed)


# Contexts where torch runs the call as it is: the patch must not act at all.
ACCEPTED_CONTEXTS = ("all_replicate", "all_dtensor", "mixed_accepted")


def _describe_diff(record: Dict[str, Any], samples: Dict[Any, Dict[str, Any]]) -> str:
    sample = samples.get((record["op"], record["kind"], record["s"]), {})
    return (f"{record['op']} [{record['kind']}] sample {record['s']} ({sample.get('desc', '?')}), {record['ctx']}: "
            f"operand {record['pos']} {record['shape']} as {record['placement']}, unpatched {record['unpatched']} -> "
            f"{record['cls']}: {record['msg']}")


@pytest.mark.parametrize("op", SUBSET)
def test_calls_torch_accepts_are_unchanged_by_the_patch(sweep: Dict[str, Any], op: str) -> None:
    """All-DTensor calls and the mixed calls torch accepts itself: same outcome patched, bit for bit."""
    checks = [r for r in sweep["diffs"] if r["op"] == op and r["ctx"] in ACCEPTED_CONTEXTS]
    assert any(r["ctx"] == "all_replicate" for r in checks), f"{op}: no all-DTensor call was checked"
    differs = [r for r in checks if r["cls"] == "differs"]
    assert not differs, f"{op}: {len(differs)} of {len(checks)} accepted call(s) differ patched:\n" + "\n".join(
        _describe_diff(r, sweep["samples"]) for r in differs)


@pytest.mark.parametrize("op", SUBSET)
def test_implicit_replication_results_are_unchanged_by_the_patch(sweep: Dict[str, Any], op: str) -> None:
    """Under implicit_replication() torch computes mixed calls itself: the patch must not change a result."""
    checks = [r for r in sweep["diffs"] if r["op"] == op and r["ctx"] == "implicit_replication"]
    differs = [r for r in checks if r["cls"] == "differs" and r["unpatched"] == "returned"]
    assert not differs, f"{op}: {len(differs)} of {len(checks)} call(s) differ patched:\n" + "\n".join(
        _describe_diff(r, sweep["samples"]) for r in differs)


def test_implicit_replication_errors_are_unchanged_by_the_patch(sweep: Dict[str, Any]) -> None:
    """Where torch raises under implicit_replication(), the patch must not act either: the same exception."""
    differs = [r for r in sweep["diffs"] if r["ctx"] == "implicit_replication" and r["cls"] == "differs"
               and r["unpatched"] != "returned"]
    assert not differs, f"{len(differs)} call(s) differ patched:\n" + "\n".join(
        _describe_diff(r, sweep["samples"]) for r in differs)

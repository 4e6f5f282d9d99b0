"""CI subset of the OpInfo sweep (``tools/op_sweep.py``): representative ops that mix plain tensors and DTensors.

For each op, up to 3 OpInfo samples with two or more tensor operands; each tensor operand in turn is
made the one DTensor (``Replicate()`` and ``Shard(d)``) on 2 gloo ranks, the rest stay plain, and
``op.op`` / ``op.inplace_variant`` run under ``keras_dtensor_mixfix.patched()``. Every case must
be correct or a clear error: no wrong values and no unclear exception.

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
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import op_sweep  # noqa: E402

SUBSET = [
    "add", "mul", "sub", "div.no_rounding_mode", "where", "addcmul", "lerp", "maximum",
    "matmul", "mm", "bmm", "cat", "stack", "index_select", "gather", "masked_fill",
    "nn.functional.embedding", "nn.functional.linear", "nn.functional.cross_entropy", "nn.functional.mse_loss",
    "clamp",  # tensor min/max bounds
    "pow", "atan2", "logaddexp", "einsum",
]
MAX_SAMPLES = 3

# (op, variant, sample index, DTensor operand, placement) -> why it is expected to be wrong/crash.
# Empty: every wrong/crash case in the subset is fixed. Add an entry (with the reason) only for a
# bug that cannot be fixed at once; it is then excluded from the checks above.
KNOWN_BUGS: Dict[Tuple[str, str, int, str, str], str] = {}

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
    records = op_sweep.run_sweep(names, MAX_SAMPLES, chunk_size=len(names), log=lambda message: None)
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

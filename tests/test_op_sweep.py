"""CI subset of the OpInfo sweep (``tools/op_sweep.py``): representative ops that mix plain tensors and DTensors.

For each op, up to 3 OpInfo samples with two or more tensor operands; each tensor operand in turn is
made the one DTensor (``Replicate()`` and ``Shard(d)``) on 2 gloo ranks, the rest stay plain, and
``op.op`` / ``op.inplace_variant`` run under ``keras_dtensor_mixfix.patched()``. Every case must
be correct or a clear error: no wrong values and no unclear exception. The whole subset runs in
one ``run_on_ranks`` call. ``python tools/op_sweep.py`` sweeps every OpInfo and writes OP_SWEEP.md.
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

_INPLACE_SCALAR_SELF = (
    "core bug: plain 0-d tensor .{}_(0-d Replicate DTensor) raises a bare AssertionError in torch's DTensor dispatch "
    "(_dispatch.py: in-place self must be a DTensor); the patch leaves one-element plain operands to torch even "
    "when the op writes into them (with both operands DTensors the call is correct)"
)

# (op, variant, sample index, DTensor operand, placement) -> why it is expected to be wrong/crash.
# Each entry is an xfail(strict=True) test below: once the core is fixed it XPASSes and fails,
# which is the signal to delete the entry.
KNOWN_BUGS: Dict[Tuple[str, str, int, str, str], str] = {
    ("add", "inplace", 0, "args[0]", "R"): _INPLACE_SCALAR_SELF.format("add"),
    ("mul", "inplace", 0, "args[0]", "R"): _INPLACE_SCALAR_SELF.format("mul"),
    ("sub", "inplace", 0, "args[0]", "R"): _INPLACE_SCALAR_SELF.format("sub"),
    ("div.no_rounding_mode", "inplace", 0, "args[0]", "R"): _INPLACE_SCALAR_SELF.format("div"),
    ("lerp", "inplace", 2, "args[0]", "R"): _INPLACE_SCALAR_SELF.format("lerp"),
    ("pow", "inplace", 0, "args[0]", "R"): _INPLACE_SCALAR_SELF.format("pow"),
    ("atan2", "inplace", 0, "args[0]", "R"): _INPLACE_SCALAR_SELF.format("atan2"),
}


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
    return {"records": records, "cases": cases, "samples": samples}


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


@pytest.mark.parametrize("case", [
    pytest.param(case, id="/".join(map(str, case)), marks=pytest.mark.xfail(strict=True, reason=reason))
    for case, reason in KNOWN_BUGS.items()
])
def test_known_bug(sweep: Dict[str, Any], case: Tuple[str, str, int, str, str]) -> None:
    found = [r for r in sweep["cases"] if _key(r) == case]
    assert found, f"case {case} was not swept (OpInfo samples changed?): update KNOWN_BUGS"
    assert found[0]["cls"] == "correct", _describe(found[0], sweep["samples"])

"""Classes of a mixed case (correct / clear_error / wrong / crash), who a fault is down to, totals."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Sequence, Tuple

from .common import short


CLASSES = ("correct", "clear_error", "wrong", "crash")


# RuntimeError / NotImplementedError messages from DTensor that name the problem.
CLEAR_PATTERNS = re.compile(
    r"sharding strateg|sharding propagation|does not have a sharding|not supported|unsupported|"
    r"not implemented|NotImplemented|does not support|is not supported|cannot be sharded|"
    r"got mixed torch\.Tensor and DTensor",
    re.IGNORECASE,
)


def classify_exception(exc: BaseException) -> Tuple[str, str]:
    """(class, short message) for an exception raised by the mixed call under the patch."""
    from keras_dtensor_mixfix import MixedOperandError

    name = type(exc).__name__
    text = str(exc)
    if isinstance(exc, MixedOperandError):
        match = re.search(r"the op itself failed: (\w+): (.*)", text)
        reason = f"[op failed: {match.group(1)}] {match.group(2)}" if match else text.splitlines()[0] if text else ""
        return "clear_error", short(f"{name}: {reason}")
    if type(exc) in (RuntimeError, NotImplementedError) and CLEAR_PATTERNS.search(text):
        return "clear_error", short(f"{name}: {text}")
    return "crash", short(f"{name}: {text}")


def summarize(records: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    cases = [r for r in records if r["t"] == "case"]
    samples = {(r["op"], r["kind"], r["s"]): r for r in records if r["t"] == "sample" and r["status"] == "swept"}
    counts = {c: sum(r["cls"] == c for r in cases) for c in CLASSES}
    supported_cases = [r for r in cases if samples.get((r["op"], r["kind"], r["s"]), {}).get("dtensor") == "supported"]
    by_op: Dict[str, List[Dict[str, Any]]] = {}
    for r in cases:
        by_op.setdefault(r["op"], []).append(r)
    supported_ops = sorted({op for (op, _, _), s in samples.items() if s.get("dtensor") == "supported"})
    correct_supported_ops = [op for op in supported_ops
                             if all(r["cls"] == "correct" for r in by_op.get(op, [])
                                    if samples.get((r["op"], r["kind"], r["s"]), {}).get("dtensor") == "supported")]
    return {
        "cases": len(cases),
        "counts": counts,
        "ops_swept": sorted(by_op),
        "supported_cases": len(supported_cases),
        "supported_cases_correct": sum(r["cls"] == "correct" for r in supported_cases),
        "supported_ops": supported_ops,
        "supported_ops_correct": correct_supported_ops,
        "ops_all_correct": sorted(op for op, rs in by_op.items() if all(r["cls"] == "correct" for r in rs)),
        "no_promotion_needed": sorted({r["op"] for r in cases if r.get("unpatched_ok")}),
        "no_promotion_cases": sum(bool(r.get("unpatched_ok")) for r in cases),
    }


def alone_class(record: Dict[str, Any]) -> str:
    """Class of the same case with every operand a DTensor, unpatched ('' when not run: the case was correct)."""
    return record.get("dtensor_alone", "").split(":")[0]


def attribution(record: Dict[str, Any]) -> str:
    """Who a wrong/crash case is down to: torch's own path, DTensor itself, or the patch."""
    alone = alone_class(record)
    unpatched = record.get("unpatched", "")
    if unpatched == "ok":
        return "torch: accepted unpatched (one-element plain operands), the patch does not act"
    if record["cls"] == "crash" and unpatched.split(":")[0] == record["msg"].split(":")[0] \
            and "got mixed torch.Tensor and DTensor" not in unpatched:
        return "torch: same exception unpatched, the patch does not act"
    if alone == record["cls"] or (record["cls"] == "crash" and alone == "wrong"):
        return f"DTensor: also {alone} with all operands DTensors"
    if record["cls"] == "wrong" and alone in ("crash", "clear_error"):
        return "patch: DTensor alone raises, the patched call returns wrong values"
    return f"patch: DTensor alone is {alone or '?'}"

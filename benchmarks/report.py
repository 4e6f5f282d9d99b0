"""The report: the figures as a table, each target's ratio and verdict."""

from __future__ import annotations

import os
import statistics
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
import argparse
import platform

from timing import SHAPE, Rounds

TARGETS = {
    "P1": ("mixed patched / mixed under implicit_replication()", 0.25),
    "P2": ("mixed patched / pure DTensor op (both Shard(0))", 2.0),
    "P3": ("pure DTensor op, patched / unpatched", 1.05),
    "P3b": ("pure in-place DTensor op (copy_), patched / unpatched", 1.05),
    "P4": ("plain-tensor op, patched / unpatched", 1.02),
}


def _fmt(value: float) -> str:
    return f"{value:.3g}" if value < 10 else f"{value:.1f}"


def _verdict(ratio: float, target: float) -> str:
    return "PASS" if ratio <= target else "MISS"


def report(per: Rounds, extra: Dict[str, Any], others: List[Rounds], compiled: Dict[str, Any],
           imports: Optional[Rounds], args: argparse.Namespace, per2: Optional[Rounds] = None,
           keras: Optional[Rounds] = None) -> Dict[str, Any]:
    lines: List[str] = []
    out: Dict[str, Any] = {"cases": {}, "targets": {}}
    lines.append(f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} cores, "
                 f"{SHAPE[0]}x{SHAPE[1]} float32; per-op cases on world size 1 (in process) and 2 (gloo, 127.0.0.1)")
    try:
        lines.append(f"load average before the run: {args.load_before}")
    except AttributeError:
        pass
    lines.append(f"command: {' '.join(['python'] + sys.argv)}")
    lines.append("")
    lines.append("| case | min | median | rounds |")
    lines.append("|---|---|---|---|")
    tables = [("", per)] + ([("2 ranks: ", per2)] if per2 is not None else [])
    tables += [("", data) for data in others]
    tables += [("", data) for data in (keras, imports) if data is not None]
    for prefix, data in tables:
        for name in data.samples:
            s = data.stat(name)
            out["cases"][prefix + name] = s
            unit = "" if ("ms" in name or "us/" in name) else " us"
            lines.append(f"| {prefix}{name}{unit} | {_fmt(s['min'])} | {_fmt(s['median'])} | {s['n']} |")
    for backend, res in compiled.items():
        s = res["steady_us"]
        out["cases"][f"compile {backend}"] = res
        first = f", first call {res['first_call_s']:.2f} s" if "first_call_s" in res else ""
        lines.append(f"| compiled f: {backend}{first}: steady us/call | {_fmt(s['min'])} | {_fmt(s['median'])} "
                     f"| {s['n']} |")
    lines.append("")

    def ratio(data: Rounds, num: str, den: str) -> Tuple[float, float, float]:
        a, b = data.stat(num), data.stat(den)
        # Per-round ratios pair figures taken seconds apart, so load that drifts over the run cancels.
        paired = statistics.median(x / y for x, y in zip(data.samples[num], data.samples[den]))
        return a["min"] / b["min"], a["median"] / b["median"], paired

    def target_rows(data: Rounds, suffix: str) -> None:
        rows = {
            "P1": ratio(data, "mixed patched", "mixed implicit_replication"),
            "P2": ratio(data, "mixed patched", "pure patched"),
            "P3": ratio(data, "pure patched", "pure unpatched"),
            "P3b": ratio(data, "pure in-place patched", "pure in-place unpatched"),
            "P4": ratio(data, "plain patched", "plain unpatched"),
        }
        for key, (lo, mid, paired) in rows.items():
            text, target = TARGETS[key]
            verdict = _verdict(paired, target)
            if verdict == "PASS" and lo > target:
                verdict += " (ratio of minima misses)"
            out["targets"][key + suffix] = {"what": text, "ratio_min": lo, "ratio_median": mid,
                                            "paired_median": paired, "target": target, "verdict": verdict}
            lines.append(f"| {key}{suffix} {text} | {paired:.3f} | {lo:.3f} | {mid:.3f} | <= {target} | {verdict} |")

    lines.append("| target | median of per-round ratios | ratio of minima | ratio of medians | target | verdict |")
    lines.append("|---|---|---|---|---|---|")
    target_rows(per, "")
    if per2 is not None:
        target_rows(per2, " (2 ranks)")
    p = per.stat("patch() ms")
    if imports is not None:
        first = imports.stat(next(n for n in imports.samples if n.startswith("first patch()")))
        lines.append(f"| P5a first patch() in a fresh process (package import included) | | {first['min']:.1f} ms | "
                     f"{first['median']:.1f} ms | <= 100 ms | {_verdict(first['median'], 100)} |")
        out["targets"]["P5a"] = {"first_patch_ms": first}
    lines.append(f"| P5a' patch() again after unpatch() (in this process; its first patch() "
                 f"{extra['first_patch_ms']:.0f} ms) | | {p['min']:.1f} ms | {p['median']:.1f} ms | <= 100 ms | "
                 f"{_verdict(p['median'], 100)} |")
    out["targets"]["P5a'"] = {"patch_ms": p, "first_patch_ms_in_process": extra["first_patch_ms"]}
    if imports is not None:
        act = imports.stat(next(n for n in imports.samples if n.startswith("activate()")))
        on = imports.stat("import torch, auto-activation on ms")
        off = imports.stat("import torch, TORCH_DEVICE_BACKEND_AUTOLOAD=0 ms")
        lines.append(f"| P5b time added to import torch: activate() measured directly | | {act['min']:.1f} ms | "
                     f"{act['median']:.1f} ms | <= 20 ms | {_verdict(act['median'], 20)} |")
        lines.append(f"| P5b cross-check (information: import torch varies by tens of ms run to run): "
                     f"import torch, auto-activation on - TORCH_DEVICE_BACKEND_AUTOLOAD=0 | | "
                     f"{on['min'] - off['min']:.1f} ms | {on['median'] - off['median']:.1f} ms | | |")
        out["targets"]["P5b"] = {"activate_ms": act, "import_on_ms": on, "import_autoload_off_ms": off}
    if keras is not None:
        names = list(keras.samples)
        lo, mid, paired = ratio(keras, names[0], names[1])
        verdict = _verdict(paired, 1.10)
        if verdict == "PASS" and lo > 1.10:
            verdict += " (ratio of minima misses)"
        out["targets"]["P6"] = {"ratio_min": lo, "ratio_median": mid, "paired_median": paired, "target": 1.10,
                                "verdict": verdict}
        lines.append(f"| P6 Keras ModelParallel train step (2 ranks), plain batches / DTensor batches by hand | "
                     f"{paired:.3f} | {lo:.3f} | {mid:.3f} | <= 1.1 | {verdict} |")
    text = "\n".join(lines)
    print(text)
    out["text"] = text
    return out

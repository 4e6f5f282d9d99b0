"""Constants and text helpers shared by the sweep's modules (worker and parent side)."""

from __future__ import annotations

from typing import Any


DEFAULT_MAX_SAMPLES = 3
SCAN_LIMIT = 40          # sample_inputs entries looked at per op to find max_samples usable ones
MAX_POSITIONS = 4        # tensor operands (per sample) that take a turn as the DTensor
DEFAULT_RTOL = 1.3e-6
DEFAULT_ATOL = 1e-5
MSG_LEN = 200


def short(text: Any, limit: int = MSG_LEN) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def dtype_tag(dtype: Any) -> str:
    return str(dtype).replace("torch.", "").replace("float", "f").replace("int", "i")


def describe_value(value: Any, limit: int = 400) -> str:
    """``T[3,4]f32`` for tensors, repr for the rest, recursively; for reports and repros."""
    import torch
    from torch.distributed.tensor import DTensor

    def fmt(v: Any) -> str:
        if isinstance(v, DTensor):
            return f"DT[{','.join(map(str, v.shape))}]{dtype_tag(v.dtype)}{tuple(map(str, v.placements))}"
        if isinstance(v, torch.Tensor):
            return f"T[{','.join(map(str, v.shape))}]{dtype_tag(v.dtype)}"
        if isinstance(v, torch.Size):
            return f"Size({list(v)})"
        if isinstance(v, (list, tuple)):
            inner = ", ".join(fmt(x) for x in v)
            return f"[{inner}]" if isinstance(v, list) else f"({inner}{',' if len(v) == 1 else ''})"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}={fmt(x)}" for k, x in v.items()) + "}"
        return short(repr(v), 60)

    return short(fmt(value), limit)


def describe_sample(sample: Any) -> str:
    kwargs = ", ".join(f"{k}={describe_value(v, 80)}" for k, v in sample.kwargs.items())
    args = ", ".join(describe_value(a, 80) for a in sample.args)
    parts = [describe_value(sample.input, 120)] + ([args] if args else []) + ([kwargs] if kwargs else [])
    return short(", ".join(parts), 400)

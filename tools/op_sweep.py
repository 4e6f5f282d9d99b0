#!/usr/bin/env python
"""Sweep torch's OpInfo database for ops that mix a DTensor with plain tensors.

    python tools/op_sweep.py [--ops NAME ...] [--max-samples N] [--report OP_SWEEP.md]

For every OpInfo (``torch.testing._internal.common_methods_invocations.op_db``) and up to
``--max-samples`` of its ``sample_inputs("cpu", torch.float32)`` with two or more tensor operands
(float32 / int64 / bool, none empty), every case makes ONE tensor operand a DTensor on a 2-rank
gloo mesh (``Replicate()``, and ``Shard(d)`` on the first dim whose size is divisible by 2), leaves
the other operands plain and runs ``op.op`` (and ``op.inplace_variant`` where there is one) under
``keras_dtensor_mixfix.patched()``. The result (outputs, and every operand after the call, so
in-place writes are checked) is compared with the all-plain computation. Each case is

* ``correct``     - same values (``assert_close``, OpInfo float32 tolerance or rtol=1.3e-6/atol=1e-5,
                    ``equal_nan=True``), same on both ranks;
* ``clear_error`` - ``MixedOperandError``, or a RuntimeError/NotImplementedError from DTensor that
                    says the op has no sharding strategy / is unsupported;
* ``wrong``       - no error but values (or structure, or the two ranks) differ;
* ``crash``       - any other exception, a worker that died or hung.

Per sample it also records whether DTensor itself supports the op (every tensor operand a
``Replicate`` DTensor, no patch) and whether torch accepted the mixed call unpatched (no promotion
needed); every case that is not correct is rerun unpatched with the other operands made Replicate
DTensors by hand ("DTensor alone"), which tells torch's faults from the patch's.

Samples come from rank 0 (broadcast: some ``sample_inputs`` iterate sets, whose order differs between
processes). Random ops are skipped by name and by what they dispatch (ops tagged
``nondeterministic_seeded``). Each chunk of ops is one ``run_on_ranks`` call; a chunk that fails or
hangs (``--chunk-timeout``) is rerun op by op (``--op-timeout``) so the one op is recorded as a crash.
``--json`` saves the records, ``--from-json`` rewrites the report from them without sweeping again.
The functions are importable (``tests/test_op_sweep.py`` runs a CI subset with them).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import math
import os
import re
import sys
import time
import traceback
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

DEFAULT_MAX_SAMPLES = 3
SCAN_LIMIT = 40          # sample_inputs entries looked at per op to find max_samples usable ones
MAX_POSITIONS = 4        # tensor operands (per sample) that take a turn as the DTensor
DEFAULT_RTOL = 1.3e-6
DEFAULT_ATOL = 1e-5
MSG_LEN = 200

CLASSES = ("correct", "clear_error", "wrong", "crash")

# Ops whose name says they draw random numbers. The words are the ones the sweep's issue lists;
# the names below contain such a word but are deterministic, so they are swept.
RANDOM_WORDS = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial")
NOT_RANDOM = frozenset({
    "__rand__",                  # reflected bitwise and
    "nn.functional.normalize",   # x / norm(x)
    "masked.normalize",
    "native_dropout_backward",   # grad * mask * scale: the mask is an input
})

# RuntimeError / NotImplementedError messages from DTensor that name the problem.
CLEAR_PATTERNS = re.compile(
    r"sharding strateg|sharding propagation|does not have a sharding|not supported|unsupported|"
    r"not implemented|NotImplemented|does not support|is not supported|cannot be sharded|"
    r"got mixed torch\.Tensor and DTensor",
    re.IGNORECASE,
)


# ============================================================================ OpInfo access


_OPS: Optional[Dict[str, Any]] = None


def op_infos() -> Dict[str, Any]:
    """``{full name: OpInfo}`` for every entry of torch's ``op_db`` (name, or name.variant)."""
    global _OPS
    if _OPS is None:
        from torch.testing._internal.common_methods_invocations import op_db

        _OPS = {}
        for info in op_db:
            _OPS.setdefault(full_name(info), info)
    return _OPS


def full_name(info: Any) -> str:
    return info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")


def is_random_name(name: str) -> bool:
    base = name.split(".")[0] if name.startswith("__") else name
    if name in NOT_RANDOM or base in NOT_RANDOM:
        return False
    return any(word in name for word in RANDOM_WORDS)


def select_ops(names: Optional[Sequence[str]] = None) -> Tuple[List[str], List[str]]:
    """(ops to sweep, ops skipped as random). ``names`` match a full name or an OpInfo name."""
    infos = op_infos()
    if names:
        chosen = []
        for wanted in names:
            found = [wanted] if wanted in infos else [key for key, info in infos.items() if info.name == wanted]
            if not found:
                raise SystemExit(f"no OpInfo named {wanted!r}")
            chosen.extend(k for k in found if k not in chosen)
    else:
        chosen = list(infos)
    random_ops = [n for n in chosen if is_random_name(n)]
    return [n for n in chosen if n not in random_ops], random_ops


def opinfo_tolerance(info: Any, dtype: Any) -> Tuple[float, float]:
    """(rtol, atol): the largest float32 toleranceOverride any of the OpInfo's tests uses, or the defaults."""
    rtol, atol = DEFAULT_RTOL, DEFAULT_ATOL
    try:
        from torch.testing._internal.common_device_type import toleranceOverride
        from torch.testing._internal.opinfo.core import DecorateInfo

        for item in getattr(info, "decorators", ()) or ():
            decorators = item.decorators if isinstance(item, DecorateInfo) else [item]
            for decorator in decorators:
                if isinstance(decorator, toleranceOverride) and dtype in decorator.d:
                    tol = decorator.d[dtype]
                    rtol, atol = max(rtol, tol.rtol), max(atol, tol.atol)
    except Exception:  # metadata layout changed: keep the defaults
        pass
    return rtol, atol


# ============================================================================ worker side helpers


def _short(text: Any, limit: int = MSG_LEN) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _dtype_tag(dtype: Any) -> str:
    return str(dtype).replace("torch.", "").replace("float", "f").replace("int", "i")


def describe_value(value: Any, limit: int = 400) -> str:
    """``T[3,4]f32`` for tensors, repr for the rest, recursively; for reports and repros."""
    import torch
    from torch.distributed.tensor import DTensor

    def fmt(v: Any) -> str:
        if isinstance(v, DTensor):
            return f"DT[{','.join(map(str, v.shape))}]{_dtype_tag(v.dtype)}{tuple(map(str, v.placements))}"
        if isinstance(v, torch.Tensor):
            return f"T[{','.join(map(str, v.shape))}]{_dtype_tag(v.dtype)}"
        if isinstance(v, torch.Size):
            return f"Size({list(v)})"
        if isinstance(v, (list, tuple)):
            inner = ", ".join(fmt(x) for x in v)
            return f"[{inner}]" if isinstance(v, list) else f"({inner}{',' if len(v) == 1 else ''})"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}={fmt(x)}" for k, x in v.items()) + "}"
        return _short(repr(v), 60)

    return _short(fmt(value), limit)


def describe_sample(sample: Any) -> str:
    kwargs = ", ".join(f"{k}={describe_value(v, 80)}" for k, v in sample.kwargs.items())
    args = ", ".join(describe_value(a, 80) for a in sample.args)
    parts = [describe_value(sample.input, 120)] + ([args] if args else []) + ([kwargs] if kwargs else [])
    return _short(", ".join(parts), 400)


def _flatten(sample: Any) -> Tuple[List[Any], List[str], Any]:
    """Leaves of (input, args, kwargs), a label per leaf ('input', 'args[1]', "kwargs['weight']"), spec."""
    import torch.utils._pytree as pytree

    with_path, spec = pytree.tree_flatten_with_path((sample.input, tuple(sample.args), dict(sample.kwargs)))
    leaves, labels = [], []
    for path, leaf in with_path:
        head = ("input", "args", "kwargs")[path[0].idx]
        labels.append(head + pytree.keystr(path[1:]))
        leaves.append(leaf)
    return leaves, labels, spec


def _call(fn: Any, leaves: Sequence[Any], spec: Any) -> Any:
    import torch.utils._pytree as pytree

    inp, args, kwargs = pytree.tree_unflatten(list(leaves), spec)
    return fn(inp, *args, **kwargs)


def _clone_leaves(leaves: Sequence[Any]) -> List[Any]:
    import torch

    return [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]


def _to_full(value: Any) -> Any:
    """Outputs/operands with every DTensor replaced by its full tensor (a collective: same order on all ranks)."""
    import torch
    import torch.utils._pytree as pytree
    from torch.distributed.tensor import DTensor

    def one(v: Any) -> Any:
        if isinstance(v, DTensor):
            return v.full_tensor().detach()
        if isinstance(v, torch.Tensor):
            return v.detach()
        return v

    leaves, spec = pytree.tree_flatten(value)
    return pytree.tree_unflatten([one(v) for v in leaves], spec)


def _compare(actual: Any, expected: Any, rtol: float, atol: float, what: str) -> Optional[str]:
    """None when equal (structure, types, values); otherwise a short description of the difference."""
    import torch
    import torch.utils._pytree as pytree

    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    if len(a_leaves) != len(e_leaves) or str(a_spec) != str(e_spec):
        return f"{what}: structure differs: got {describe_value(actual, 80)}, expected {describe_value(expected, 80)}"
    for index, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        where = what if len(a_leaves) == 1 else f"{what}[{index}]"
        if isinstance(e, torch.Tensor) != isinstance(a, torch.Tensor):
            return f"{where}: got {type(a).__name__}, expected {type(e).__name__}"
        if isinstance(e, torch.Tensor):
            try:
                torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True, check_device=False)
            except AssertionError as exc:
                return f"{where}: " + _short(str(exc).replace("\n", " "), MSG_LEN)
        elif isinstance(e, float) and isinstance(a, float):
            if not (a == e or (math.isnan(a) and math.isnan(e)) or math.isclose(a, e, rel_tol=rtol, abs_tol=atol)):
                return f"{where}: got {a!r}, expected {e!r}"
        elif a != e:
            return f"{where}: got {_short(repr(a), 60)}, expected {_short(repr(e), 60)}"
    return None


def _digest(value: Any) -> str:
    import torch
    import torch.utils._pytree as pytree

    h = hashlib.sha1()
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach()
            h.update(f"{tuple(t.shape)}{t.dtype}".encode())
            try:
                h.update(t.cpu().contiguous().numpy().tobytes())
            except Exception:  # a dtype numpy lacks: fall back to the printed values
                h.update(repr(t.tolist()).encode())
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()[:16]


class _SeededOpFinder:
    """Records the ops tagged ``nondeterministic_seeded`` (random) that a call dispatches."""

    def __init__(self) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        found: List[str] = []
        self.found = found

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if torch.Tag.nondeterministic_seeded in func.tags:
                    found.append(str(func))
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self) -> "_SeededOpFinder":
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)


def classify_exception(exc: BaseException) -> Tuple[str, str]:
    """(class, short message) for an exception raised by the mixed call under the patch."""
    from keras_dtensor_mixfix import MixedOperandError

    name = type(exc).__name__
    text = str(exc)
    if isinstance(exc, MixedOperandError):
        match = re.search(r"the op itself failed: (\w+): (.*)", text)
        reason = f"[op failed: {match.group(1)}] {match.group(2)}" if match else text.splitlines()[0] if text else ""
        return "clear_error", _short(f"{name}: {reason}")
    if type(exc) in (RuntimeError, NotImplementedError) and CLEAR_PATTERNS.search(text):
        return "clear_error", _short(f"{name}: {text}")
    return "crash", _short(f"{name}: {text}")


def _mark_leaf(leaves: List[Any], index: int, placement: Any, device_mesh: Any) -> List[Any]:
    from torch.distributed.tensor import distribute_tensor

    out = _clone_leaves(leaves)
    # Every rank holds the same full tensor (same seed), so no communication is needed.
    out[index] = distribute_tensor(out[index], device_mesh, [placement], src_data_rank=None)
    return out


def _all_replicate(leaves: List[Any], device_mesh: Any) -> List[Any]:
    import torch
    from torch.distributed.tensor import Replicate, distribute_tensor

    return [distribute_tensor(v.clone(), device_mesh, [Replicate()], src_data_rank=None)
            if isinstance(v, torch.Tensor) else v for v in leaves]


def _sample_dtype(info: Any) -> Any:
    import torch

    for dtype in (torch.float32, torch.int64, torch.bool):
        if info.supports_dtype(dtype, "cpu"):
            return dtype
    return torch.float32


def _seed_for(name: str) -> int:
    return int(hashlib.sha1(name.encode()).hexdigest()[:8], 16)


def _usable(leaves: Sequence[Any]) -> Tuple[bool, str, List[int]]:
    import torch

    tensors = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    for i in tensors:
        t = leaves[i]
        if t.dtype not in (torch.float32, torch.int64, torch.bool):
            return False, f"tensor of dtype {t.dtype}", tensors
        if t.numel() == 0:
            return False, "empty tensor", tensors
        if t.layout != torch.strided:
            return False, f"layout {t.layout}", tensors
    if len(tensors) < 2:
        return False, "fewer than two tensor operands", tensors
    return True, "", tensors


def _pick_positions(tensors: List[int]) -> List[int]:
    if len(tensors) <= MAX_POSITIONS:
        return tensors
    step = (len(tensors) - 1) / (MAX_POSITIONS - 1)
    return sorted({tensors[round(k * step)] for k in range(MAX_POSITIONS)})


def _placements_for(tensor: Any) -> List[Any]:
    from torch.distributed.tensor import Replicate, Shard

    found = [Replicate()]
    for dim, size in enumerate(tensor.shape):
        if size >= 2 and size % 2 == 0:
            found.append(Shard(dim))
            break
    return found


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
        problem = _compare(values[r], values[0], rtol, atol, f"rank {r} vs rank 0")
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
        out = _call(item["fn"], run_leaves, item["spec"])
    except Exception as exc:
        cls, msg = classify_exception(exc)
        if cls == "crash":
            frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.basename(f.filename) != "op_sweep.py"]
            if frames:
                msg = _short(f"{msg} @ {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}")
    else:
        try:
            got = (_to_full(out), _to_full(run_leaves))
            problem = (_compare(got[0], item["ref_out"], rtol, atol, "output")
                       or _compare(got[1], item["ref_leaves"], rtol, atol, "operands after the call"))
            cls, msg = ("wrong", problem) if problem else ("correct", "")
        except Exception as exc:
            cls, msg, got = "crash", _short(f"while reading the result: {type(exc).__name__}: {exc}"), None
    digest = _digest(got) if got is not None else cls
    disagreement = _gather_check(device_mesh, key, f"{cls}:{digest}", got if got is not None else cls, rtol, atol)
    if disagreement and cls == "correct":
        cls, msg = "wrong", f"ranks disagree: {disagreement}"
    elif disagreement and cls == "wrong":
        msg = f"{msg} (and the ranks disagree)"
    return cls, _short(msg)


def sweep_ops(op_names: Sequence[str], max_samples: int = DEFAULT_MAX_SAMPLES) -> List[Dict[str, Any]]:
    """Run inside every rank (identical work): the records of the cases of ``op_names``.

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
            return _sweep_ops(op_names, max_samples, device_mesh, infos)
    finally:
        noisy.setLevel(level)
        if was_patched and not mf.is_patched():
            mf.patch()


def _pick_samples(info: Any, dtype: Any, max_samples: int) -> Tuple[List[Any], Dict[str, int], str]:
    """(usable samples as (index, description, leaves, labels, spec, tensor positions), skip counts, error)."""
    import pickle

    picked: List[Any] = []
    skipped: Dict[str, int] = {}
    try:
        for index, sample in enumerate(info.sample_inputs("cpu", dtype)):
            if index >= SCAN_LIMIT or len(picked) >= max_samples:
                break
            leaves, labels, spec = _flatten(sample)
            ok, why, tensors = _usable(leaves)
            if not ok:
                skipped[why] = skipped.get(why, 0) + 1
                continue
            try:
                pickle.dumps((leaves, spec))
            except Exception as exc:
                why = f"sample not picklable ({type(exc).__name__})"
                skipped[why] = skipped.get(why, 0) + 1
                continue
            picked.append((index, describe_sample(sample), leaves, labels, spec, tensors))
    except Exception as exc:
        return [], {}, _short(f"sample_inputs raised {type(exc).__name__}: {exc}")
    return picked, skipped, ""


def _sweep_ops(op_names: Sequence[str], max_samples: int, device_mesh: Any, infos: Dict[str, Any]) -> List[Dict[str, Any]]:
    import torch
    import torch.distributed as dist
    import keras_dtensor_mixfix as mf

    records: List[Dict[str, Any]] = []
    pending: List[Dict[str, Any]] = []   # cases to run patched (phase B)

    # ---------------------------------------------------------------- phase A: no patch
    for name in op_names:
        info = infos[name]
        dtype = _sample_dtype(info)
        rtol, atol = opinfo_tolerance(info, dtype)
        torch.manual_seed(_seed_for(name))
        kinds = [("op", info.op)] + ([("inplace", info.inplace_variant)] if info.inplace_variant is not None else [])
        swept, skipped = 0, {}
        payload = _pick_samples(info, dtype, max_samples) if dist.get_rank() == 0 else None
        # Rank 0's samples for every rank: some sample_inputs iterate sets (order varies with the
        # per-process hash seed), and every rank must run exactly the same inputs.
        box = [payload]
        dist.broadcast_object_list(box, src=0, group=device_mesh.get_group())
        picked, skipped, error = box[0]
        if error:
            records.append({"t": "op", "op": name, "status": "skipped", "reason": error})
            continue
        for index, desc, leaves, labels, spec, tensors in picked:
            for kind, fn in kinds:
                base = {"op": name, "kind": kind, "s": index}
                # reference: all plain (twice, to detect random ops the name did not give away)
                try:
                    ref_leaves = _clone_leaves(leaves)
                    with _SeededOpFinder() as seeded:
                        ref_out = _call(fn, ref_leaves, spec)
                    again_leaves = _clone_leaves(leaves)
                    again = _call(fn, again_leaves, spec)
                except Exception as exc:
                    records.append({"t": "sample", **base, "desc": desc, "status": "skipped",
                                    "reason": _short(f"plain reference raised {type(exc).__name__}: {exc}")})
                    continue
                ref_out, ref_leaves = _to_full(ref_out), _to_full(ref_leaves)
                if seeded.found:
                    records.append({"t": "sample", **base, "desc": desc, "status": "skipped",
                                    "reason": _short(f"random: dispatches {sorted(set(seeded.found))[0]}")})
                    continue
                if _compare(_to_full(again), ref_out, rtol, atol, "out") or _compare(_to_full(again_leaves), ref_leaves, rtol, atol, "args"):
                    records.append({"t": "sample", **base, "desc": desc, "status": "skipped",
                                    "reason": "nondeterministic: two plain runs differ (random op)"})
                    continue
                # does DTensor itself support it? every tensor operand Replicate, no patch
                try:
                    dt_leaves = _all_replicate(leaves, device_mesh)
                    dt_out = _call(fn, dt_leaves, spec)
                    dt_full, dt_leaves_full = _to_full(dt_out), _to_full(dt_leaves)
                    diff = _compare(dt_full, ref_out, rtol, atol, "out") or _compare(dt_leaves_full, ref_leaves, rtol, atol, "args")
                    support, support_msg = "supported", ("values differ from plain: " + diff) if diff else ""
                except Exception as exc:
                    support, support_msg = "unsupported", _short(f"{type(exc).__name__}: {exc}")
                records.append({"t": "sample", **base, "desc": desc, "status": "swept", "dtensor": support,
                                "dtensor_msg": _short(support_msg)})
                swept += 1
                for position in _pick_positions(tensors):
                    for placement in _placements_for(leaves[position]):
                        case = {"t": "case", **base, "pos": labels[position], "placement": str(placement),
                                "shape": list(leaves[position].shape), "rtol": rtol, "atol": atol}
                        # did torch accept the mixed call without the patch?
                        try:
                            _call(fn, _mark_leaf(leaves, position, placement, device_mesh), spec)
                            case["unpatched_ok"], case["unpatched"] = True, "ok"
                        except Exception as exc:
                            case["unpatched_ok"], case["unpatched"] = False, _short(f"{type(exc).__name__}: {exc}", 120)
                        pending.append({"case": case, "fn": fn, "leaves": leaves, "spec": spec, "index": position,
                                        "placement": placement, "ref_out": ref_out, "ref_leaves": ref_leaves})
        status = "swept" if swept else "skipped"
        reason = "" if swept else ("no usable sample (" + ", ".join(f"{k}: {v}" for k, v in sorted(skipped.items())) + ")"
                                   if skipped else "no usable sample")
        if not swept and picked:
            reason = "plain reference raised or was random for every usable sample"
        records.append({"t": "op", "op": name, "status": status, "reason": reason, "dtype": str(dtype)})

    # ---------------------------------------------------------------- phase B: patched
    with mf.patched():
        for item in pending:
            case = item["case"]
            run_leaves = lambda item=item: _mark_leaf(item["leaves"], item["index"], item["placement"], device_mesh)
            cls, msg = _run_case(item, run_leaves, device_mesh, "patched")
            case["cls"], case["msg"] = cls, msg
    # ---------------------------------------------------------------- phase C: DTensor alone
    # For each case that is not correct: the same call with every other operand a Replicate
    # DTensor (what "replicate" promotion amounts to), unpatched. Tells torch's bugs and limits
    # from the patch's.
    for item in pending:
        case = item["case"]
        if case["cls"] != "correct":
            def all_dtensor(item: Dict[str, Any] = item) -> List[Any]:
                marked = _mark_leaf(item["leaves"], item["index"], item["placement"], device_mesh)
                replicated = _all_replicate(item["leaves"], device_mesh)
                return [m if i == item["index"] else r for i, (m, r) in enumerate(zip(marked, replicated))]
            cls, msg = _run_case(item, all_dtensor, device_mesh, "alone")
            case["dtensor_alone"] = _short(f"{cls}: {msg}" if msg else cls, 160)
        del case["rtol"], case["atol"]
        records.append(case)
    return records


# ============================================================================ parent side


def _merge(per_rank: List[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """Rank 0's records; a case whose class differs on another rank becomes 'wrong'."""
    main = per_rank[0]
    for other_rank, other in enumerate(per_rank[1:], start=1):
        if len(other) != len(main):
            for record in main:
                if record["t"] == "case" and record["cls"] == "correct":
                    record["cls"], record["msg"] = "wrong", f"rank {other_rank} returned {len(other)} records, rank 0 {len(main)}"
            continue
        for mine, theirs in zip(main, other):
            if mine["t"] == "case" and theirs.get("cls") != mine["cls"]:
                mine["msg"] = _short(f"ranks disagree: rank 0 {mine['cls']} ({mine['msg']}); rank {other_rank} "
                                     f"{theirs.get('cls')} ({theirs.get('msg')})")
                mine["cls"] = "wrong"
    return main


def run_sweep(op_names: Sequence[str], max_samples: int = DEFAULT_MAX_SAMPLES, chunk_size: int = 50,
              chunk_timeout: float = 900.0, op_timeout: float = 300.0,
              log: Any = print) -> List[Dict[str, Any]]:
    """Sweep ``op_names`` on 2 ranks, one ``run_on_ranks`` call per chunk; a failed chunk is rerun op by op."""
    from keras_dtensor_mixfix.testing import RankError, run_on_ranks

    records: List[Dict[str, Any]] = []
    chunks = [list(op_names[i: i + chunk_size]) for i in range(0, len(op_names), chunk_size)]
    for number, chunk in enumerate(chunks, start=1):
        started = time.monotonic()
        try:
            got = _merge(run_on_ranks(sweep_ops, chunk, max_samples, world_size=2, timeout=chunk_timeout))
            records.extend(got)
            log(f"chunk {number}/{len(chunks)}: {len(chunk)} ops, {sum(r['t'] == 'case' for r in got)} cases, "
                f"{time.monotonic() - started:.0f}s")
            continue
        except RankError as exc:
            log(f"chunk {number}/{len(chunks)} failed ({exc.exc_type}: {_short(exc.message, 150)}); rerunning op by op")
        for name in chunk:
            try:
                records.extend(_merge(run_on_ranks(sweep_ops, [name], max_samples, world_size=2, timeout=op_timeout)))
            except RankError as exc:
                log(f"  {name}: {exc.exc_type}: {_short(exc.message, 150)}")
                tail = _short(exc.remote_traceback.strip().splitlines()[-1] if exc.remote_traceback.strip() else "", 80)
                records.append({"t": "op", "op": name, "status": "worker_failed"})
                records.append({"t": "case", "op": name, "kind": "op", "s": -1, "pos": "-", "placement": "-", "shape": [],
                                "unpatched_ok": False, "cls": "crash",
                                "msg": _short(f"worker failed on rank {exc.rank}: {exc.exc_type}: {exc.message} {tail}")})
    return records


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


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "n/a"


def _alone_class(record: Dict[str, Any]) -> str:
    """Class of the same case with every operand a DTensor, unpatched ('' when not run: the case was correct)."""
    return record.get("dtensor_alone", "").split(":")[0]


def attribution(record: Dict[str, Any]) -> str:
    """Who a wrong/crash case is down to: torch's own path, DTensor itself, or the patch."""
    alone = _alone_class(record)
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


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def write_report(records: Sequence[Dict[str, Any]], path: str, command: str, random_ops: Sequence[str],
                 max_samples: int, elapsed: float, date: Optional[str] = None, note: str = "") -> Dict[str, Any]:
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
        "`Shard(d)` on the first dim of even size, built by `distribute_tensor` from the same full tensor on both ranks; "
        "the other operands stay plain. `op.op` and, where it exists, `op.inplace_variant` (variant `inplace`).")
    add("- compared with the all-plain run: outputs and every operand after the call (in-place writes), "
        "`assert_close(equal_nan=True)` with the OpInfo's largest float32 tolerance override or rtol=1.3e-6/atol=1e-5; "
        "the two ranks' results are compared with each other too.")
    add("- classes: `correct`; `clear_error` = `MixedOperandError`, or a RuntimeError/NotImplementedError from DTensor "
        "saying the op has no sharding strategy / is unsupported; `wrong` = no error but values, structure or ranks "
        "differ; `crash` = any other exception, or a worker that died or hung.")
    add("- \"DTensor supports\" a sample when the same call with every tensor operand a `Replicate` DTensor runs "
        "unpatched. For every case that is not correct, the same call was also run unpatched with the other operands "
        "made `Replicate` DTensors (\"DTensor alone\"): what the patch's promotion amounts to, without the patch.")
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
        f"{_pct(s['supported_cases_correct'], s['supported_cases'])}**")
    add(f"- **ops DTensor supports (on >= 1 swept sample): {len(s['supported_ops'])}; every case on their supported "
        f"samples correct: {len(s['supported_ops_correct'])} = {_pct(len(s['supported_ops_correct']), len(s['supported_ops']))}**")
    bad = [r for r in cases if r["cls"] in ("wrong", "crash")]
    blame: Dict[str, int] = {}
    for r in bad:
        who = attribution(r).split(":")[0]
        blame[who] = blame.get(who, 0) + 1
    add(f"- wrong or crash: {len(bad)} cases, by where the fault is (see the last column of the tables below): "
        + ", ".join(f"{who} {n}" for who, n in sorted(blame.items())))
    clear = [r for r in cases if r["cls"] == "clear_error"]
    could = [r for r in clear if _alone_class(r) == "correct"]
    add(f"- clear errors: {len(clear)} cases; in {len(could)} of them DTensor alone (other operands Replicate "
        "DTensors, unpatched) gives the right values, so the promotion could have succeeded")
    add(f"- cases torch already accepted unpatched (no promotion needed): {s['no_promotion_cases']}, in "
        f"{len(s['no_promotion_needed'])} ops")
    add("")

    def case_row(r: Dict[str, Any]) -> str:
        desc = samples.get((r["op"], r["kind"], r["s"]), {}).get("desc", "")
        who = attribution(r) if r["cls"] in ("wrong", "crash") else "patch: DTensor alone is correct"
        return (f"| `{r['op']}` | {r['kind']} | {r['s']} | `{_cell(desc)}` | {r['pos']} {r['shape']} | {r['placement']} | "
                f"{_cell(r['msg'])} | {_cell(r.get('unpatched', ''))} | {_cell(r.get('dtensor_alone', ''))} | {who} |")

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
            f"{_cell('; '.join(whos))} |")
    add("")
    header = ("| op | variant | sample | sample operands | DTensor operand [shape] | placement | what happened (patched) | "
              "same call unpatched | DTensor alone (others Replicate DTensors), unpatched | fault |")
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

    add(f"## Clear errors by op: {len(clear)} cases in {len({r['op'] for r in clear})} ops")
    add("")
    add("| op | clear / cases | DTensor supports the sample (all Replicate) | DTensor alone, same placements | first message |")
    add("|---|---|---|---|---|")
    by_op: Dict[str, List[Dict[str, Any]]] = {}
    for r in cases:
        by_op.setdefault(r["op"], []).append(r)
    for op in sorted({r["op"] for r in clear}):
        mine = [r for r in by_op[op] if r["cls"] == "clear_error"]
        support = sorted({samples.get((r["op"], r["kind"], r["s"]), {}).get("dtensor", "?") for r in mine})
        alone: Dict[str, int] = {}
        for r in mine:
            alone[_alone_class(r) or "?"] = alone.get(_alone_class(r) or "?", 0) + 1
        add(f"| `{op}` | {len(mine)}/{len(by_op[op])} | {', '.join(support)} | "
            f"{', '.join(f'{k} {v}' for k, v in sorted(alone.items()))} | {_cell(mine[0]['msg'])} |")
    add("")
    add("## Ops torch accepted unpatched (no promotion needed in at least one case)")
    add("")
    add("Mostly one-element plain operands, which torch itself treats as replicated.")
    add("")
    add(", ".join(f"`{op}`" for op in s["no_promotion_needed"]) or "None.")
    add("")
    unsupported = sorted({op for (op, _, _), r in samples.items() if r.get("dtensor") == "unsupported"} - set(s["supported_ops"]))
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
    add("- swept although the name contains such a word (deterministic): " + ", ".join(f"`{o}`" for o in sorted(NOT_RANDOM)))
    nondet = sorted({r["op"] for r in samples.values() if r.get("reason", "").startswith(("nondeterministic", "random"))})
    add("- samples skipped as random (they dispatch an op tagged `nondeterministic_seeded`, or two plain runs differ): "
        + (", ".join(f"`{o}`" for o in nondet) or "none"))
    ref_failed = sorted({r["op"] for r in samples.values() if r.get("reason", "").startswith("plain reference raised")})
    add(f"- samples whose plain run raised (mostly in-place variants whose input cannot hold the broadcast result), in "
        f"{len(ref_failed)} ops: skipped")
    skipped_ops = sorted((op, r.get("reason", "")) for op, r in op_recs.items() if r["status"] != "swept" and op not in s["ops_swept"])
    reasons: Dict[str, List[str]] = {}
    for op, reason in skipped_ops:
        key = re.sub(r"\d+", "N", reason) if reason.startswith("no usable sample") else reason
        reasons.setdefault(_short(key, 160), []).append(op)
    add(f"- ops without a usable sample ({len(skipped_ops)}), by reason:")
    for reason, ops in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
        add(f"  - {_cell(reason) or 'no reason'} ({len(ops)}): " + ", ".join(f"`{o}`" for o in ops))
    add("")
    with open(path, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return s


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="+", help="OpInfo names (name or name.variant); default: all")
    parser.add_argument("--max-samples", type=int, default=DEFAULT_MAX_SAMPLES)
    parser.add_argument("--report", default="OP_SWEEP.md")
    parser.add_argument("--chunk-size", type=int, default=50, help="ops per run_on_ranks call")
    parser.add_argument("--chunk-timeout", type=float, default=900.0, help="seconds for one chunk")
    parser.add_argument("--op-timeout", type=float, default=300.0, help="seconds for one op when a chunk is rerun op by op")
    parser.add_argument("--json", help="also write every record (and the run's command, date, time) to this JSON file")
    parser.add_argument("--from-json", help="do not sweep: write the report from records saved with --json")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as handle:
            saved = json.load(handle)
        meta = saved["meta"]
        s = write_report(saved["records"], args.report, meta["command"], meta["random_ops"], meta["max_samples"],
                         meta["elapsed"], meta["date"], note=f"report written from the saved records on {now_utc()}")
        print(f"cases {s['cases']}: " + ", ".join(f"{c} {s['counts'][c]}" for c in CLASSES))
        return 0
    # Unpatched runs must be unpatched: no auto-activation here or in the rank workers (they
    # inherit the environment); sweep_ops also unpatches a process it finds patched.
    os.environ["KERAS_DTENSOR_MIXFIX"] = "0"
    command = "python tools/op_sweep.py " + " ".join(sys.argv[1:] if argv is None else argv)
    started, date = time.monotonic(), now_utc()
    names, random_ops = select_ops(args.ops)
    print(f"{len(names)} ops to sweep ({len(random_ops)} random ops skipped)", flush=True)
    records = run_sweep(names, args.max_samples, args.chunk_size, args.chunk_timeout, args.op_timeout,
                        log=lambda m: print(m, flush=True))
    elapsed = time.monotonic() - started
    if args.json:
        meta = {"command": command.strip(), "date": date, "elapsed": elapsed, "random_ops": random_ops,
                "max_samples": args.max_samples}
        with open(args.json, "w") as handle:
            json.dump({"meta": meta, "records": records}, handle, indent=0)
    s = write_report(records, args.report, command.strip(), random_ops, args.max_samples, elapsed, date)
    print(f"cases {s['cases']}: " + ", ".join(f"{c} {s['counts'][c]}" for c in CLASSES))
    print(f"correct among DTensor-supported cases: {_pct(s['supported_cases_correct'], s['supported_cases'])}; "
          f"report written to {args.report}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import op_sweep  # run the functions from the importable module, so worker processes can unpickle them

    sys.exit(op_sweep.main())

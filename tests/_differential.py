"""The one differential harness: the same program without the package and with it, compared bit for bit.

Two forms, for the two places a difference can come from (and, for callers that assert on what torch itself
returned or raised, :func:`unpatched_and_patched_outcomes`):

- in a rank worker (:func:`differential`, below): a program run unpatched and patched in one process, for
  everything torch does with and without the promotion (the conformance corpus, programs with no mixed op);
- in fresh processes (:func:`run_with_package_on_and_off`, at the end): a whole script run twice, with
  auto-activation on and off, for what importing the package changes (the Keras integration installs
  itself at ``import keras``); stdout, stderr and the exit code are compared.

In a rank worker, a *program* is a module-level function run on every rank. It builds all of its state itself
(seeded), runs, and returns a pytree (dicts, lists, tuples) of tensors, DTensors, placements and
plain Python values. :func:`differential` runs it several times inside the rank worker, in this
order by default:

1. unpatched, under ``CommDebugMode`` (the reference);
2. patched, under ``CommDebugMode``;
3. patched, without a dispatch mode (a mode can route DTensor ops down another path);
4. unpatched again, without a mode (a control: the program is deterministic and ``unpatch()``
   really restored torch).

Every run's record is compared with the reference: each tensor's type, dtype, shape, stride and
bits (local tensor, placements, mesh and global shape for a DTensor), the ``.grad`` (type and
value) of every tensor leaf that requires grad, plain values by ``repr``, and, between runs that
both counted, ``CommDebugMode().get_comm_counts()``. The worker's patch state is restored at the
end, whatever happened. :func:`assert_conformant` turns the per-rank answers into one assertion.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

# (label, patched, count collectives under CommDebugMode)
UNPATCHED = ("unpatched", False, True)
PATCHED = ("patched", True, True)
PATCHED_NO_MODE = ("patched, no dispatch mode", True, False)
UNPATCHED_AGAIN = ("unpatched again, no dispatch mode", False, False)
RUNS = (UNPATCHED, PATCHED, PATCHED_NO_MODE, UNPATCHED_AGAIN)
# compiled programs: no dispatch mode while tracing, so collectives are not counted
COMPILED_RUNS = (("unpatched", False, False), ("patched", True, False))

_current_run: Optional[str] = None


def current_run() -> str:
    """Label of the run in progress (e.g. for a per-run checkpoint directory)."""
    assert _current_run is not None, "current_run() called outside differential()"
    return _current_run


@contextlib.contextmanager
def restored_patch_state():
    """Put the worker's patch state (and options) back as found, whatever the body did."""
    import keras_dtensor_mixfix as mf

    was_patched = mf.is_patched()
    options = mf.current_options().as_dict()
    try:
        yield
    finally:
        if was_patched:
            mf.unpatch()
            mf.patch(**options)
        elif mf.is_patched():
            mf.unpatch()


def set_patched(on: bool) -> None:
    import keras_dtensor_mixfix as mf

    if on:
        mf.patch()
    else:
        mf.unpatch()
    assert mf.is_patched() is on, f"is_patched() is {mf.is_patched()} after {'patch' if on else 'unpatch'}()"


# --------------------------------------------------------------------------- records


def _placement_repr(value: Any) -> str:
    return repr(value)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """A view whose equality is bit equality (NaN payloads and -0.0 included)."""
    tensor = tensor.detach()
    if tensor.is_floating_point() and tensor.dtype.itemsize in (2, 4, 8):
        int_type = {2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.dtype.itemsize]
        return tensor.contiguous().view(int_type)
    if tensor.is_complex():
        return _bits(torch.view_as_real(tensor.detach().resolve_conj()))
    return tensor


def _tensor_record(tensor: torch.Tensor) -> Dict[str, Any]:
    from torch.distributed.tensor import DTensor

    record: Dict[str, Any] = {"type": type(tensor).__name__, "dtype": str(tensor.dtype),
                              "shape": tuple(tensor.shape), "requires_grad": tensor.requires_grad}
    if isinstance(tensor, DTensor):
        local = tensor.to_local().detach()
        record.update(placements=tuple(_placement_repr(p) for p in tensor.placements),
                      mesh=(tuple(tensor.device_mesh.shape), tensor.device_mesh.mesh_dim_names),
                      stride=tuple(tensor.stride()), local_shape=tuple(local.shape),
                      local_stride=tuple(local.stride()), value=local.clone())
    else:
        record.update(stride=tuple(tensor.stride()), value=tensor.detach().clone())
    return record


def record(tree: Any, path: str = "result", out: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Flatten a program's result to ``{path: comparable record}``; tensors that require grad
    (leaves) also record their ``.grad``."""
    out = {} if out is None else out
    if isinstance(tree, torch.Tensor):
        out[path] = _tensor_record(tree)
        if tree.requires_grad and tree.is_leaf:
            grad = tree.grad
            out[path + ".grad"] = None if grad is None else _tensor_record(grad)
    elif isinstance(tree, dict):
        for key in sorted(tree, key=repr):
            record(tree[key], f"{path}[{key!r}]", out)
    elif isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        out[path + ".len"] = len(tree)
        for index, item in enumerate(tree):
            record(item, f"{path}[{index}]", out)
    elif isinstance(tree, float):
        out[path] = "nan" if math.isnan(tree) else float.hex(tree)
    else:
        out[path] = repr(tree)
    return out


def _describe_value_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"
    differ = _bits(a) != _bits(b)
    count = int(differ.sum())
    first = tuple(int(i) for i in differ.nonzero()[0]) if count else ()
    at = f" first at {first}: {a[first].item()!r} vs {b[first].item()!r}" if count else ""
    return f"{count} of {a.numel()} element(s) differ{at}"


def compare(reference: Dict[str, Any], other: Dict[str, Any], label: str) -> List[str]:
    """Differences of ``other`` from ``reference``, each written "other's vs reference's"."""
    diffs = []
    for path in sorted(set(reference) | set(other)):
        if path not in other:
            diffs.append(f"{label}: {path} missing")
            continue
        if path not in reference:
            diffs.append(f"{label}: {path} extra")
            continue
        a, b = reference[path], other[path]
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if key == "value":
                    va, vb = a.get(key), b.get(key)
                    same = (va is not None and vb is not None and va.shape == vb.shape and va.dtype == vb.dtype
                            and torch.equal(_bits(va), _bits(vb)))
                    if not same:
                        diffs.append(f"{label}: {path} values: {_describe_value_difference(vb, va)}")
                elif a.get(key) != b.get(key):
                    diffs.append(f"{label}: {path} {key}: {b.get(key)!r} vs {a.get(key)!r}")
        elif a != b:
            diffs.append(f"{label}: {path}: {b!r} vs {a!r}")
    return diffs


class _NoModuleTracker:
    """Stands in for CommDebugMode's module tracker, whose hooks break on FSDP2 modules in torch 2.13
    (``IndexError`` in ``_fw_set_module_hook``, unpatched too). Collective counts do not need it."""

    name = "Global"
    is_bw = False
    activation_checkpointing = False
    module_parents_dict = {"Global": ["Global"]}

    def __enter__(self) -> "_NoModuleTracker":
        return self

    def __exit__(self, *args: Any) -> None:
        return None


def _comm_debug_mode() -> Any:
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    mode.advanced_module_tracker = _NoModuleTracker()
    return mode


def _comm_counts(mode: Any) -> Dict[str, int]:
    return {str(op): int(count) for op, count in mode.get_comm_counts().items()}


def _dtensor_ops(mode: Any) -> List[str]:
    """The DTensor ops CommDebugMode saw, in order, with their input placements."""
    seen = []
    for entry in mode.comm_module_operation_counts.get("Global", {}).get("operations_list", []):
        if entry["input_sharding"]:
            seen.append(f"{entry['name']}{tuple(tuple(map(repr, p)) for p in entry['input_sharding'])}")
    return seen


# --------------------------------------------------------------------------- runs


def run_once(program: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any], patched: bool,
             count_comms: bool, label: str) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    global _current_run
    set_patched(patched)
    torch.manual_seed(1234)
    _current_run = label
    try:
        if count_comms:
            mode = _comm_debug_mode()
            with mode:
                result = program(*args, **kwargs)
            counts = {"collectives": _comm_counts(mode), "dtensor ops": _dtensor_ops(mode)}
        else:
            result = program(*args, **kwargs)
            counts = None
        return record(result), counts
    finally:
        _current_run = None


def differential(program: Callable[..., Any], *args: Any, runs: Sequence[Tuple[str, bool, bool]] = RUNS,
                 torch_may_refuse: bool = False, **kwargs: Any) -> Dict[str, Any]:
    """Rank function: run ``program`` once per entry of ``runs`` and compare each with the first.

    Returns ``{"diffs": [...], "comm_counts": reference counts, "reference": reference record,
    "refused": the reference run's error or None}``. A run that raises (after the reference) is a
    difference, reported in ``diffs``. If the reference (unpatched) run raises: with
    ``torch_may_refuse`` (a program some torch releases cannot run, e.g. an optimizer whose fused
    kernel has no DTensor strategy) every other run must raise the same error; otherwise it is raised.
    """
    diffs: List[str] = []
    refused = None
    with restored_patch_state():
        results = []
        for label, patched, count_comms in runs:
            try:
                results.append((label, count_comms) + run_once(program, args, kwargs, patched, count_comms, label))
            except Exception as exc:
                # Reported, not raised: the programs are deterministic, so every rank fails at the same
                # op, and the workers stay in step and need no restart.
                first_line = f"{type(exc).__name__}: {exc}".splitlines()[0][:600]
                if not results and refused is None:
                    if not torch_may_refuse:
                        raise  # the reference itself failed: the program is not part of the corpus
                    refused = first_line
                elif refused is not None:
                    if first_line != refused:
                        diffs.append(f"{label} run raised {first_line} where unpatched torch raised {refused}")
                else:
                    diffs.append(f"{label} run raised {first_line}")
            else:
                if refused is not None:
                    diffs.append(f"{label} run returned where unpatched torch raised {refused}")
    if refused is not None:
        return {"diffs": diffs, "comm_counts": None, "reference": None, "refused": refused}
    (ref_label, ref_counted, reference, ref_counts) = results[0]
    for label, counted, rec, counts in results[1:]:
        diffs += compare(reference, rec, f"{label} vs {ref_label}")
        if counted and ref_counted:
            if counts["collectives"] != ref_counts["collectives"]:
                diffs.append(f"{label} vs {ref_label}: comm counts {counts['collectives']} vs "
                             f"{ref_counts['collectives']}")
            diffs += _compare_sequences(ref_counts["dtensor ops"], counts["dtensor ops"],
                                        f"{label} vs {ref_label}: DTensor ops seen by CommDebugMode")
    return {"diffs": diffs, "comm_counts": ref_counts and ref_counts["collectives"], "reference": reference,
            "refused": None}


def _compare_sequences(reference: List[str], other: List[str], label: str) -> List[str]:
    if reference == other:
        return []
    first = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
    a = reference[first] if first < len(reference) else "<end>"
    b = other[first] if first < len(other) else "<end>"
    return [f"{label}: {len(other)} vs {len(reference)} ops, first difference at #{first}: {b} vs {a}"]


def assert_conformant(per_rank: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Assert no rank saw a difference; returns rank 0's answer."""
    lines = [f"rank {r}: {d}" for r, answer in enumerate(per_rank) for d in answer["diffs"]]
    assert not lines, "patched run differs from unpatched:\n" + "\n".join(lines[:40]) + (
        f"\n... and {len(lines) - 40} more" if len(lines) > 40 else "")
    return per_rank[0]


# --------------------------------------------------------------------------- outcomes, for the caller to compare


def unpatched_and_patched_outcomes(program: Callable[..., Any], *args: Any) -> Tuple[Any, Any, Dict[str, int]]:
    """Rank function helper: ``(unpatched outcome, patched outcome, promotions counted while patched)`` of
    ``program(*args)``, each outcome from :func:`outcome`, for a caller that asserts on the outcomes themselves
    (the composition tests: torch's own path, where the patch must change nothing)."""
    import keras_dtensor_mixfix as mf

    assert not mf.is_patched()
    unpatched = outcome(program, *args)
    mf.patch()
    try:
        patched = outcome(program, *args)
        promoted = dict(mf.stats())
    finally:
        mf.unpatch()
    return unpatched, patched, promoted


def outcome(program: Callable[..., Any], *args: Any) -> Any:
    """``("ok", the result as plain values)``, or ``("raised", type, first line, whether it is the mixed-operand
    error)``."""
    try:
        return ("ok", _plain_values(program(*args)))
    except Exception as exc:  # noqa: BLE001 - the error itself is the outcome to compare
        text = str(exc)
        return ("raised", type(exc).__name__, text.split("\n")[0], "got mixed torch.Tensor and DTensor" in text)


def _plain_values(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return ("DTensor", tuple(value.placements), value.full_tensor().tolist(), value.to_local().tolist())
    if isinstance(value, torch.Tensor):
        return ("Tensor", value.dtype, value.tolist())
    if isinstance(value, (list, tuple)):
        return type(value)(_plain_values(v) for v in value)
    return value


# --------------------------------------------------------------------------- whole processes


def run_with_package_on_and_off(script: Any, tmp_path: Any, *, timeout: float = 300,
                                **env: str) -> Dict[str, Tuple[Any, Optional[Dict[str, Any]]]]:
    """Run ``script`` with auto-activation on (``"1"``) and off (``"0"``), side by side, in fresh processes.

    Each run gets its own working directory (the programs may write files by the same relative names) and
    ``MIXFIX_TEST_STATE_FILE``, a path the script may write JSON to (what the package did, read after the
    program, so that stdout stays comparable). ``env`` is added to both runs' environment. Returns
    ``{"1": (CompletedProcess, state or None), "0": (...)}``.
    """
    import json
    import os
    import subprocess
    import sys

    base = {key: value for key, value in os.environ.items() if not key.startswith("KERAS_DTENSOR_MIXFIX")}
    base.update(
        # One intra-op thread: the two runs side by side do not compete for a 2-core machine's cores, and both
        # split every reduction the same way, so the same computation gives the same bits.
        OMP_NUM_THREADS="1",
        PYTHONHASHSEED="0",  # the same set and dict orders in both runs
    )
    base.update(env)
    started = {}
    for mode in ("1", "0"):
        run_dir = tmp_path / f"mixfix{mode}"
        run_dir.mkdir()
        run_env = dict(base, KERAS_DTENSOR_MIXFIX=mode, MIXFIX_TEST_STATE_FILE=str(run_dir / "state.json"),
                       KERAS_HOME=str(run_dir / "keras_home"))  # no keras.json of the user's, none shared
        started[mode] = subprocess.Popen([sys.executable, str(script)], cwd=run_dir, env=run_env, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    results = {}
    for mode, process in started.items():
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in started.values():
                other.kill()
            raise
        state_file = tmp_path / f"mixfix{mode}" / "state.json"
        state = json.loads(state_file.read_text()) if state_file.exists() else None
        results[mode] = (subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), state)
    return results


def text_diff(name: str, reference: str, active: str, limit: int = 60) -> str:
    """A unified diff of one output stream of :func:`run_with_package_on_and_off` (package off, then on)."""
    import difflib

    lines = list(difflib.unified_diff(reference.splitlines(), active.splitlines(), f"{name}, KERAS_DTENSOR_MIXFIX=0",
                                      f"{name}, KERAS_DTENSOR_MIXFIX=1", n=2, lineterm=""))
    return "\n".join(lines[:limit] + ([f"... ({len(lines) - limit} more diff lines)"] if len(lines) > limit else []))

"""The mixed-operand patterns of ``benchmarks/gpu_check.py`` (rows 2, 3 and 6), each one program run on plain tensors
and again with its weights DTensors on a mesh, the rest of its operands plain.

A pattern is a function ``pattern(case) -> (outputs, leaves)``: it draws its tensors from ``case`` (``case.weight``:
a leaf that requires grad, plain on the device or a DTensor on the mesh; ``case.plain``: a plain operand, on the
device or, in the CPU-operand variant, on the CPU; ``case.scalar``: a 0-dim plain operand, on the CPU on a CUDA device),
computes, and returns what to compare: its outputs, and the leaves whose gradients of ``sum(output ** 2) / 2`` must
match. Optimizer patterns return the parameters after their steps and no leaves. Every draw comes from a generator
seeded per run, so both runs see the same numbers. The functions here run in the check's subprocesses and rank
workers (module level, picklable); the table is ``gpu_check.py``'s.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

TOLERANCE = dict(rtol=1e-5, atol=1e-5)
"""float32; two ranks add partial sums in another order than one process."""
CPU_SDPA_SHARDED = ("not run on 2 cpu ranks: DTensor derives a strategy for CPU's flash attention by tracing its "
                    "decomposition for every placement, minutes per shape with split q/k/v (torch 2.13, "
                    "repros/torch_sdpa_cpu_sharding_search.py); values on one rank are row 2's")
CPU_SDPA_BACKWARD = "grads not compared on cpu: DTensor has no sharding strategy for CPU SDPA's backward (torch)"
KNOWN_TORCH_LIMITS = {
    ("embedding, plain ids", "Shard(dim=0)"): ("AssertionError", "torch 2.13: the vocabulary-split lookup's pending "
                                               "sum (_MaskPartial) can be reduced only once, and the gradient of a "
                                               "loss reads it again (AssertionError in _reduce_value; docs/keras.md)"),
}
"""(pattern, placement) -> (the exception torch raises, why): torch's own limits, reported n/a, not FAIL."""
REFUSED_BY_BACKEND = re.compile(r"gloo|nccl|backend", re.IGNORECASE)
REFUSED_WORDS = re.compile(r"not supported|does not support|unsupported|not implemented|no support", re.IGNORECASE)


class Case:
    """What a pattern draws its tensors from: one run, plain (``mesh`` None) or with its weights on ``mesh``."""

    def __init__(self, device: str, mesh: Any = None, placement: Any = None, plain_device: Optional[str] = None):
        self.device, self.mesh, self.placement = device, mesh, placement
        self.plain_device = plain_device or device
        self.generator = torch.Generator().manual_seed(0)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator)

    def randint(self, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.generator)

    def weight(self, value: torch.Tensor, grad: bool = True) -> torch.Tensor:
        """A leaf: plain on the device, or a DTensor on the mesh (the case's placement where the tensor has that dim,
        else replicated)."""
        value = value.to(self.device)
        if self.mesh is not None:
            from torch.distributed.tensor import Replicate, Shard, distribute_tensor

            placement = self.placement or Replicate()
            if isinstance(placement, Shard) and placement.dim >= value.dim():
                placement = Shard(0) if value.dim() else Replicate()
            value = distribute_tensor(value, self.mesh, [placement])
        return value.requires_grad_(grad)

    def param(self, value: torch.Tensor) -> torch.nn.Parameter:
        return torch.nn.Parameter(self.weight(value, grad=False))

    def plain(self, value: torch.Tensor) -> torch.Tensor:
        return value.to(self.plain_device)

    def scalar(self, value: float) -> torch.Tensor:
        return torch.tensor(value, device="cpu")


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value on the CPU, detached (a DTensor gathered)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().float().cpu()


# ----------------------------------------------------------------------------- the patterns


def mul_add(case: Case) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    w = case.weight(case.randn(8, 6))
    x, b = case.plain(case.randn(8, 6)), case.plain(case.randn(6))
    return [w * x + b], [w]


def mul_cpu_scalar(case: Case) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    w = case.weight(case.randn(8, 6))
    return [w * case.scalar(0.5) + case.scalar(2.0)], [w]


def matmul(case: Case) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    w = case.weight(case.randn(8, 6))
    return [case.plain(case.randn(4, 8)) @ w], [w]


def cross_entropy(case: Case) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    w = case.weight(case.randn(8, 6))
    x, labels = case.plain(case.randn(4, 8)), case.plain(case.randint(6, 4))
    return [F.cross_entropy(x @ w, labels)], [w]


def embedding(case: Case) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    table = case.weight(case.randn(16, 6))
    ids = case.plain(case.randint(16, 4, 5))
    return [F.embedding(ids, table)], [table]


def sdpa(case: Case) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    q, k, v = (case.weight(case.randn(2, 4, 8, 16)) for _ in range(3))
    mask = case.plain(torch.tril(torch.ones(8, 8, dtype=torch.bool)))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return [out], ([] if case.device == "cpu" else [q, k, v])


def cat(case: Case) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    w = case.weight(case.randn(4, 6))
    return [torch.cat([w, case.plain(case.randn(2, 6))], dim=0)], [w]


def _parameters(case: Case) -> List[torch.nn.Parameter]:
    """Two weights (DTensors on the mesh) and a plain bias in one list, with fixed gradients of their layout."""
    params = [case.param(case.randn(8, 6)), case.param(case.randn(6, 4)),
              torch.nn.Parameter(case.randn(5).to(case.device))]
    for p in params:
        grad = case.randn(*p.shape)
        p.grad = case.weight(grad, grad=False) if p is not params[-1] else grad.to(case.device)
    return params


def _optimizer_steps(case: Case, make: Callable[[List[torch.nn.Parameter]], Any]) -> Tuple[List[torch.Tensor], list]:
    params = _parameters(case)
    optimizer = make(params)
    for _ in range(3):
        optimizer.step()
    return [p.detach() for p in params], []


def adamw(foreach: Optional[bool]) -> Callable[[Case], Any]:
    def pattern(case: Case) -> Any:
        return _optimizer_steps(case, lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1, foreach=foreach))
    return pattern


def sgd_momentum(foreach: Optional[bool]) -> Callable[[Case], Any]:
    def pattern(case: Case) -> Any:
        return _optimizer_steps(case, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=foreach))
    return pattern


def fused_adamw(case: Case) -> Tuple[List[torch.Tensor], list]:
    return _optimizer_steps(case, lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1, fused=True))


def clip_grad_norm(case: Case) -> Tuple[List[torch.Tensor], list]:
    params = _parameters(case)
    total = torch.nn.utils.clip_grad_norm_(params, max_norm=0.5)
    return [total] + [p.grad for p in params], []


def grad_scaler(case: Case) -> Tuple[List[torch.Tensor], list]:
    """A float32 loss scaled, its gradients unscaled and checked for inf, AdamW stepped, the scale updated."""
    w = case.param(case.randn(8, 6))
    x, labels = case.plain(case.randn(4, 8)), case.plain(case.randint(6, 4))
    optimizer = torch.optim.AdamW([w], lr=0.1)
    scaler = torch.amp.GradScaler(case.device, init_scale=2.0 ** 10)
    for _ in range(2):
        optimizer.zero_grad()
        scaler.scale(F.cross_entropy(x @ w, labels)).backward()
        scaler.step(optimizer)
        scaler.update()
    return [w.detach(), torch.tensor(scaler.get_scale())], []


PATTERNS: Dict[str, Tuple[Callable[[Case], Any], str]] = {
    # name: (pattern, where it runs: "all", or "cuda")
    "mul/add": (mul_add, "all"),
    "mul by 0-dim CPU scalar": (mul_cpu_scalar, "all"),
    "matmul plain @ DTensor": (matmul, "all"),
    "cross_entropy, plain labels": (cross_entropy, "all"),
    "embedding, plain ids": (embedding, "all"),
    "sdpa, plain mask": (sdpa, "all"),
    "cat": (cat, "all"),
    "AdamW foreach=None": (adamw(None), "all"),
    "AdamW foreach=True": (adamw(True), "all"),
    "SGD momentum foreach=None": (sgd_momentum(None), "all"),
    "SGD momentum foreach=True": (sgd_momentum(True), "all"),
    "clip_grad_norm_, mixed list": (clip_grad_norm, "all"),
    "AdamW fused=True": (fused_adamw, "cuda"),
    "GradScaler + AdamW": (grad_scaler, "cuda"),
}
PLAIN_ON_CPU_ERRS = ("mul/add", "matmul plain @ DTensor", "cross_entropy, plain labels", "embedding, plain ids",
                     "sdpa, plain mask", "cat")
"""Patterns whose plain operands, put on the CPU next to CUDA DTensors, must raise the package's error naming .to()."""


def patterns_for(device: str) -> List[str]:
    return [name for name, (_, where) in PATTERNS.items() if where == "all" or where == device]


# ----------------------------------------------------------------------------- running one


def _run(pattern: Callable[[Case], Any], case: Case) -> List[torch.Tensor]:
    outputs, leaves = pattern(case)
    if leaves:
        # pow reads each output once: a vocabulary-split lookup's pending sum (DTensor's _MaskPartial) can be
        # reduced only once in torch 2.13 (o * o reads it twice: a bare AssertionError)
        sum(o.pow(2).sum() / 2 for o in outputs).backward()
    return [full(o) for o in outputs] + [full(leaf.grad) for leaf in leaves]


def _max_difference(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> Tuple[bool, float]:
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want)):
        return False, float("inf")
    worst = max((float((g - w).abs().max()) if g.numel() else 0.0) for g, w in zip(got, want))
    return all(torch.allclose(g, w, **TOLERANCE) for g, w in zip(got, want)), worst


def refused_by_backend(exc: BaseException) -> bool:
    """Whether an error is a collective the process group's backend refuses (gloo over CUDA tensors)."""
    text = str(exc)
    return bool(REFUSED_BY_BACKEND.search(text) and REFUSED_WORDS.search(text))


def _short(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:240]


def compare(name: str, device: str, mesh: Any, placement: Any = None,
            plain_device: Optional[str] = None) -> Dict[str, Any]:
    """One variant of one pattern: ``{"verdict": "ok" | "n/a" | "FAIL", "detail": ...}``. The reference runs on plain
    tensors unpatched; the mesh run patched. With ``plain_device`` the CPU and the device CUDA, a pattern in
    ``PLAIN_ON_CPU_ERRS`` must raise the package's error naming ``.to(``."""
    import keras_dtensor_mixfix as mf

    pattern = PATTERNS[name][0]
    expect_error = plain_device == "cpu" and device != "cpu" and name in PLAIN_ON_CPU_ERRS
    try:
        want = None if expect_error else _run(pattern, Case(device))
        with mf.patched():
            got = _run(pattern, Case(device, mesh, placement, plain_device))
    except Exception as exc:  # noqa: BLE001 - every failure becomes the row's detail
        if expect_error and isinstance(exc, mf.MixedOperandError) and ".to(" in str(exc):
            return {"verdict": "ok", "detail": "clear error naming .to()"}
        known = KNOWN_TORCH_LIMITS.get((name, repr(placement)))
        if known is not None and type(exc).__name__ == known[0]:
            return {"verdict": "n/a", "detail": known[1]}
        if refused_by_backend(exc):
            return {"verdict": "n/a", "detail": f"the backend refused a collective: {_short(exc)}"}
        return {"verdict": "FAIL", "detail": _short(exc)}
    if expect_error:
        return {"verdict": "FAIL", "detail": "a CPU operand next to CUDA DTensors ran instead of raising"}
    same, worst = _max_difference(got, want)
    note = f"; {CPU_SDPA_BACKWARD}" if pattern is sdpa and device == "cpu" else ""
    return {"verdict": "ok" if same else "FAIL", "detail": f"{'=' if same else 'DIFFER'} (max diff {worst:.1e}){note}"}


# ----------------------------------------------------------------------------- row families' bodies


def one_device_mesh(device: str) -> Dict[str, Dict[str, Dict[str, Any]]]:
    """Row family 2, in a process of its own: a one-rank process group (NCCL on cuda, gloo on cpu), the mesh
    ``init_device_mesh(device, (1,))``; every pattern with device operands, and on cuda with CPU operands."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device, (1,))
        results = {}
        for name in patterns_for(device):
            variants = {f"plain on {device}": compare(name, device, mesh)}
            if device != "cpu" and name in PLAIN_ON_CPU_ERRS:
                variants["plain on cpu"] = compare(name, device, mesh, plain_device="cpu")
            results[name] = variants
        return results
    finally:
        dist.destroy_process_group()


def two_ranks_worker(device: str) -> Dict[str, Dict[str, Dict[str, Any]]]:
    """Row family 3, on each of 2 ranks (``run_on_ranks``: gloo on 127.0.0.1) sharing the one device: every pattern
    with its weights ``Shard(0)`` and ``Shard(1)``, against the plain program in this process."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    from keras_dtensor_mixfix.testing import mesh as cpu_mesh, world_size

    if device == "cuda":
        torch.cuda.set_device(0)  # both ranks: one GPU
        try:
            mesh = DeviceMesh("cuda", torch.arange(world_size()))
        except Exception as exc:  # noqa: BLE001 - reported per pattern
            return {name: {"mesh": {"verdict": "n/a" if refused_by_backend(exc) else "FAIL",
                                    "detail": f"building a CUDA mesh over gloo: {_short(exc)}"}}
                    for name in patterns_for(device)}
    else:
        mesh = cpu_mesh()
    results = {}
    for name in patterns_for(device):
        if PATTERNS[name][0] is sdpa and device == "cpu":
            results[name] = {"Shard(0), Shard(1)": {"verdict": "n/a", "detail": CPU_SDPA_SHARDED}}
            continue
        results[name] = {f"Shard({dim})": compare(name, device, mesh, Shard(dim)) for dim in (0, 1)}
    return results


# ----------------------------------------------------------------------------- syncs (row 6)


def _training_step(case: Case, by_hand: bool = False) -> Callable[[], None]:
    """A two-layer step: plain inputs and labels, DTensor weights (on a mesh), cross_entropy, clip_grad_norm_, AdamW
    foreach. ``by_hand``: every input a DTensor too (what a program without the package must write)."""
    w1, w2 = case.param(case.randn(64, 128)), case.param(case.randn(128, 16))
    x, labels = case.plain(case.randn(32, 64)), case.plain(case.randint(16, 32))
    if by_hand:
        x, labels = case.weight(x, grad=False), case.weight(labels, grad=False)
    optimizer = torch.optim.AdamW([w1, w2], lr=1e-3, foreach=True)

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(torch.relu(x @ w1) @ w2, labels).backward()
        torch.nn.utils.clip_grad_norm_([w1, w2], 1.0, foreach=True)
        optimizer.step()

    return step


def _syncs(step: Callable[[], None]) -> int:
    """Synchronizing CUDA calls in one step (after two warm-up steps), counted by torch's sync debug mode."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def sync_counts() -> Dict[str, Any]:
    """Row family 6, on cuda, in a process of its own (one-rank NCCL group): syncs per step of the plain program, of
    the program with its DTensors written by hand (no promotion), and of the mixed program patched."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import keras_dtensor_mixfix as mf

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        mesh = init_device_mesh("cuda", (1,))
        counts: Dict[str, Any] = {"plain": _syncs(_training_step(Case("cuda")))}
        try:
            counts["by_hand"] = _syncs(_training_step(Case("cuda", mesh), by_hand=True))
        except Exception as exc:  # noqa: BLE001 - then the plain program is the baseline
            counts["by_hand"] = None
            counts["by_hand_error"] = _short(exc)
        with mf.patched():
            counts["mixed"] = _syncs(_training_step(Case("cuda", mesh)))
        return counts
    finally:
        dist.destroy_process_group()

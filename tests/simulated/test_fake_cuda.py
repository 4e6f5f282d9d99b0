"""The package's CUDA decisions, simulated: torch's ``FakeTensorMode`` with a ``"cuda"`` DeviceMesh on the fake process
group, on a machine without a GPU (CPU-only and CUDA builds of torch alike).

Fake tensors carry shapes, dtypes and devices but no values, and follow CUDA's device rules with torch's own error
texts; so these tests check devices, placements and shapes, never numbers (tests/simulated/test_simulated_promotion.py
and the gloo tests check values). What they cover:

- a CPU matrix meeting CUDA DTensors: refused in the words of torch's device error, naming the op, shapes, devices
  and mesh, with advice (``.to(...)``) that, followed, runs;
- a 0-dim CPU scalar meeting CUDA DTensors: accepted, as torch accepts it beside plain CUDA tensors;
- ``cuda:1`` against ``cuda:0`` (a rank whose current device is wrong): refused, naming both;
- CUDA's defaults in optimizers and ``clip_grad_norm_`` over mixed parameter lists: with CUDA tensors torch takes the
  ``foreach`` kernels (and ``fused=True``), which it never takes on the CPU; the GPU check's rows that need CUDA run
  here where they check devices and placements.

What cannot run this way: autograd. Its engine asks the CUDA runtime about the device of every leaf that requires
grad (a CPU-only build: "PyTorch is not linked with support for cuda devices"; a CUDA build without a GPU:
"hasPrimaryContext expects a valid device index"), so the cases run without gradients and the GPU check's
``GradScaler`` row (a backward) is left to a GPU.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import sys

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import _simulator
import keras_dtensor_mixfix as mf

fake_tensor = pytest.importorskip("torch._subclasses.fake_tensor", reason="torch's FakeTensorMode is not in this torch")


def _gpu_check_patterns():
    """benchmarks/gpu_check_patterns.py, the GPU check's patterns (benchmarks/ is no package)."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu_check_patterns.py")
    spec = importlib.util.spec_from_file_location("gpu_check_patterns", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check_patterns", module)
    spec.loader.exec_module(module)
    return module


gpu_check_patterns = _gpu_check_patterns()

TORCHS_DEVICE_ERROR = r"same device|found two different devices"
"""Fake tensors' device error for plain tensors: CUDA's text ("Expected all tensors to be on the same device") on torch
2.13 and later, FakeTensor's own on 2.11 and 2.12."""

CUDA = "cuda:0"
"""The device of every fake CUDA tensor here (a device with its index: a CPU-only build refuses ``.to("cuda")``)."""


@pytest.fixture
def cuda_mesh(request):
    """A ``"cuda"`` mesh of ``request.param`` (default (2, 4)) on a fake process group, and FakeTensorMode on."""
    shape = getattr(request, "param", (2, 4))
    size = math.prod(shape)
    with _simulator.fake_process_group(size):
        mesh = torch.distributed.device_mesh.DeviceMesh("cuda", torch.arange(size).reshape(shape))
        with fake_tensor.FakeTensorMode(), torch.no_grad():
            yield mesh


def _weight(mesh, rows=16, columns=8) -> DTensor:
    """A (rows, columns) CUDA DTensor split by rows on the mesh's last dim."""
    placements = (Replicate(),) * (mesh.ndim - 1) + (Shard(0),)
    local = torch.empty(rows // mesh.size(mesh.ndim - 1), columns, device=CUDA)
    return DTensor.from_local(local, mesh, placements, run_check=False)


def test_a_cpu_matrix_next_to_cuda_dtensors_is_refused_in_torchs_words_with_advice_that_works(cuda_mesh):
    weight, batch = _weight(cuda_mesh), torch.empty(16, 8)
    with pytest.raises(RuntimeError) as torchs:
        torch.empty(16, 8, device=CUDA) * batch  # torch's own rule for plain tensors
    assert re.search(TORCHS_DEVICE_ERROR, str(torchs.value)), torchs.value
    with mf.patched():
        with pytest.raises(mf.MixedOperandError) as refused:
            weight * batch
        message = str(refused.value)
        for needed in ("aten::mul.Tensor", "args[1]", "(16, 8)", "cpu", CUDA, "expected all tensors to be on the same "
                       "device", "Replicate(), Shard(dim=0)", "DeviceMesh"):
            assert needed in message, f"{needed!r} not in: {message}"
        advice = re.search(r"\.to\('([^']+)'\)", message)
        assert advice, message
        out = weight * batch.to(advice.group(1))  # the advice, followed
    assert isinstance(out, DTensor) and out.device == torch.device(CUDA)
    assert tuple(out.shape) == (16, 8) and out.placements == weight.placements


def test_a_0_dim_cpu_scalar_meets_cuda_dtensors_as_torch_lets_it_meet_cuda_tensors(cuda_mesh):
    weight, scale = _weight(cuda_mesh), torch.tensor(2.0)
    assert (torch.empty(16, 8, device=CUDA) * scale).device == torch.device(CUDA)  # torch's rule
    with mf.patched():
        for out in (weight * scale, torch.where(weight > 0, weight, torch.tensor(0.0)), weight.mul_(scale)):
            assert isinstance(out, DTensor) and out.device == torch.device(CUDA)
            assert tuple(out.shape) == (16, 8) and out.placements == weight.placements


def test_cuda_1_against_cuda_0_is_refused_naming_both_devices(cuda_mesh):
    """A rank whose current device is not its mesh's (``torch.cuda.set_device`` forgotten) makes its batch on another
    GPU: refused as torch refuses plain tensors on two GPUs, naming both."""
    weight, batch = _weight(cuda_mesh), torch.empty(16, 8, device="cuda:1")
    with pytest.raises(RuntimeError, match=TORCHS_DEVICE_ERROR):
        torch.empty(16, 8, device=CUDA) * batch
    with mf.patched():
        with pytest.raises(mf.MixedOperandError, match=r"cuda:1(.|\n)*cuda:0"):
            weight + batch


class _OpsRun(TorchDispatchMode):
    """The ops that reach the (fake) kernels, by name (``aten::_foreach_add_.Scalar``): below DTensor, its local
    pieces' and the plain tensors' ops."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._schema.name + (f".{func._overloadname}" if func._overloadname != "default" else ""))
        return func(*args, **(kwargs or {}))


class _FakeCase(gpu_check_patterns.Case):
    """The GPU check's ``Case``, its tensors made on the device (a fake tensor has no values to draw, and a CPU-only
    build refuses moving one to a CUDA device)."""

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=self.device)

    def randint(self, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, device=self.device)


def _clip_grad_norm_foreach(case):
    """The GPU check's ``clip_grad_norm_`` row with the kernels CUDA's default takes (``foreach=True``)."""
    params = gpu_check_patterns._parameters(case)
    total = torch.nn.utils.clip_grad_norm_(params, max_norm=0.5, foreach=True)
    return [total] + [p.grad for p in params], []


OPTIMIZER_ROWS = {
    # the GPU check's row: (its pattern, the kernel family torch takes for CUDA tensors by default)
    "AdamW foreach=True": (gpu_check_patterns.PATTERNS["AdamW foreach=True"][0], "aten::_foreach_"),
    "SGD momentum foreach=True": (gpu_check_patterns.PATTERNS["SGD momentum foreach=True"][0], "aten::_foreach_"),
    "AdamW fused=True": (gpu_check_patterns.PATTERNS["AdamW fused=True"][0], "aten::_fused_adamw"),
    "clip_grad_norm_, mixed list, foreach=True": (_clip_grad_norm_foreach, "aten::_foreach_norm"),
}
"""The GPU check's optimizer rows with the kernels torch's default takes for CUDA tensors (``foreach``; ``fused`` asked
for), each with an op of that family that must have run over the mixed list. They are named: under
FakeTensorMode torch's default rule sees a plain parameter's type as ``FakeTensor``, not ``Tensor``, and takes the
per-tensor loop, which the CPU tests already run."""


@pytest.mark.parametrize("cuda_mesh", [(2,)], indirect=True, ids=["2"])
@pytest.mark.parametrize("row", sorted(OPTIMIZER_ROWS))
def test_the_gpu_checks_optimizer_rows_take_cudas_kernels_over_mixed_lists(cuda_mesh, row):
    pattern, kernel = OPTIMIZER_ROWS[row]
    want, _ = pattern(_FakeCase(CUDA))  # the plain program, on fake CUDA tensors
    with mf.patched(), _OpsRun() as ran:
        got, _ = pattern(_FakeCase(CUDA, cuda_mesh, Shard(0)))
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want]
    assert all(t.device == torch.device(CUDA) for t in got), [t.device for t in got]
    assert any(isinstance(t, DTensor) for t in got) and not isinstance(got[-1], DTensor)  # a mixed list, still mixed
    assert any(op.startswith(kernel) for op in ran.ops), f"no {kernel}* op ran: {sorted(set(ran.ops))}"


@pytest.mark.parametrize("cuda_mesh", [(2,)], indirect=True, ids=["2"])
@pytest.mark.parametrize("row", gpu_check_patterns.PLAIN_ON_CPU_ERRS)
def test_the_gpu_checks_cpu_operand_rows_raise_the_packages_error_naming_to(cuda_mesh, row):
    """Row 2's CPU-operand variant: each pattern's plain operands on the CPU beside CUDA DTensors must raise the
    package's error naming ``.to(`` (the GPU check's own verdict function decides)."""
    pattern = gpu_check_patterns.PATTERNS[row][0]
    with mf.patched():
        with pytest.raises(mf.MixedOperandError, match=r"\.to\("):
            pattern(_FakeCase(CUDA, cuda_mesh, Shard(0), plain_device="cpu"))

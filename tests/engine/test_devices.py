"""A plain operand on another device than its DTensor peer: torch's rule, never a DTensor on the wrong device.

On CPU machines the second device is ``meta``: a meta-initialized DTensor on a CPU mesh (what FSDP-style
meta initialization makes) has the same spec as a CPU one, so these cases also prove that no cached
decision is reused across devices. The ``cuda`` test runs the same cases on a 2-GPU NCCL mesh where two
GPUs exist, and is skipped, saying so, elsewhere.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from _ranks import shard
from keras_dtensor_mixfix.testing import mesh, run_on_ranks


def _outcome(fn):
    """("ok", device of the result's local piece) or (exception type, its first line)."""
    from torch.distributed.tensor import DTensor

    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return type(exc).__name__, str(exc)
    if isinstance(value, (list, tuple)):
        value = value[0]
    return "ok", str(value._local_tensor.device if isinstance(value, DTensor) else value.device)


def meta_and_cpu_cases():
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import Shard, distribute_tensor

    m = mesh()
    torch.manual_seed(0)
    w, x = torch.randn(8, 4), torch.randn(8, 4)
    cpu_w = shard(w, m, [Shard(0)])
    meta_w = distribute_tensor(torch.empty(8, 4, device="meta"), m, [Shard(0)])
    assert meta_w._spec == cpu_w._spec and meta_w._local_tensor.device.type == "meta"
    out = {}
    with mf.patched():
        out["cpu_first"] = _outcome(lambda: cpu_w * x)  # the fast path caches its decision for this spec...
        out["meta_peer_cpu_plain"] = _outcome(lambda: meta_w * x)  # ...which must not serve another device
        out["cpu_peer_meta_plain"] = _outcome(lambda: cpu_w * torch.empty(8, 4, device="meta"))
        out["meta_meta"] = _outcome(lambda: meta_w * torch.empty(8, 4, device="meta"))
        out["meta_peer_cpu_plain_again"] = _outcome(lambda: meta_w * x)
        out["cpu_scalar"] = _outcome(lambda: meta_w * torch.tensor(2.0))  # one element: torch's own path
        # beside a larger plain operand that is promoted, a CPU scalar stays torch's: no copy (devices.py)
        meta_mask = torch.empty(8, 4, dtype=torch.bool, device="meta")
        out["cpu_scalar_beside_plain"] = _outcome(lambda: torch.where(meta_mask, meta_w, torch.tensor(0.0)))
        out["write_into_cpu_plain"] = _outcome(lambda: x.clone().add_(meta_w))
        out["meta_foreach"] = _outcome(lambda: torch._foreach_add([meta_w], [torch.empty(8, 4, device="meta")]))
        out["foreach_cpu_plain"] = _outcome(lambda: torch._foreach_add([meta_w], [x]))
        with mf.patched(default="local"):
            out["local_rule"] = _outcome(lambda: meta_w * torch.randn(4, 4))
        out["cpu_after_errors"] = _outcome(lambda: cpu_w * x)
        out["values_after_errors"] = torch.equal((cpu_w * x).full_tensor(), w * x)
    return out


def test_a_plain_operand_on_another_device_is_refused_and_never_wrapped():
    out = run_on_ranks(meta_and_cpu_cases, world_size=2)[0]
    for case in ("cpu_first", "cpu_after_errors"):
        assert out[case] == ("ok", "cpu"), (case, out[case])
    for case in ("meta_meta", "cpu_scalar", "cpu_scalar_beside_plain", "meta_foreach"):
        assert out[case] == ("ok", "meta"), (case, out[case])
    assert out["values_after_errors"] is True
    refused = {"meta_peer_cpu_plain": ("cpu", "meta"), "meta_peer_cpu_plain_again": ("cpu", "meta"),
               "cpu_peer_meta_plain": ("meta", "cpu"), "write_into_cpu_plain": ("cpu", "meta"),
               "foreach_cpu_plain": ("cpu", "meta"), "local_rule": ("cpu", "meta")}
    for case, (plain, local) in refused.items():
        kind, text = out[case]
        assert kind == "MixedOperandError", (case, out[case])
        assert (f"the plain operand is on {plain}, but the DTensor's local pieces are on {local}: expected all tensors "
                "to be on the same device") in text, (case, text)
        assert "what to do: Put the plain tensor on the mesh's device first" in text, (case, text)
        assert "DeviceMesh('cpu', [0, 1])" in text and "shape (" in text, (case, text)


# --------------------------------------------------------------------------- CUDA, where two GPUs exist

_CUDA_CASES = textwrap.dedent(
    """
    import json, os
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    import keras_dtensor_mixfix as mf

    def outcome(fn):
        try:
            value = fn()
        except Exception as exc:
            return [type(exc).__name__, str(exc)]
        value = value[0] if isinstance(value, (list, tuple)) else value
        local = value._local_tensor if isinstance(value, DTensor) else value
        return ["ok", str(local.device)]

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (2,))
    torch.manual_seed(0)
    w, x = torch.randn(8, 4), torch.randn(8, 4)
    dw = distribute_tensor(w.cuda(), mesh, [Shard(0)])
    other_gpu = torch.device("cuda", 1 - rank)
    mf.patch()
    out = {
        "cuda_plain": outcome(lambda: dw * x.cuda()),
        "cuda_values": torch.equal((dw * x.cuda()).full_tensor().cpu(), w * x),
        "cpu_matrix": outcome(lambda: dw * x),
        "cpu_scalar": outcome(lambda: dw * torch.tensor(2.0)),
        "cpu_scalar_values": torch.equal((dw * torch.tensor(2.0)).full_tensor().cpu(), w * 2),
        "moved_scalar_values": torch.equal(torch.where((x > 0).cuda(), dw, torch.tensor(0.5)).full_tensor().cpu(),
                                           torch.where(x > 0, w, torch.tensor(0.5))),
        "other_gpu": outcome(lambda: dw * x.to(other_gpu)),
        "write_into_cpu_plain": outcome(lambda: x.clone().add_(dw)),
        "foreach_cpu_plain": outcome(lambda: torch._foreach_add([dw], [x])),
        "cuda_after_errors": outcome(lambda: dw * x.cuda()),
    }
    with mf.patched(default="local"):
        out["local_rule"] = outcome(lambda: dw * x[:4])
    mf.unpatch()
    if rank == 0:
        print(json.dumps(out))
    dist.destroy_process_group()
    """
)


def _two_gpus_with_nccl() -> str:
    """Why the CUDA test cannot run here ('' when it can)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return f"needs 2 CUDA GPUs (this machine has {torch.cuda.device_count() if torch.cuda.is_available() else 0})"
    if not torch.distributed.is_nccl_available():
        return "needs a torch built with NCCL"
    return ""


@pytest.mark.cuda
@pytest.mark.skipif(bool(_two_gpus_with_nccl()), reason=_two_gpus_with_nccl() or "runs")
def test_on_a_cuda_mesh_cpu_scalars_move_and_other_devices_are_refused(tmp_path):
    script = tmp_path / "cuda_devices.py"
    script.write_text(_CUDA_CASES)
    env = {name: value for name, value in os.environ.items() if not name.startswith("KERAS_DTENSOR_MIXFIX")}
    env["KERAS_DTENSOR_MIXFIX"] = "0"  # the script patches itself
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr",
                           "127.0.0.1", "--master-port", str(port), str(script)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=pathlib.Path(__file__).parent)
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for case in ("cuda_plain", "cpu_scalar", "cuda_after_errors"):
        assert out[case] == ["ok", "cuda:0"], (case, out[case])
    assert out["cuda_values"] is True and out["cpu_scalar_values"] is True and out["moved_scalar_values"] is True
    refused = {"cpu_matrix": ("cpu", "cuda:0"), "other_gpu": ("cuda:1", "cuda:0"),
               "write_into_cpu_plain": ("cpu", "cuda:0"), "foreach_cpu_plain": ("cpu", "cuda:0"),
               "local_rule": ("cpu", "cuda:0")}
    for case, (plain, local) in refused.items():
        kind, text = out[case]
        assert kind == "MixedOperandError", (case, out[case])
        assert f"the plain operand is on {plain}, but the DTensor's local pieces are on {local}" in text, (case, text)
        assert "DeviceMesh('cuda', [0, 1])" in text, (case, text)

"""The patch state seen from the threads backward runs on.

On CUDA, autograd runs backward on its own device threads; on CPU, on the thread that calls ``backward()``.
A ``threading.Thread`` that calls ``backward()`` stands for a device thread here: it is a thread that did not
enter ``patched(...)`` itself. A custom autograd Function's backward records what it sees (patched?, the
options in force) and runs a mixed op (its DTensor gradient times a plain tensor), as a backward that meets a
plain tensor does. The package's state is process-wide (one snapshot, ``_engine/context.py``), so every thread
sees what any thread set with ``patch()``/``patched(...)``; torch's ``implicit_replication()`` is a C++
thread-local that a new Python thread does not see (it reaches autograd's own device threads through
``at::ThreadLocalState``, snapshotted at ``backward()``).
"""

from __future__ import annotations

import threading

from keras_dtensor_mixfix.testing import run_on_ranks


def backward_in_other_threads():
    import torch
    from torch.distributed.tensor import Shard

    import keras_dtensor_mixfix as mf
    from _ranks import shard
    from keras_dtensor_mixfix.testing import mesh

    m = mesh()
    torch.manual_seed(0)
    w, plain = torch.randn(8, 4), torch.randn(8, 4)
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1.0

        @staticmethod
        def backward(ctx, grad):
            options = mf.current_options()
            seen.append((threading.current_thread().name, mf.is_patched(), options.default, options.check))
            return grad * plain  # a mixed op born in backward

    def backward_in(name, loss):
        errors = []

        def run():
            try:
                loss.backward()
            except Exception as exc:  # noqa: BLE001 - the error is the result
                errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0]}")

        thread = threading.Thread(target=run, name=name)
        thread.start()
        thread.join()
        return errors

    def fresh():
        return shard(w, m, [Shard(0)], True)

    out = {}
    mf.unpatch()
    # 1. forward and backward's thread both inside the main thread's patched(...): the options reach backward
    dt = fresh()
    with mf.patched(default="replicate", check="warn"):
        out["errors_inside"] = backward_in("backward-inside", Probe.apply(dt).sum())
    out["grad_inside"] = torch.equal(dt.grad.full_tensor(), plain)
    # 2. forward with no mixed op while unpatched; patched only around a backward run on another thread
    dt = fresh()
    loss = Probe.apply(dt).sum()
    with mf.patched(check="warn"):
        out["errors_backward_only"] = backward_in("backward-only", loss)
    out["grad_backward_only"] = torch.equal(dt.grad.full_tensor(), plain)
    # 3. patched() entered by one thread is in force for all: the main thread's backward sees it
    entered, release = threading.Event(), threading.Event()

    def hold_patched():
        with mf.patched(default="replicate", check="warn"):
            entered.set()
            release.wait(60)

    holder = threading.Thread(target=hold_patched, name="holder")
    holder.start()
    entered.wait(60)
    dt = fresh()
    Probe.apply(dt).sum().backward()
    release.set()
    holder.join()
    out["grad_other_thread_patched"] = torch.equal(dt.grad.full_tensor(), plain)
    # 4. torch's implicit_replication() in the main thread does not reach a new thread's backward: unpatched,
    #    the mixed op there raises torch's error; patched, it runs
    from torch.distributed.tensor.experimental import implicit_replication

    dt = fresh()
    loss = Probe.apply(dt).sum()
    with implicit_replication():
        out["errors_torch_switch_only"] = backward_in("torch-switch", loss)
    out["unpatched_after"] = not mf.is_patched()
    out["seen"] = seen
    return out


def test_backward_on_another_thread_sees_the_patch_and_options_set_around_it():
    out = run_on_ranks(backward_in_other_threads, world_size=2)[0]
    assert out["errors_inside"] == [] and out["grad_inside"] is True
    assert out["errors_backward_only"] == [] and out["grad_backward_only"] is True
    assert out["grad_other_thread_patched"] is True
    assert out["unpatched_after"] is True
    assert len(out["errors_torch_switch_only"]) == 1 and "mixed torch.Tensor and DTensor" in \
        out["errors_torch_switch_only"][0], out["errors_torch_switch_only"]
    assert out["seen"][:3] == [("backward-inside", True, "replicate", "warn"),
                               ("backward-only", True, "replicate", "warn"),
                               ("MainThread", True, "replicate", "warn")], out["seen"]
    assert out["seen"][3][:2] == ("torch-switch", False)

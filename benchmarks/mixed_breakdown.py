"""Where the time of one mixed op goes: the floor of the dispatch-rule design, measured.

    python benchmarks/mixed_breakdown.py

World size 1, 64x64 float32, ``a * plain`` with ``a`` Shard(0). Every row is microseconds per call
(min of 9 repeats of 20000 calls, timeit), all in one process:

- torch's own costs: the pure DTensor op through ``Tensor.__mul__`` and through ``OpOverload._op``
  (how a dispatch rule must re-call the op), and the mixed op under ``implicit_replication()``;
- the floors of a per-op dispatch rule: a rule (our scan) whose handler returns a ready DTensor
  (entering Python from the dispatcher and back); one whose handler re-calls the op with two
  ready DTensors (entry + re-dispatch: the best any design that re-dispatches can do); one whose
  handler runs the op on the local tensors and wraps the result (what a direct plan does);
- ours: the patched mixed op with direct plans (the default) and with ``direct=False`` (every
  call promoted and re-dispatched); the difference to the matching floor is our own work.
"""

from __future__ import annotations

import os
import socket
import timeit

os.environ["KERAS_DTENSOR_MIXFIX"] = "0"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication

    import keras_dtensor_mixfix as mf
    from keras_dtensor_mixfix._lifecycle.intercept import DispatchRuleInterceptor

    mesh = init_device_mesh("cpu", (1,))
    a = distribute_tensor(torch.randn(64, 64), mesh, [Shard(0)])
    b = distribute_tensor(torch.randn(64, 64), mesh, [Shard(0)])
    plain = torch.randn(64, 64)
    op = torch.ops.aten.mul.Tensor
    names = {"a": a, "b": b, "plain": plain, "op": op, "opc": op._op, "DTensor": DTensor, "spec": a._spec,
             "local": a._local_tensor}

    def t(label: str, stmt: str, n: int = 20000) -> float:
        value = min(timeit.repeat(stmt, globals=names, number=n, repeat=9)) / n * 1e6
        print(f"{value:8.2f} us  {label}")
        return value

    print(f"torch {torch.__version__}, world size 1, 64x64 float32, min of 9 x 20000 calls")
    pure = t("pure DTensor op a * b (Tensor.__mul__)", "a * b")
    t("pure DTensor op via OpOverload._op(a, b) (how a rule re-calls)", "opc(a, b)")
    with implicit_replication():
        implicit = t("mixed a * plain under implicit_replication()", "a * plain")
    t("DTensor construction from a ready spec (C++ constructor only)",
      "DTensor.__new__(DTensor, local, spec, requires_grad=False)")

    floor = DispatchRuleInterceptor(lambda func, args, kwargs: b)
    floor.install()
    entry = t("floor: rule + handler that returns a ready DTensor (entry into Python and back)", "a * plain")
    floor.remove()
    floor = DispatchRuleInterceptor(lambda func, args, kwargs: names["opc"](a, b))
    floor.install()
    redispatch = t("floor: rule + handler that re-calls the op on two ready DTensors", "a * plain")
    floor.remove()
    spec = (a * b)._spec
    local = a._local_tensor
    new = torch.Tensor._dtensor__new__
    floor = DispatchRuleInterceptor(lambda func, args, kwargs: new(DTensor, names["opc"](local, plain), spec,
                                                                   requires_grad=False))
    floor.install()
    local_floor = t("floor: rule + handler that runs the op on the local tensors and wraps the result", "a * plain")
    floor.remove()

    c = distribute_tensor(torch.randn(64, 64), mesh, [Shard(0)])
    names["c"] = c
    inplace = t("pure in-place DTensor op c.copy_(b), unpatched", "c.copy_(b)")
    floor = DispatchRuleInterceptor(lambda func, args, kwargs: b)
    floor._rule = floor._write_rule = lambda cls, func, types, args, kwargs: NotImplemented
    floor.install()
    inplace_floor = t("pure in-place c.copy_(b) with a do-nothing rule (torch calling into Python per op)",
                      "c.copy_(b)")
    floor.remove()
    mf.patch()
    inplace_ours = t("pure in-place c.copy_(b), patched", "c.copy_(b)")
    pure_ours = t("pure DTensor op a * b, patched", "a * b")
    mf.unpatch()

    mf.patch(direct=False)
    promoted = t("ours, direct=False: promote, re-dispatch", "a * plain")
    mf.unpatch()
    mf.patch()
    mixed = t("ours, default: direct plan (after the first call)", "a * plain")
    mf.unpatch()
    print()
    print(f"entry (floor 1)                             ~{entry:.2f} us")
    print(f"our work over the local floor (direct)      ~{mixed - local_floor:.2f} us")
    print(f"our work over the re-dispatch floor         ~{promoted - redispatch:.2f} us")
    print(f"re-dispatch floor / implicit_replication     {redispatch / implicit:.3f}  "
          "(the best P1 any re-dispatching rule reaches)")
    print(f"direct=False / implicit_replication          {promoted / implicit:.3f}")
    print(f"direct / implicit_replication (P1)           {mixed / implicit:.3f}")
    print(f"direct / pure (P2)                           {mixed / pure:.3f}")
    print(f"pure, patched / unpatched (P3)               {pure_ours / pure:.3f}")
    print(f"in-place: do-nothing rule / unpatched        {inplace_floor / inplace:.3f}  (the floor of any per-op rule)")
    print(f"in-place: ours / unpatched (P3b)             {inplace_ours / inplace:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

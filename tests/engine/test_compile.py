"""torch.compile with aot_eager and inductor on CPU: really compiled, equal to eager and to the reference."""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from _ranks import close, mesh_for, placements_for, shard
from keras_dtensor_mixfix.testing import run_on_ranks


def _model(w1, b1, w2, x, mask):
    h = F.linear(x, w1, b1).relu()
    return ((h @ w2) + mask).softmax(dim=-1)


def compiled_forward_backward(world_size, backend):
    import torch._dynamo
    from torch._dynamo.utils import counters

    import keras_dtensor_mixfix as mf

    torch._dynamo.reset()
    counters.clear()
    m = mesh_for(world_size)
    torch.manual_seed(0)
    w1, b1, w2 = torch.randn(16, 8), torch.randn(16), torch.randn(16, 6)
    x, mask = torch.randn(5, 8), torch.randn(5, 6)
    ref = [t.clone().requires_grad_() for t in (w1, b1, w2)]
    rx = x.clone().requires_grad_()
    rout = _model(*ref, rx, mask)
    rout.pow(2).sum().backward()

    def dparams():
        return (shard(w1, m, placements_for(m, 0), True), shard(b1, m, placements_for(m, 0), True),
                shard(w2, m, placements_for(m, 0), True))

    with mf.patched():
        eager_params, compiled_params = dparams(), dparams()
        eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        eager = _model(*eager_params, eager_x, mask)
        eager.pow(2).sum().backward()
        compiled_fn = torch.compile(_model, backend=backend, fullgraph=True)
        compiled = compiled_fn(*compiled_params, compiled_x, mask)
        compiled.pow(2).sum().backward()
        again = compiled_fn(*compiled_params, x, mask)  # steady state: no recompilation for the same shapes

    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1, f"nothing was compiled: {dict(counters['stats'])}"
    close(compiled, eager.full_tensor(), f"{backend} vs eager", rtol=1e-5, atol=1e-6)
    close(compiled, rout.detach(), f"{backend} vs reference", rtol=1e-5, atol=1e-6)
    close(again, rout.detach(), f"{backend} second call")
    for index, (c, e, r) in enumerate(zip(compiled_params, eager_params, ref)):
        close(c.grad, e.grad.full_tensor(), f"{backend} grad {index} vs eager", rtol=1e-5, atol=1e-6)
        close(c.grad, r.grad, f"{backend} grad {index} vs reference", rtol=1e-5, atol=1e-6)
    # the plain input's gradient: plain and exact in eager...
    assert type(eager_x.grad) is torch.Tensor
    close(eager_x.grad, rx.grad, "eager plain input grad")
    # ...while a compiled graph hands it a DTensor whose full value is exact (pinned, documented in
    # docs/rules.md "Gradients": the hook that makes it plain can only be attached to real tensors, and tracing
    # sees fake ones).
    compiled_grad_type = type(compiled_x.grad).__name__
    close(compiled_x.grad, rx.grad, f"{backend} plain input grad value (full_tensor)")
    return graphs, compiled_grad_type, dict(counters["stats"]).get("unique_graphs")


@pytest.mark.parametrize("world_size, backend", [
    (2, "aot_eager"), (2, "inductor"), (4, "aot_eager"),
    # the 2x2 mesh traces to the graph aot_eager checks above; inductor only lowers it (48 s of 4 ranks on 2 cores)
    pytest.param(4, "inductor", marks=pytest.mark.slow(
        reason="the 2x2 trace is aot_eager's case; inductor's lowering runs on 2 ranks")),
], ids=["2-aot_eager", "2-inductor", "4-aot_eager", "4-inductor"])
def test_compiled_function_is_compiled_and_equal_to_eager(world_size, backend):
    results = run_on_ranks(compiled_forward_backward, world_size, backend, world_size=world_size, timeout=600)
    graphs, grad_type, _ = results[0]
    assert graphs >= 1
    assert grad_type == "DTensor"  # pinned: see docs/rules.md "Gradients"

"""Clear errors where promotion is impossible; identical behaviour where torch already works."""

from __future__ import annotations

import torch

from _differential import assert_conformant, differential
from _ranks import mesh_for, placements_for, shard
from keras_dtensor_mixfix.testing import run_on_ranks

# An op with two tensor inputs and no DTensor sharding strategy (defined at import, before any
# patch(), like a library's custom kernel).
_lib = torch.library.Library("mixfix_test", "DEF")
_lib.define("fused(Tensor a, Tensor b) -> Tensor")
_lib.impl("fused", lambda a, b: a * 2 + b, "CompositeExplicitAutograd")


def _error_text(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - we return the error for inspection in the parent
        return type(exc).__name__, str(exc)
    return None, "no error"


def error_cases(world_size):
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import Shard

    m = mesh_for(world_size)
    torch.manual_seed(0)
    w = torch.randn(8, 4)
    dw = shard(w, m, placements_for(m, 0))
    local_shaped = torch.randn(*dw.to_local().shape)
    out = {}
    with mf.patched():
        out["looks_local"] = _error_text(lambda: dw * local_shaped)
        out["incompatible"] = _error_text(lambda: dw * torch.randn(3, 5))
        out["no_strategy"] = _error_text(lambda: torch.ops.mixfix_test.fused(dw, torch.randn(8, 4)))
        with mf.register_rule("aten::mul.Tensor", "error"):
            out["error_rule"] = _error_text(lambda: dw * torch.randn(8, 4))
        if world_size == 4:
            a = shard(torch.randn(4), m["dp"], [Shard(0)])
            b = shard(torch.randn(4), m["tp"], [Shard(0)])
            out["two_meshes"] = _error_text(lambda: torch.ops.aten.addcmul.default(a, b, torch.randn(4)))
        with mf.patched(default="local"):
            out["local_requires_grad"] = _error_text(lambda: dw * local_shaped.clone().requires_grad_())
    while mf.is_patched():
        mf.unpatch()
    # after unpatch the mixed op raises torch's own error again
    out["unpatched"] = _error_text(lambda: dw * torch.randn(8, 4))
    return out


def test_errors_name_op_operand_shapes_placements_mesh_and_the_fix(world_size):
    out = run_on_ranks(error_cases, world_size, world_size=world_size)[0]

    kind, text = out["looks_local"]
    assert kind == "MixedOperandError"
    for needle in ["aten::mul.Tensor", "args[1]", "local shard", "shape (", "placements (", "DeviceMesh('cpu'",
                   "register_rule", "'local'"]:
        assert needle in text, (needle, text)

    kind, text = out["incompatible"]
    assert kind == "MixedOperandError" and "aten::mul.Tensor" in text and "(3, 5)" in text and "broadcast" in text, text

    kind, text = out["no_strategy"]
    assert kind == "MixedOperandError" and "mixfix_test::fused" in text and "full_tensor()" in text, text
    assert "sharding strategy" in text, text  # tests/patterns/test_reported_patterns.py follows this advice

    kind, text = out["error_rule"]
    assert kind == "MixedOperandError" and "rule for this op is 'error'" in text, text

    kind, text = out["local_requires_grad"]
    assert kind == "MixedOperandError" and "requires grad" in text and "DTensor.from_local" in text, text

    if world_size == 4:
        kind, text = out["two_meshes"]
        assert kind == "MixedOperandError" and "different meshes" in text and "'dp'" in text and "'tp'" in text, text

    kind, text = out["unpatched"]
    assert (kind == "RuntimeError" and "got mixed torch.Tensor and DTensor" in text
            and "keras_dtensor_mixfix" not in text)


# --------------------------------------------------------------------------- identity


def program_that_already_runs(world_size):
    """A program torch runs without the patch (no mixed operand reaches its error): values, placements, grads.

    Patched, it also returns what was promoted: nothing, or the patched record differs from the unpatched one.
    """
    from torch.distributed.tensor import Replicate, Shard

    import keras_dtensor_mixfix as mf

    m = mesh_for(world_size)
    a, b = torch.randn(8, 6), torch.randn(8, 6)
    da = shard(a, m, placements_for(m, 0), True)
    db = shard(b, m, placements_for(m, 1), True)
    dr = shard(b, m, [Replicate()] * m.ndim)
    y = (da * db + dr).relu() @ shard(torch.randn(6, 3), m, placements_for(m, 1))
    results = {
        "y": y,
        "one-element plain": da * torch.tensor(3.0),  # torch promotes a one-element plain tensor itself
        "cat": torch.cat([da, dr], dim=0),
        "stack": torch.stack([da.sum(), db.sum()]),
        "plain only": torch.randn(5, 5) @ torch.randn(5, 5),
        "partial": shard(a, m, [Shard(0)] * m.ndim).sum(dim=0),
    }
    (y * y).mean().backward()
    results.update(da_grad=da.grad, db_grad=db.grad, promoted=mf.stats() if mf.is_patched() else {})
    return results


def programs_already_running(world_size):
    return differential(program_that_already_runs, world_size)


def test_programs_that_already_run_are_unchanged(world_size):
    answer = assert_conformant(run_on_ranks(programs_already_running, world_size, world_size=world_size))
    assert answer["refused"] is None and answer["reference"], answer

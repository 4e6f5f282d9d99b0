"""Differential conformance: real DTensor programs with no mixed op give identical results patched and unpatched.

The promise under test (docs/rules.md): a program that already runs without the plugin behaves bit
for bit the same after ``patch()``. Each program below runs inside the rank workers unpatched, then
patched, from the same seeds (``tests/_differential.py``: ``differential``), and every value, placement,
gradient (type and value), collective count and DTensor op seen by ``CommDebugMode`` must be
identical: bit equality, not allclose. 2 ranks use a 1-D mesh; 4 ranks the 2x2 ("dp", "tp") mesh of
``_ranks.mesh_for``, or a 1-D mesh of 4 for the FSDP2-only programs. Besides the differential
programs, a few tests check by events what other code relies on: other libraries' DTensor rules (7),
torch.compile's cache key tag and a graph compiled while patched, called after ``unpatch()`` (9).
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _differential import COMPILED_RUNS, assert_conformant, current_run, differential, restored_patch_state, set_patched
from _ranks import mesh_for, placements_for, rank, shard
from keras_dtensor_mixfix.testing import mesh, run_on_ranks

MIXED_ERROR = "got mixed torch.Tensor and DTensor"


def _check(program, world_size, *args, runs=None, timeout=300, **kwargs):
    """Run ``program`` differentially on ``world_size`` ranks and assert it conforms; rank 0's answer."""
    options = {} if runs is None else {"runs": runs}
    return assert_conformant(run_on_ranks(differential, program, world_size, *args, world_size=world_size,
                                          timeout=timeout, **options, **kwargs))


def _replicate(m):
    from torch.distributed.tensor import Replicate

    return [Replicate()] * m.ndim


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step, rows=4, features=8, outputs=4):
    """This rank's own batch (data parallel): differs per rank and step, equal across runs."""
    generator = torch.Generator().manual_seed(1000 + 17 * rank() + step)
    return torch.randn(rows, features, generator=generator), torch.randn(rows, outputs, generator=generator)


def _optimizer_state(opt):
    return {index: dict(state) for index, state in opt.state_dict()["state"].items()}


# --------------------------------------------------------------------------- 1. FSDP2


def fsdp_training(world_size, optimizer):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _mlp()
    m = mesh()  # 1-D over every rank
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=m)
    fully_shard(model, mesh=m)
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for step in range(3):
        x, y = _batch(step)
        x.requires_grad_()  # its plain gradient is compared too
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if step < 2:  # the last step's gradients are compared too
            opt.zero_grad()
        losses.append((loss.detach(), x))
    return {"losses": losses, "params": dict(model.named_parameters()), "state": _optimizer_state(opt)}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fsdp2_fully_shard_training(world_size, optimizer):
    answer = _check(fsdp_training, world_size, optimizer)
    assert answer["comm_counts"], "FSDP2 ran no collective: the program does not test what it says"


# --------------------------------------------------------------------------- 2. tensor + sequence parallel


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(F.relu(self.up(self.norm(x))))


def tensor_parallel_training(world_size):
    """Sequence + tensor parallel on a 1-D mesh of every rank; on 4 ranks 2-D: TP over "tp" and FSDP2 over "dp"."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    torch.manual_seed(0)
    model = _Block()
    m = mesh_for(world_size)
    tp_mesh = m["tp"] if m.ndim == 2 else m
    parallelize_module(model, tp_mesh, {
        "norm": SequenceParallel(),                        # each rank holds its slice of the sequence
        "up": ColwiseParallel(input_layouts=Shard(1)),     # all-gather the sequence, shard the features
        "down": RowwiseParallel(output_layouts=Shard(1)),  # reduce-scatter back to sequence shards
    })
    if m.ndim == 2:
        fully_shard(model, mesh=m["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    outputs = []
    for step in range(2):
        generator = torch.Generator().manual_seed(2000 + 17 * rank() + step)
        # (batch, this rank's 2 sequence positions, features); requires grad: its plain gradient is compared
        x = torch.randn(2, 2, 8, generator=generator).requires_grad_()
        out = model(x)
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
        if step == 0:
            opt.zero_grad()
        outputs.append((out.detach(), loss.detach(), x))
    return {"outputs": outputs, "params": dict(model.named_parameters()), "state": _optimizer_state(opt)}


def test_parallelize_module_colwise_rowwise_sequence_parallel(world_size):
    answer = _check(tensor_parallel_training, world_size)
    assert answer["comm_counts"]


# --------------------------------------------------------------------------- 3. distribute_module


def _shard_linear(name, module, device_mesh):
    from torch.distributed.tensor import Replicate, distribute_tensor

    if isinstance(module, nn.Linear):
        module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), device_mesh,
                                                       placements_for(device_mesh, 0)))
        module.bias = nn.Parameter(distribute_tensor(module.bias.detach(), device_mesh,
                                                     [Replicate()] * device_mesh.ndim))


def _replicated_input(module, inputs, device_mesh):
    from torch.distributed.tensor import DTensor

    return tuple(DTensor.from_local(x, device_mesh, _replicate(device_mesh)) for x in inputs)


def _gathered_output(module, output, device_mesh):
    return output.redistribute(device_mesh, _replicate(device_mesh)).to_local()


def distribute_module_training(world_size):
    from torch.distributed.tensor import distribute_module

    torch.manual_seed(0)
    m = mesh_for(world_size)
    model = distribute_module(nn.Linear(8, 6), m, _shard_linear, _replicated_input, _gathered_output)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    outputs = []
    for step in range(2):
        x = torch.randn(5, 8).requires_grad_()  # the same on every rank: the input is replicated
        out = model(x)
        out.sin().sum().backward()
        opt.step()
        if step == 0:
            opt.zero_grad()
        outputs.append((out.detach(), x))  # x's plain gradient is compared too
    return {"outputs": outputs, "params": dict(model.named_parameters()), "state": _optimizer_state(opt)}


def test_distribute_module_linear(world_size):
    _check(distribute_module_training, world_size)


# --------------------------------------------------------------------------- 4. GradScaler


def grad_scaler_training(world_size, inf_rank, inf_step):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _mlp()
    fully_shard(model, mesh=mesh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
    steps = []
    for step in range(3):
        x, y = _batch(step)
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if step == inf_step and rank() == inf_rank:
            grad = model[0].weight.grad  # a Shard(0) DTensor: only this rank's shard turns inf
            with torch.no_grad():
                grad.to_local()[0, 0] = math.inf
        before = [p.detach().to_local().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        stepped = any(not torch.equal(b, p.detach().to_local()) for b, p in zip(before, model.parameters()))
        if step < 2:
            opt.zero_grad()
        steps.append({"loss": loss.detach(), "stepped": stepped, "scale": scaler.get_scale()})
    return {"steps": steps, "params": dict(model.named_parameters())}


def test_grad_scaler_skips_the_step_on_every_rank_when_one_shard_has_inf(world_size):
    inf_rank, inf_step = world_size - 1, 1
    answers = run_on_ranks(differential, grad_scaler_training, world_size, inf_rank, inf_step,
                           world_size=world_size)
    # the reference itself: every rank skipped exactly the step where one rank's shard held inf
    for r, answer in enumerate(answers):
        stepped = [answer["reference"][f"result['steps'][{s}]['stepped']"] for s in range(3)]
        assert stepped == ["True", "False", "True"], (r, stepped)
    assert_conformant(answers)


# --------------------------------------------------------------------------- 5. clip_grad_norm_


def _dtensor_params_with_grads(m, seed):
    from torch.distributed.tensor import Replicate, Shard

    torch.manual_seed(seed)
    specs = [((8, 6), placements_for(m, 0)), ((6, 4), placements_for(m, 1)), ((6,), [Replicate()] * m.ndim),
             ((8, 4), [Shard(0)] * m.ndim)]
    params = [shard(torch.randn(shape), m, placements, True) for shape, placements in specs]
    for p, (shape, placements) in zip(params, specs):
        p.grad = shard(torch.randn(shape) * 3, m, placements)
    return params


def clip_grad_norm(world_size, foreach, norm_type):
    m = mesh_for(world_size)
    params = _dtensor_params_with_grads(m, 3)
    total = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0, norm_type=norm_type, foreach=foreach)
    again = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0, norm_type=norm_type, foreach=foreach)
    return {"params": params, "total": total, "again": again}


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm(world_size, foreach, norm_type):
    _check(clip_grad_norm, world_size, foreach, norm_type)


# --------------------------------------------------------------------------- 6. every optimizer

OPTIMIZERS = {
    "SGD": dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": dict(lr=0.01, weight_decay=0.01),
    "AdamW": dict(lr=0.01, amsgrad=True),
    "Adagrad": dict(lr=0.1),
    "Adadelta": dict(lr=1.0),
    "Adamax": dict(lr=0.01),
    "NAdam": dict(lr=0.01),
    "RAdam": dict(lr=0.01),
    "RMSprop": dict(lr=0.01, momentum=0.5, centered=True),
    "Rprop": dict(lr=0.01),
    "ASGD": dict(lr=0.01),
}
FUSED_ON_CPU = {"SGD", "Adam", "AdamW", "Adagrad"}  # the optimizers with a CPU fused kernel in torch 2.13
# Some optimizer forms torch's DTensor cannot run at all on some releases (2.13: Rprop's foreach
# _foreach_copy_ and its for-loop index_put_, fused SGD and Adagrad have no sharding strategy). For
# those the differential is on the error: patched must refuse exactly as unpatched torch does.
OPTIMIZER_CASES = [pytest.param(name, form, id=f"{name}-{form}")
                   for form in ("foreach", "for-loop", "fused") for name in OPTIMIZERS
                   if form != "fused" or name in FUSED_ON_CPU]


def optimizer_steps(world_size, name, form):
    m = mesh_for(world_size)
    params = _dtensor_params_with_grads(m, 4)
    mode = {"foreach": dict(foreach=True), "for-loop": dict(foreach=False), "fused": dict(fused=True)}[form]
    opt = getattr(torch.optim, name)(params, **OPTIMIZERS[name], **mode)
    for step in range(2):
        if step:
            torch.manual_seed(5)
            for p in params:
                p.grad = shard(torch.randn(p.shape), m, p.placements)
        opt.step()
    return {"params": params, "state": _optimizer_state(opt)}


@pytest.mark.parametrize("name,form", OPTIMIZER_CASES)
def test_optimizer(world_size, name, form):
    _check(optimizer_steps, world_size, name, form, torch_may_refuse=True)


# --------------------------------------------------------------------------- 7. other libraries' DTensor rules

_op_counter = itertools.count()
_KEPT_OPS = []  # see _define_custom_op


def _define_custom_op():
    """A fresh ``conftest_lib`` custom op of two tensors.

    The op itself stays defined for the worker's life (tiny, and unused afterwards); tests remove
    only the DTensor rules they register (:func:`_register_their_rule`). Destroying ops would let the
    number of registered op names repeat with different names, and the package's cache of hookable
    op names is keyed by that number, so whether ``patch()`` hooks the new op would depend on test
    order.
    """
    name = f"conftest_lib::mixfix_conf_{os.getpid()}_{next(_op_counter)}"

    @torch.library.custom_op(name, mutates_args=())
    def op(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * 2 + y

    @op.register_fake
    def _(x, y):
        return torch.empty_like(x)

    _KEPT_OPS.append(op)
    return op, name


def _register_their_rule(op, registered):
    """``op.register_torch_dispatch(DTensor, _their_rule)``; appends the new registration handles to
    ``registered`` (for :func:`_remove_their_rule`) and returns "ok"."""
    from torch.distributed.tensor import DTensor

    handles = op._lib._registration_handles
    before = len(handles)
    op.register_torch_dispatch(DTensor, _their_rule)
    registered.extend(handles[before:])
    return "ok"


def _remove_their_rule(op, registered):
    from torch.distributed.tensor import DTensor

    for handle in registered:
        handle.destroy()
        op._lib._registration_handles.remove(handle)
    op._torch_dispatch_fns.pop(DTensor, None)


def _their_rule(cls, func, types, args, kwargs):
    """Another library's DTensor rule: runs on the local tensors and marks the result (+100)."""
    from torch.distributed.tensor import DTensor

    x, y = args
    local = x.to_local() * 2 + y.to_local() + 100
    return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False)


def _their_rule_found(qualname):
    from torch._library import simple_registry
    from torch.distributed.tensor import DTensor

    return simple_registry.singleton.find(qualname).torch_dispatch_rules.find(DTensor)


def _attempt(fn):
    """``fn()``'s value, or its exception's type and first line: events are compared, not raised."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the error is the result, compared across runs
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _marked(op, m):
    """Call ``op`` on two DTensors; True if the other library's rule produced the result."""
    x = shard(torch.arange(8.0).reshape(4, 2), m, placements_for(m, 0))
    y = shard(torch.ones(4, 2), m, placements_for(m, 0))
    out = op(x, y)
    return torch.equal(out.full_tensor(), torch.arange(8.0).reshape(4, 2) * 2 + 1 + 100)


def custom_op_rule_registered(world_size, when):
    """A custom op's DTensor rule registered before or after patch(), then unpatch(): a record of what happened."""
    import torch.distributed.tensor  # noqa: F401  (registered after DTensor's import in both cases)

    m = mesh_for(world_size)
    events = {}
    registered = []
    with restored_patch_state():
        set_patched(False)
        op, qualname = _define_custom_op()  # the op exists before patch() in both cases
        try:
            if when == "before patch":
                events["register"] = _attempt(lambda: _register_their_rule(op, registered))
                set_patched(True)
            else:
                set_patched(True)
                events["register"] = _attempt(lambda: _register_their_rule(op, registered))
            events["patched call uses their rule"] = _attempt(lambda: _marked(op, m))
            set_patched(False)
            events["registration kept after unpatch"] = _their_rule_found(qualname) is not None
            events["unpatched call uses their rule"] = _attempt(lambda: _marked(op, m))
        finally:
            _remove_their_rule(op, registered)
    events["removed with their handle"] = _their_rule_found(qualname) is None
    return events


@pytest.mark.parametrize("when", ["before patch", "after patch"])
def test_custom_op_dtensor_rule_registered_by_another_library(world_size, when):
    events = run_on_ranks(custom_op_rule_registered, world_size, when, world_size=world_size)[0]
    expected = {"register": "ok", "patched call uses their rule": True, "registration kept after unpatch": True,
                "unpatched call uses their rule": True, "removed with their handle": True}
    assert events == expected, f"\n  got      {events}\n  expected {expected}"


def aten_rule_registered_after_patch(world_size):
    """Another library registers a DTensor rule for an aten op (aten::dist) while patched."""
    from torch.distributed.tensor import DTensor

    def their_dist(cls, func, types, args, kwargs):
        return torch.tensor(-42.0)  # a marker no real distance takes

    m = mesh_for(world_size)
    x = shard(torch.randn(4, 6), m, placements_for(m, 0))
    y = shard(torch.randn(4, 6), m, placements_for(m, 0))
    events = {}
    lib = torch.library.Library("aten", "FRAGMENT")
    with restored_patch_state():
        try:
            set_patched(True)
            events["register"] = _attempt(
                lambda: torch.library.register_torch_dispatch("aten::dist", DTensor, their_dist, lib=lib) and "ok")
            events["patched dist"] = _attempt(lambda: float(torch.dist(x, y)))
            set_patched(False)
            events["registration kept after unpatch"] = _their_rule_found("aten::dist") is their_dist
            events["unpatched dist"] = _attempt(lambda: float(torch.dist(x, y)))
        finally:
            lib._destroy()
    events["removed with their library"] = _their_rule_found("aten::dist") is None
    return events


def test_aten_dtensor_rule_registered_after_patch(world_size):
    events = run_on_ranks(aten_rule_registered_after_patch, world_size, world_size=world_size)[0]
    expected = {"register": "ok", "patched dist": -42.0, "registration kept after unpatch": True,
                "unpatched dist": -42.0, "removed with their library": True}
    assert events == expected, f"\n  got      {events}\n  expected {expected}"


_differential_op = None


def custom_op_program(world_size):
    m = mesh_for(world_size)
    torch.manual_seed(0)
    x = shard(torch.randn(4, 6), m, placements_for(m, 0), True)
    y = shard(torch.randn(4, 6), m, placements_for(m, 0))
    out = _differential_op(x.detach(), y)
    return {"out": out, "marked": torch.equal(out.full_tensor(), x.full_tensor() * 2 + y.full_tensor() + 100)}


def custom_op_differential(world_size):
    """The rule is registered before the runs (so before patch()); unpatched and patched must agree."""
    global _differential_op
    registered = []
    with restored_patch_state():
        set_patched(False)
        op, _ = _define_custom_op()
        _register_their_rule(op, registered)
        _differential_op = op
        try:
            return differential(custom_op_program, world_size)
        finally:
            _differential_op = None
            _remove_their_rule(op, registered)


def test_custom_op_with_its_own_dtensor_rule_is_unchanged(world_size):
    answer = assert_conformant(run_on_ranks(custom_op_differential, world_size, world_size=world_size))
    assert answer["reference"]["result['marked']"] == "True"


# --------------------------------------------------------------------------- 8. implicit_replication


def implicit_replication_program(world_size, case):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.experimental import implicit_replication

    m = mesh_for(world_size)
    torch.manual_seed(0)
    with implicit_replication():
        if case == "scatter_add":
            dt = shard(torch.randn(8, 6), m, [Shard(0)] * m.ndim)
            index = torch.randint(0, 8, (5, 6))
            src = torch.randn(5, 6)
            return {"out": dt.scatter_add(0, index, src)}
        dt = shard(torch.randn(8, 6), m, placements_for(m, 0), True)
        plain = torch.randn(8, 6)
        row = torch.randn(6)
        out = dt * plain + row
        out.sum().backward()
        return {"out": out, "dt": dt, "inplace": dt.detach().clone().mul_(plain).add_(row)}


@pytest.mark.parametrize("case", ["scatter_add", "mul_add"])
def test_implicit_replication_mixed_ops(world_size, case):
    _check(implicit_replication_program, world_size, case)


# --------------------------------------------------------------------------- 9. torch.compile


def _pure_dtensor_fn(w, b, x):
    h = torch.tanh(x @ w + b)
    return (h * h).sum(dim=-1)


def compiled_program(world_size, backend):
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    m = mesh_for(world_size)
    torch.manual_seed(0)
    w = shard(torch.randn(8, 6), m, placements_for(m, 1), True)
    b = shard(torch.randn(6), m, placements_for(m, 0), True)
    x = shard(torch.randn(5, 8), m, _replicate(m), True)
    fn = torch.compile(_pure_dtensor_fn, backend=backend)
    out = fn(w, b, x)
    out.sum().backward()
    again = fn(w, b, x)
    return {"out": out, "again": again, "w": w, "b": b, "x": x,
            "unique_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "stats": dict(counters["stats"])}


# inductor's first compile in a worker costs ~10 s of CPU per rank (imports, g++), so it runs on 2 ranks; the
# 2x2 mesh is traced by aot_eager (the same dynamo/AOT graphs, without inductor's code generation).
COMPILE_CASES = [(2, "aot_eager"), (4, "aot_eager"), (2, "inductor")]


@pytest.mark.parametrize("world_size,backend", COMPILE_CASES, ids=[f"{b}-{w}" for w, b in COMPILE_CASES])
def test_compiled_pure_dtensor_function(world_size, backend):
    answer = _check(compiled_program, world_size, backend, runs=COMPILED_RUNS, timeout=600)
    assert answer["reference"]["result['unique_graphs']"] != "0", "nothing was compiled"


def compile_cache_tag(world_size):
    import keras_dtensor_mixfix as mf

    with restored_patch_state():
        set_patched(False)
        before = torch.compiler.config.cache_key_tag
        mf.patch()
        during = torch.compiler.config.cache_key_tag
        mf.unpatch()
        after = torch.compiler.config.cache_key_tag
    return before, during, after


def test_patch_leaves_compile_cache_key_tag_alone():
    before, during, after = run_on_ranks(compile_cache_tag, 2, world_size=2)[0]
    assert during == before, f"patch() changed torch.compiler.config.cache_key_tag from {before!r} to {during!r}"
    assert after == before


def _mixed_fn(dt, plain):
    return (dt * plain).sin()


def compiled_mixed_after_unpatch(world_size):
    import torch._dynamo

    m = mesh_for(world_size)
    torch.manual_seed(0)
    dt = shard(torch.randn(4, 6), m, placements_for(m, 0))
    plain = torch.randn(4, 6)

    def outcome(fn):
        try:
            fn(dt, plain)
        except Exception as exc:  # noqa: BLE001 - the error is the result
            return type(exc).__name__, MIXED_ERROR in str(exc)
        return "ran", False

    with restored_patch_state():
        set_patched(False)
        torch._dynamo.reset()
        unpatched = outcome(torch.compile(_mixed_fn, backend="aot_eager"))
        torch._dynamo.reset()  # only before the patched compile
        set_patched(True)
        compiled = torch.compile(_mixed_fn, backend="aot_eager")
        patched = outcome(compiled)
        set_patched(False)
        after_unpatch = outcome(compiled)
        torch._dynamo.reset()
    return {"unpatched": unpatched, "patched": patched, "after unpatch": after_unpatch}


def test_function_compiled_with_a_mixed_op_while_patched_raises_after_unpatch(world_size):
    outcomes = run_on_ranks(compiled_mixed_after_unpatch, world_size, world_size=world_size, timeout=600)[0]
    assert outcomes["unpatched"][1], f"unpatched torch did not raise the mixed-operand error: {outcomes}"
    assert outcomes["patched"] == ("ran", False), outcomes
    assert outcomes["after unpatch"] == outcomes["unpatched"], outcomes


# --------------------------------------------------------------------------- 10. random ops


def random_program(world_size):
    """DTensor random ops. On a cpu mesh torch 2.13 has no RNG tracker: each rank draws its local
    values from its own default generator (what torch does unpatched, and what must not change).
    The factories ``torch.distributed.tensor.randn``/``rand`` are not here: they need that tracker, so on
    the cpu meshes of these tests they raise before any op runs, patched or not."""
    from torch.distributed.tensor import Shard

    m = mesh_for(world_size)
    torch.manual_seed(7)
    a = shard(torch.ones(8, 6), m, placements_for(m, 0))
    b = shard(torch.ones(8, 6), m, [Shard(1)] * m.ndim)
    x = shard(torch.randn(8, 6), m, placements_for(m, 1), True)
    torch.manual_seed(8)
    y = F.dropout(x, p=0.3, training=True)
    y.sum().backward()
    return {"dropout": F.dropout(a, p=0.5, training=True), "uniform_": b.clone().uniform_(-1, 1),
            "normal_": a.clone().normal_(), "rand_like": torch.rand_like(b), "randn_like": torch.randn_like(a),
            "bernoulli": torch.bernoulli(a * 0.5), "y": y, "x": x, "cpu rng after": torch.get_rng_state()}


def test_dtensor_random_ops(world_size):
    _check(random_program, world_size)


# --------------------------------------------------------------------------- 11. redistribute


def redistribute_program(world_size):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    m = mesh_for(world_size)
    torch.manual_seed(0)
    full_value = torch.randn(8, 4)
    out = {}
    s0 = shard(full_value, m, [Shard(0)] * m.ndim, True)
    out["S0->R"] = s0.redistribute(m, _replicate(m))
    out["S0->S1"] = s0.redistribute(m, [Shard(1)] * m.ndim)
    out["R->S0"] = out["S0->R"].redistribute(m, placements_for(m, 0))
    partial = DTensor.from_local(torch.randn(8, 4), m, [Partial()] * m.ndim)  # each rank's own addend
    out["P"] = partial
    out["P->R"] = partial.redistribute(m, _replicate(m))
    out["P->S0"] = partial.redistribute(m, [Shard(0)] * m.ndim)
    out["P(max)->R"] = DTensor.from_local(torch.randn(8, 4), m, [Partial("max")] * m.ndim).redistribute(
        m, _replicate(m))
    if m.ndim == 2:
        out["[S0,S1]->[R,S0]"] = shard(full_value, m, [Shard(0), Shard(1)]).redistribute(m, [Replicate(), Shard(0)])
    out["full"] = s0.full_tensor()
    out["P full"] = partial.full_tensor()
    (out["S0->S1"] * 2).sum().backward()
    out["s0"] = s0
    return out


def test_redistribute_and_full_tensor(world_size):
    answer = _check(redistribute_program, world_size)
    assert answer["comm_counts"]


# --------------------------------------------------------------------------- 12. distributed checkpoint


def checkpoint_program(world_size, directory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    path = os.path.join(directory, current_run().replace(" ", "_").replace(",", ""))

    def sharded_model(seed):
        torch.manual_seed(seed)
        model = _mlp()
        fully_shard(model, mesh=mesh())
        return model

    model = sharded_model(0)
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    saved = model.state_dict()
    dcp.save(saved, checkpoint_id=path)
    fresh = sharded_model(1)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state)
    return {"saved": {k: v.detach() for k, v in saved.items()},
            "loaded": {k: v.detach() for k, v in fresh.state_dict().items()}}


def test_distributed_checkpoint_save_and_load(world_size, tmp_path):
    _check(checkpoint_program, world_size, str(tmp_path))


# --------------------------------------------------------------------------- one-element plain operands


def one_element_program(world_size):
    m = mesh_for(world_size)
    torch.manual_seed(0)
    dt = shard(torch.randn(8, 6), m, placements_for(m, 0), True)
    out = {
        "mul": dt * torch.tensor(2.0),
        "rsub": torch.tensor(3.0) - dt,
        "div 1-D one element": dt / torch.tensor([4.0]),
        "where": torch.where(dt > 0, dt, torch.tensor(0.0)),
        "pow": dt.abs() ** torch.tensor(1.5),
    }
    inplace = dt.detach().clone()
    inplace.add_(torch.tensor(1.0))
    inplace.mul_(torch.tensor([0.5]))
    out["in place"] = inplace
    sum(v.sum() for k, v in out.items() if k != "in place").backward()
    out["dt"] = dt
    return out


def test_one_element_plain_operands_torch_already_accepts(world_size):
    _check(one_element_program, world_size)


# --------------------------------------------------------------------------- the harness can fail


def patch_dependent_program(world_size, what):
    """Behaves differently when patched, in one respect: the harness must report exactly that."""
    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import Shard

    m = mesh_for(world_size)
    torch.manual_seed(0)
    patched = mf.is_patched()
    dt = shard(torch.randn(8, 6), m, placements_for(m, 0), True)
    if what == "value":
        out = dt * (2.0 if patched else 3.0)
    elif what == "placement":
        out = dt.redistribute(m, _replicate(m) if patched else [Shard(0)] * m.ndim)
    elif what == "collective":
        out = dt.redistribute(m, _replicate(m)).redistribute(m, placements_for(m, 0)) if patched else dt * 1
    elif what == "-0.0":
        out = dt * 0 * (-1.0 if patched else 1.0)  # equal under ==, different bits
    else:  # "grad type"
        out = dt.sum()
        out.backward()
        if patched:
            dt.grad = dt.grad.full_tensor()
    return {"out": out.detach(), "dt": dt}


@pytest.mark.parametrize("what,reported", [("value", "values"), ("placement", "placements"),
                                           ("collective", "comm counts"), ("-0.0", "values"), ("grad type", "type")])
def test_harness_reports_a_patch_dependent_program(what, reported):
    answers = run_on_ranks(differential, patch_dependent_program, 2, what, world_size=2)
    diffs = answers[0]["diffs"]
    assert diffs and all("patched" in d for d in diffs), diffs
    assert any(reported in d for d in diffs), diffs
    with pytest.raises(AssertionError, match="patched run differs from unpatched"):
        assert_conformant(answers)

"""Compose, never take over: where torch handles a call itself, patched runs exactly what unpatched runs.

Each rank function runs the same program unpatched and patched in one worker and returns both
outcomes (``_differential.unpatched_and_patched_outcomes``); the test asserts they are identical (values bit for
bit, placements, errors). Where torch refuses a call and the patch promotes it, the result is compared with a plain
reference instead.
"""

from __future__ import annotations

import threading

import pytest
import torch

from _differential import outcome, unpatched_and_patched_outcomes
from _ranks import close, mesh_for, placements_for, shard
from keras_dtensor_mixfix._torch.versions import release_of
from keras_dtensor_mixfix.testing import run_on_ranks


# --------------------------------------------------------------------------- implicit_replication


def _implicit_program(world_size):
    from torch.distributed.tensor.experimental import implicit_replication

    m = mesh_for(world_size)
    torch.manual_seed(0)
    base = shard(torch.zeros(4, 3), m, placements_for(m, 0))
    index = torch.tensor([[0, 1, 2], [1, 2, 0], [0, 0, 0], [2, 2, 2]])
    source = torch.arange(12.0).reshape(4, 3)
    with implicit_replication():
        scattered = base.scatter_add(1, index, source)
        product = base * torch.ones(4, 3) + source
    return scattered, product


def implicit_replication_is_torchs(world_size):
    return unpatched_and_patched_outcomes(_implicit_program, world_size)


def test_implicit_replication_runs_torchs_own_path(world_size):
    for unpatched, patched, promoted in run_on_ranks(implicit_replication_is_torchs, world_size, world_size=world_size):
        assert unpatched[0] == "ok", unpatched
        assert patched == unpatched
        assert promoted == {}


# --------------------------------------------------------------------------- DTensor's custom handlers


def _is_same_size_program(world_size):
    m = mesh_for(world_size)
    dt = shard(torch.ones(4, 4), m, placements_for(m, 0))
    return torch.ops.aten.is_same_size(dt, torch.ones(4, 4)), torch.ops.aten.is_same_size(dt, torch.ones(2, 8))


def custom_handler_accepting_mixed(world_size):
    return unpatched_and_patched_outcomes(_is_same_size_program, world_size)


@pytest.mark.parametrize("world_size", [2])
def test_a_custom_handler_that_accepts_mixed_operands_is_torchs(world_size):
    for unpatched, patched, promoted in run_on_ranks(custom_handler_accepting_mixed, world_size, world_size=world_size):
        assert unpatched == ("ok", (True, False))
        assert patched == unpatched
        assert promoted == {}


def _library_handler_program(world_size):
    from torch.distributed.tensor import DTensor

    m = mesh_for(world_size)
    dt = shard(torch.arange(8.0).reshape(4, 2), m, placements_for(m, 0))
    handlers = DTensor._op_dispatcher._custom_op_handlers
    op = torch.ops.aten.dist.default
    # a library's own handler, added at run time: it takes mixed operands itself
    handlers[op] = lambda func, args, kwargs: torch.tensor(float(args[1].sum()))
    try:
        return torch.dist(dt, torch.ones(4, 2))
    finally:
        del handlers[op]


def custom_handler_added_by_a_library(world_size):
    return unpatched_and_patched_outcomes(_library_handler_program, world_size)


def test_a_custom_handler_added_at_run_time_is_respected():
    for unpatched, patched, promoted in run_on_ranks(custom_handler_added_by_a_library, 2, world_size=2):
        assert unpatched == ("ok", ("Tensor", torch.float32, 8.0))
        assert patched == unpatched
        assert promoted == {}


def convolution_with_a_plain_weight(world_size, batch_split):
    """DTensor's convolution handler refuses a plain weight: that refusal is promoted. The input is split along its
    batch on the first mesh dim, or replicated. (On torch 2.11 a stride equal to the kernel size: its handler refuses
    other replicated convolutions itself, repros/torch_conv_handler_unsplit.py.)"""
    import torch.nn.functional as F

    import keras_dtensor_mixfix as mf
    from torch.distributed.tensor import Replicate, Shard

    m = mesh_for(world_size)
    torch.manual_seed(0)
    kernel = 2 if ON_2_11 else 3
    x, w = torch.randn(4, 4, 8), torch.randn(3, 4, kernel)
    rw = w.clone().requires_grad_()
    reference = F.conv1d(x, rw, stride=kernel if ON_2_11 else 1)
    reference.sum().backward()
    dx = shard(x, m, ([Shard(0)] if batch_split else [Replicate()]) + [Replicate()] * (m.ndim - 1))
    unpatched = outcome(lambda a, b: F.conv1d(a, b, stride=kernel if ON_2_11 else 1), dx, w)
    pw = w.clone().requires_grad_()
    with mf.patched():
        out = F.conv1d(dx, pw, stride=kernel if ON_2_11 else 1)
        out.sum().backward()
    close(out, reference.detach(), "conv1d output")
    assert type(pw.grad) is torch.Tensor
    close(pw.grad, rw.grad, "plain weight grad")
    return unpatched


ON_2_11 = release_of(torch.__version__) == (2, 11)
CONV_BACKWARD_2D_REFUSED = release_of(torch.__version__) in ((2, 14), (2, 15))


@pytest.mark.parametrize("batch_split", [
    True,
    pytest.param(False, marks=pytest.mark.skipif(
        ON_2_11, reason="torch 2.11 gets a replicated input's weight gradient wrong, so the package refuses the mixed "
                        "call there (test_a_convolution_torch_2_11_would_get_wrong_is_refused)")),
])
def test_a_custom_handler_refusing_a_plain_operand_is_promoted(world_size, batch_split):
    if batch_split and world_size == 4 and CONV_BACKWARD_2D_REFUSED:
        pytest.skip("torch 2.14 and 2.15 cannot plan a convolution's backward on a 2-D mesh with a batch-split input, "
                    "with every operand a DTensor too (repros/torch_conv_backward_2d_mesh.py)")
    for unpatched in run_on_ranks(convolution_with_a_plain_weight, world_size, batch_split, world_size=world_size):
        assert unpatched[0] == "raised" and unpatched[3], unpatched  # torch's mixed-operand error


def convolution_refused_on_2_11(world_size):
    """A replicated input and a plain weight that wants a gradient: refused, naming the layout that works; the
    advice followed (the input split along its batch) runs and equals one process."""
    import torch.nn.functional as F

    import keras_dtensor_mixfix as mf
    from keras_dtensor_mixfix import MixedOperandError
    from torch.distributed.tensor import Replicate

    m = mesh_for(world_size)
    torch.manual_seed(0)
    x, w = torch.randn(4, 4, 8), torch.randn(3, 4, 2).requires_grad_()
    dx = shard(x, m, [Replicate()] * m.ndim)
    with mf.patched():
        try:
            F.conv1d(dx, w, stride=2)
        except MixedOperandError as error:
            message = str(error)
        else:
            raise AssertionError("the convolution was promoted")
        with torch.no_grad():  # no gradient asked for: the forward is right, and runs
            close(F.conv1d(dx, w, stride=2), F.conv1d(x, w, stride=2), "conv1d output without grad")
    return message


@pytest.mark.skipif(not ON_2_11, reason="torch 2.11 only: later releases compute the weight gradient right "
                                        "(repros/torch_conv_weight_grad_partial.py)")
def test_a_convolution_torch_2_11_would_get_wrong_is_refused(world_size):
    for message in run_on_ranks(convolution_refused_on_2_11, world_size, world_size=world_size):
        assert "aten::convolution" in message and "Partial" in message and "torch 2.12" in message, message
        assert "x.redistribute(mesh, [Shard(0)]" in message, message


# --------------------------------------------------------------------------- DTensor subclasses


def _subclass_program(world_size):
    from torch.distributed.tensor import DTensor

    class Traced(DTensor):
        seen = []

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            cls.seen.append(str(func))
            unwrapped = [a._local_tensor if isinstance(a, DTensor) else a for a in args]
            return func(*unwrapped, **(kwargs or {}))

    m = mesh_for(world_size)
    dt = shard(torch.arange(16.0).reshape(4, 4), m, placements_for(m, 0))
    sub = torch.Tensor._dtensor__new__(Traced, dt._local_tensor, dt._spec, requires_grad=False)
    out = sub * torch.full(tuple(dt._local_tensor.shape), 2.0)
    return out.tolist(), Traced.seen


def subclass_dispatch(world_size):
    return unpatched_and_patched_outcomes(_subclass_program, world_size)


def test_a_dtensor_subclass_with_its_own_dispatch_is_untouched():
    for unpatched, patched, promoted in run_on_ranks(subclass_dispatch, 2, world_size=2):
        if release_of(torch.__version__) == (2, 11):
            # torch 2.11 dispatches a DTensor subclass as a DTensor (its own __torch_dispatch__ unused): torch's error
            assert unpatched[0] == "raised" and unpatched[3], unpatched
        else:
            assert unpatched[0] == "ok"
        assert patched == unpatched
        assert promoted == {}


# --------------------------------------------------------------------------- torch.compile


def compiled_mixed_call_after_unpatch(from_other_thread):
    import torch._dynamo
    from torch.distributed.tensor import Shard, distribute_tensor

    import keras_dtensor_mixfix as mf

    torch._dynamo.reset()
    m = mesh_for(2)
    dt = distribute_tensor(torch.ones(4, 4), m, [Shard(0)])
    plain = torch.full((4, 4), 2.0)
    fn = torch.compile(lambda a, b: a * b, backend="aot_eager")
    unpatched_first = outcome(fn, dt, plain)
    mf.patch()
    patched_value = fn(dt, plain).full_tensor().sum().item()
    if from_other_thread:
        worker = threading.Thread(target=mf.unpatch)
        worker.start()
        worker.join()
    else:
        mf.unpatch()
    after = outcome(fn, dt, plain)
    return unpatched_first, patched_value, after


@pytest.mark.parametrize("from_other_thread", [False, True])
def test_a_function_compiled_while_patched_raises_like_torch_after_unpatch(from_other_thread):
    for unpatched, value, after in run_on_ranks(compiled_mixed_call_after_unpatch, from_other_thread, world_size=2):
        assert unpatched[0] == "raised" and unpatched[3], unpatched  # torch's mixed-operand error
        assert value == 32.0
        assert after == unpatched


def compile_cache_saves(mixed):
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.distributed.tensor import Shard, distribute_tensor

    import keras_dtensor_mixfix as mf

    torch._dynamo.reset()
    counters.clear()
    m = mesh_for(2)
    dt = distribute_tensor(torch.ones(4, 4), m, [Shard(0)]).requires_grad_()
    other = torch.full((4, 4), 2.0) if mixed else distribute_tensor(torch.full((4, 4), 2.0), m, [Shard(0)])
    with mf.patched():
        fn = torch.compile(lambda a, b: (a * b).sin().sum(), backend="inductor")
        fn(dt, other).backward()
    return dict(counters["aot_autograd"])


def test_only_graphs_that_promote_stay_out_of_the_aot_autograd_cache():
    pure = run_on_ranks(compile_cache_saves, False, world_size=2)[0]
    mixed = run_on_ranks(compile_cache_saves, True, world_size=2)[0]
    # cached exactly as without the package (written now, or served from an entry an earlier test wrote)
    assert pure.get("autograd_cache_saved", 0) + pure.get("autograd_cache_hit", 0) == 1, pure
    assert mixed.get("autograd_cache_saved", 0) == 0 and mixed.get("autograd_cache_hit", 0) == 0, mixed
    assert mixed.get("autograd_cache_miss", 0) == 1, mixed

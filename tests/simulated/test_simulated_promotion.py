"""Every promotion path at the scale users run, under torch's rank simulator, against plain math.

torch's ``fake`` process group with ``LocalTensorMode(N)`` holds every simulated rank's value in this one process, and
collectives combine them (torch's own ``LocalDTensorTestBase`` tests run this way). Each case runs a mixed call —
a DTensor meeting a plain tensor that is the same on every rank (a batch, labels, a mask, LoRA adapters) — on meshes
of 8 ranks (1-D), (2, 4), 64 ranks as (4, 4, 4), and 512 as (8, 64), with even and uneven shards, and compares every
simulated rank's local piece of the result (and of the gradients) with the same computation on plain tensors,
distributed the same way (DTensor's own chunking of the plain result). On 512 ranks on one mesh dim a subset runs too
(most ranks then hold empty pieces). The real-rank tests (gloo, tests/engine/) stay; this adds scale.

The families: elementwise ops (replicate, sliced to the peer, broadcast), matmul beside a column- and a row-split
weight, ``copy_`` of a whole tensor into a shard, an in-place op with a plain operand, ``where``, a tensor-parallel
linear with plain LoRA adapters, ``cross_entropy`` with plain labels, ``embedding`` with plain ids, ``cat``, a pending
sum (``Partial``) meeting a plain addend, the corrections (an elementwise loss's mean and its backward, a boolean mask's
index and index_put, a weighted ``cross_entropy``), foreach optimizers (AdamW) and ``clip_grad_norm_`` over mixed
parameter lists, backward into a plain leaf, the ``local`` rule with a per-rank plain operand (a LocalTensor: each
rank's own), and check mode refusing a plain operand that differs between ranks or a local piece of the wrong shape.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import distribute_tensor as _distribute_tensor

import keras_dtensor_mixfix as mf

import _simulator
from _simulator import LocalTensor, local_tensor

MESHES = [(8,), (2, 4), (4, 4, 4), (8, 64), (512,)]
"""Simulated mesh shapes: 8, 8, 64, 512 and 512 ranks."""

ON_512_RANKS_OF_ONE_DIM = ("elementwise", "writes", "partial_sums", "gradients", "local_rule")
"""The families run on (512,) too (every family runs on the others): 512 ranks on one dim, most holding an empty
piece of these shapes, and the simulator's cost grows with the ranks (lora_and_loss alone takes 34 s there)."""


def _mesh_id(shape: Tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


@pytest.fixture(scope="module", ids=_mesh_id)
def mesh_shape(request):
    """A fake process group of the mesh's world size in this process, for the tests of one mesh shape."""
    with _simulator.fake_process_group(math.prod(request.param)):
        yield request.param


def distribute_tensor(tensor: torch.Tensor, mesh: Any, placements: Any) -> DTensor:
    """DTensor's own ``distribute_tensor`` of a tensor that is the same on every rank, each rank splitting its own copy
    (``src_data_rank=None``: torch's scatter from rank 0 fails in the simulator for a dim split unevenly over
    several mesh dims)."""
    return _distribute_tensor(tensor.detach(), mesh, placements, src_data_rank=None)


def _ranks_of(tensor: Any) -> List[torch.Tensor]:
    """Every simulated rank's value of ``tensor`` (a LocalTensor), or ``tensor`` itself."""
    if isinstance(tensor, LocalTensor):
        return [tensor._local_tensors[rank] for rank in sorted(tensor._local_tensors)]
    return [tensor]


def _assert_equals_plain(got: Any, want: torch.Tensor, what: str) -> None:
    """``got`` (a DTensor, or a plain result) equals ``want`` (plain math) on every simulated rank: its local pieces
    are DTensor's own pieces of ``want`` laid out the same way (a Partial result is reduced first)."""
    if isinstance(got, DTensor):
        if any(p.is_partial() for p in got.placements):
            got = got.redistribute(got.device_mesh, [Replicate() if p.is_partial() else p for p in got.placements])
        expected = distribute_tensor(want, got.device_mesh, got.placements)
        pairs = list(zip(_ranks_of(got._local_tensor), _ranks_of(expected._local_tensor)))
    else:
        pairs = [(value, want) for value in _ranks_of(got)]
    assert pairs, what
    _assert_close_rank_by_rank(pairs, what, rtol=1e-5, atol=1e-5)


def _assert_close_rank_by_rank(pairs: List[Tuple[torch.Tensor, torch.Tensor]], what: str, **tolerances: Any) -> None:
    """Each simulated rank's (value, expected) pair close (``tolerances``: torch.testing's, its defaults if none)."""
    with local_tensor.maybe_disable_local_tensor_mode():
        for rank, (value, expected_value) in enumerate(pairs):
            torch.testing.assert_close(value, expected_value, **tolerances,
                                       msg=lambda message: f"{what}, simulated rank {rank}: {message}")


def _last(mesh_ndim: int, placement: Any) -> Tuple[Any, ...]:
    """``placement`` on the mesh's last dim (tensor parallelism), Replicate on the others."""
    return (Replicate(),) * (mesh_ndim - 1) + (placement,)


def _spread(mesh_ndim: int) -> Tuple[Any, ...]:
    """A placement per mesh dim, alternating tensor dims 0 and 1 (a dim split over several mesh dims)."""
    return tuple(Shard(index % 2) for index in range(mesh_ndim))


CaseResult = List[Tuple[str, Any, torch.Tensor]]
"""What a case compares: (what, the mixed call's result, plain math's)."""


def _inputs(seed: int = 0) -> Dict[str, torch.Tensor]:
    """The plain tensors of the cases, made before the simulator starts: the same on every rank. Shapes are chosen
    uneven over most meshes (27 rows, 10 and 14 columns over 8 and 64 ranks)."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return dict(w=draw(27, 10), x=draw(27, 10), row=draw(10), W=draw(14, 16), xs=draw(5, 14), A=draw(14, 4),
                B=draw(4, 16), labels=torch.randint(0, 16, (5,), generator=g), table=draw(30, 8),
                ids=torch.randint(0, 30, (4, 6), generator=g), cond=draw(27, 10) > 0, zeros=torch.zeros(27, 10))


def elementwise(mesh, ndim, t) -> CaseResult:
    found: CaseResult = []
    for placements in (_last(ndim, Shard(0)), _last(ndim, Shard(1)), (Shard(0),) + (Replicate(),) * (ndim - 1),
                       _spread(ndim), (Replicate(),) * ndim):
        weight = distribute_tensor(t["w"], mesh, placements)
        found.append((f"w {placements} * plain x", weight * t["x"], t["w"] * t["x"]))
        found.append((f"plain x - w {placements}", t["x"] - weight, t["x"] - t["w"]))
        found.append((f"w {placements} + a plain row (broadcast)", weight + t["row"], t["w"] + t["row"]))
    return found


def matmul(mesh, ndim, t) -> CaseResult:
    column = distribute_tensor(t["W"], mesh, _last(ndim, Shard(1)))
    row = distribute_tensor(t["W"], mesh, _last(ndim, Shard(0)))
    return [("plain xs @ W split by columns", t["xs"] @ column, t["xs"] @ t["W"]),
            ("plain xs @ W split by rows", t["xs"] @ row, t["xs"] @ t["W"])]


def writes(mesh, ndim, t) -> CaseResult:
    into_shard = distribute_tensor(t["zeros"], mesh, _last(ndim, Shard(0)))
    into_shard.copy_(t["w"])  # a whole plain tensor loaded into a shard
    in_place = distribute_tensor(t["w"].clone(), mesh, _spread(ndim))
    in_place.add_(t["x"])
    in_place.mul_(t["row"])
    return [("copy_ of a plain tensor into a shard", into_shard, t["w"]),
            ("add_ and mul_ of plain operands into a split DTensor", in_place, (t["w"] + t["x"]) * t["row"])]


def selections(mesh, ndim, t) -> CaseResult:
    weight = distribute_tensor(t["w"], mesh, _last(ndim, Shard(0)))
    table = distribute_tensor(t["table"], mesh, _last(ndim, Shard(1)))
    return [("where(plain mask, w, plain x)", torch.where(t["cond"], weight, t["x"]),
             torch.where(t["cond"], t["w"], t["x"])),
            ("embedding of plain ids", F.embedding(t["ids"], table), F.embedding(t["ids"], t["table"])),
            ("cat of w and plain x", torch.cat([weight, t["x"]]), torch.cat([t["w"], t["x"]]))]


def lora_and_loss(mesh, ndim, t) -> CaseResult:
    weight = distribute_tensor(t["W"].t().contiguous(), mesh, _last(ndim, Shard(0)))  # column-parallel linear
    out = F.linear(t["xs"], weight) + (t["xs"] @ t["A"]) @ t["B"]
    logits = t["xs"] @ distribute_tensor(t["W"], mesh, _last(ndim, Shard(1)))
    return [("tensor-parallel linear with plain LoRA adapters", out, t["xs"] @ t["W"] + (t["xs"] @ t["A"]) @ t["B"]),
            ("cross_entropy of split logits and plain labels", F.cross_entropy(logits, t["labels"]),
             F.cross_entropy(t["xs"] @ t["W"], t["labels"]))]


def partial_sums(mesh, ndim, t) -> CaseResult:
    """A pending sum (``Partial``, from a row-split matmul) meeting plain operands: a plain addend counted once."""
    partial = t["xs"] @ distribute_tensor(t["W"], mesh, _last(ndim, Shard(0)))
    bias = t["B"][0]
    return [("Partial + a plain bias", partial + bias, t["xs"] @ t["W"] + bias),
            ("Partial * a plain scale", partial * t["B"][1], (t["xs"] @ t["W"]) * t["B"][1])]


def corrections(mesh, ndim, t) -> CaseResult:
    """Ops DTensor gets wrong after a promotion, run in an exact form (the package's corrections): an elementwise
    loss's mean and its backward, a boolean mask's index and index_put, a weighted nll_loss's mean."""
    prediction = distribute_tensor(t["w"], mesh, _last(ndim, Shard(0))).requires_grad_()
    loss = F.mse_loss(prediction, t["x"])
    loss.backward()
    plain_prediction = t["w"].clone().requires_grad_()
    plain_loss = F.mse_loss(plain_prediction, t["x"])
    plain_loss.backward()
    split = distribute_tensor(t["w"], mesh, _last(ndim, Shard(1)))
    put = distribute_tensor(t["w"].clone(), mesh, _last(ndim, Shard(1)))
    rows = t["cond"][:, 0]  # a mask over the rows of a tensor split by columns
    put[rows] = 0.0
    expected_put = t["w"].clone()
    expected_put[rows] = 0.0
    logits = t["xs"] @ distribute_tensor(t["W"], mesh, _last(ndim, Shard(1)))
    weight = t["row"].abs()[:1].repeat(16) + torch.arange(16.0)
    return [("mse_loss's mean of a split prediction and a plain target", loss, plain_loss),
            ("mse_loss's gradient", prediction.grad, plain_prediction.grad),
            ("a split tensor indexed by a plain boolean mask", split[rows], t["w"][rows]),
            ("index_put of a plain boolean mask into a split tensor", put, expected_put),
            ("cross_entropy with plain class weights", F.cross_entropy(logits, t["labels"], weight=weight),
             F.cross_entropy(t["xs"] @ t["W"], t["labels"], weight=weight))]


def gradients(mesh, ndim, t) -> CaseResult:
    weight = distribute_tensor(t["w"], mesh, _spread(ndim)).requires_grad_()
    leaf = t["x"].clone().requires_grad_()
    ((weight * leaf).sin().sum()).backward()
    plain_weight, plain_leaf = t["w"].clone().requires_grad_(), t["x"].clone().requires_grad_()
    ((plain_weight * plain_leaf).sin().sum()).backward()
    assert type(leaf.grad) is not DTensor or False, "the plain leaf's gradient is a DTensor"
    return [("the plain leaf's gradient", leaf.grad, plain_leaf.grad),
            ("the DTensor's gradient", weight.grad, plain_weight.grad)]


def _on_every_rank(tensor: torch.Tensor, mesh: Any) -> torch.Tensor:
    """``tensor`` as each simulated rank's own plain tensor of the same value: what a plain tensor that is written
    into (a parameter, a gradient) must be under the simulator, where a tensor made outside it is one object shared by
    every simulated rank."""
    return LocalTensor({rank: tensor.clone() for rank in range(mesh.size())})


def _clipped_and_stepped(params: List[torch.Tensor], grads: List[torch.Tensor], foreach: bool) -> torch.Tensor:
    """``grads`` set as the parameters' gradients, clipped to norm 1 and an AdamW step taken; the norm before."""
    for param, grad in zip(params, grads):
        param.grad = grad
    norm = torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=foreach)
    torch.optim.AdamW(params, lr=0.1, foreach=foreach).step()
    return norm


def optimizers(mesh, ndim, t) -> CaseResult:
    """AdamW (foreach) and clip_grad_norm_ over a list of DTensor and plain parameters."""
    found: CaseResult = []
    for foreach in (True, False):
        sharded = distribute_tensor(t["w"].clone(), mesh, _last(ndim, Shard(1))).requires_grad_()
        plain = _on_every_rank(t["row"], mesh).requires_grad_()
        reference = [t["w"].clone().requires_grad_(), t["row"].clone().requires_grad_()]
        mixed_norm = _clipped_and_stepped([sharded, plain], [distribute_tensor(t["x"], mesh, sharded.placements),
                                                             _on_every_rank(t["row"] * 3, mesh)], foreach)
        reference_norm = _clipped_and_stepped(reference, [t["x"].clone(), t["row"] * 3], foreach)
        found += [(f"clip_grad_norm_ (foreach={foreach})'s norm", mixed_norm, reference_norm),
                  (f"AdamW (foreach={foreach}) on the DTensor", sharded.detach(), reference[0].detach()),
                  (f"AdamW (foreach={foreach}) on the plain parameter", plain.detach(), reference[1].detach())]
    return found


def local_rule(mesh, ndim, t) -> CaseResult:
    """The ``local`` rule: a plain operand that is each rank's own piece (under the simulator, a LocalTensor whose
    ranks hold different values) meets a DTensor split the same way."""
    weight = distribute_tensor(t["w"], mesh, _last(ndim, Shard(0)))
    pieces = weight._local_tensor * 0 + 1  # each rank's piece shape; then each rank's own values
    per_rank = LocalTensor({rank: torch.full_like(piece, float(rank)) for rank, piece in pieces._local_tensors.items()})
    with mf.patched(default="local"):
        out = weight * per_rank
    expected = DTensor.from_local(weight._local_tensor * per_rank, mesh, weight.placements, shape=weight.shape,
                                  stride=weight.stride())
    return [("the local rule takes each rank's own piece", out._local_tensor, expected._local_tensor)]


CASES: Dict[str, Callable[..., CaseResult]] = {case.__name__: case for case in (
    elementwise, matmul, writes, selections, lora_and_loss, partial_sums, corrections, gradients, optimizers,
    local_rule)}


@pytest.mark.parametrize("mesh_shape, family", [
    pytest.param(shape, family, id=f"{_mesh_id(shape)}-{family}") for shape in MESHES for family in sorted(CASES)
    if shape != (512,) or family in ON_512_RANKS_OF_ONE_DIM], indirect=["mesh_shape"])
def test_a_mixed_call_equals_plain_math_on_every_simulated_rank(mesh_shape, family):
    inputs = _inputs()
    size = math.prod(mesh_shape)
    with _simulator.simulated_mesh(mesh_shape) as mesh:
        with mf.patched():
            results = CASES[family](mesh, len(mesh_shape), inputs)
        assert results
        for what, got, want in results:
            if family != "local_rule":
                _assert_equals_plain(got, want, f"{family} on {mesh_shape}: {what}")
                continue
            pairs = list(zip(_ranks_of(got), _ranks_of(want)))  # local pieces, rank by rank
            assert len(pairs) == size, what
            _assert_close_rank_by_rank(pairs, what)


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)], indirect=True, ids=_mesh_id)
def test_check_mode_refuses_a_plain_operand_that_differs_between_ranks(mesh_shape):
    """A "plain tensor the same on every rank" that is not (a per-rank value, as a rank's own data loader gives):
    ``check="raise"`` compares it across the mesh and refuses it, naming the op and the ranks that agree."""
    size = math.prod(mesh_shape)
    with _simulator.simulated_mesh(mesh_shape) as mesh:
        weight = distribute_tensor(torch.ones(16, 4), mesh, _last(len(mesh_shape), Shard(0)))
        per_rank = LocalTensor({rank: torch.full((16, 4), float(rank % 2)) for rank in range(size)})
        with mf.patched(check="raise"):
            with pytest.raises(mf.ReplicationCheckError, match=r"mul(.|\n)*ranks \[0, 2"):
                weight * per_rank
            same = weight * torch.full((16, 4), 2.0)  # the same on every rank: passes the check
        _assert_equals_plain(same, torch.full((16, 4), 2.0), "checked, the same on every rank")


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)], indirect=True, ids=_mesh_id)
def test_check_mode_refuses_a_local_piece_of_the_wrong_shape(mesh_shape):
    """Under the ``local`` rule each rank's plain operand is its piece: one rank holding a piece of another shape
    than the placements give it is refused by ``check="raise"``, naming that rank; the right pieces pass."""
    size = math.prod(mesh_shape)
    with _simulator.simulated_mesh(mesh_shape) as mesh:
        weight = distribute_tensor(torch.ones(27, 4), mesh, _last(len(mesh_shape), Shard(0)))
        pieces = (weight._local_tensor * 0 + 1)._local_tensors
        right = LocalTensor({rank: piece.clone() for rank, piece in pieces.items()})
        # the global shape given: the engine cannot infer (and refuse) a wrong piece from its local shape
        rule = lambda call: mf.Decision("local", placements=weight.placements, shape=(27, 4))  # noqa: E731
        with mf.patched(check="raise"):
            handle = mf.register_rule("aten::mul.Tensor", rule)
            try:
                out = weight * right
                wrong = dict(pieces)
                wrong[size - 1] = torch.ones(1, 4) if pieces[size - 1].shape[0] != 1 else torch.ones(2, 4)
                with pytest.raises(mf.ReplicationCheckError, match=rf"rank {size - 1} has \(\d, 4\)"):
                    weight * LocalTensor(wrong)
            finally:
                handle.remove()
        _assert_equals_plain(out, torch.ones(27, 4), "the right pieces, checked")

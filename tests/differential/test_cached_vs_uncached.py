"""The same mixed calls down the cached paths and down the uncached general path give the same bits.

The engine answers a mixed call from what it remembered (fast.py's entries and direct plans,
foreach.py's plans, the cached layouts) whenever the call is admitted (opstate.admit); every other
call takes the general path, stage by stage. Each case here runs three times in each of three modes, on
2- and 4-rank meshes:

- ``cached``: the default options; the first call of a shape re-dispatches and decides a direct plan,
  the later ones take it;
- ``re-dispatched``: ``direct=False``: the fast path's cached entries, every call re-dispatched (a
  ``_foreach`` call then takes the general path: its only cached path is its direct plan);
- ``uncached``: the default rule given as a callable that answers ``"replicate"`` (a callable is never
  admitted to a cached path), with every engine cache cleared before each call.

Every output (local values, strides and the whole spec) and every gradient must be equal bit for bit
across the modes, and each mode must have taken its path (checked on the op states it left).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch

from _ranks import mesh_for, shard
from keras_dtensor_mixfix.testing import run_on_ranks

MODES = ("cached", "re-dispatched", "uncached")


def _replicate(call: Any) -> str:
    """The default rule's answer, given as a callable: the same decisions, never admitted to a cached path."""
    return "replicate"


def _peer(m: Any, full: torch.Tensor, kind: str, requires_grad: bool = False) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    last = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}[kind]
    placements = [Shard(0) if kind != "S0" else Replicate()] * (m.ndim - 1) + [last]
    return shard(full, m, placements, requires_grad)


def _elementwise(kind: str, plain_shape: Tuple[int, ...], fn: Callable[[Any, Any], Any]) -> Callable[[Any], Any]:
    def case(m: Any) -> Any:
        torch.manual_seed(3)
        full, plain = torch.randn(8, 6), torch.randn(plain_shape)
        return fn(_peer(m, full, kind), plain)

    return case


def _mm(m: Any) -> Any:
    torch.manual_seed(5)
    return _peer(m, torch.randn(8, 6), "S0") @ torch.randn(6, 4)


def _foreach_add(m: Any) -> Any:
    torch.manual_seed(9)
    peers = [_peer(m, torch.randn(8, 6), kind) for kind in ("S0", "S1", "R")]
    return torch._foreach_add(peers, [torch.randn(8, 6) for _ in peers], alpha=0.5)


def _foreach_mul_(m: Any) -> Any:
    torch.manual_seed(13)
    peers = [_peer(m, torch.randn(8, 6), kind) for kind in ("S0", "S1")]
    torch._foreach_mul_(peers, [torch.randn(8, 6), torch.randn(6)])
    return peers


def _backward(m: Any) -> Any:
    """Forward and backward: the backward meets each DTensor gradient with a plain operand, a mixed call too."""
    torch.manual_seed(17)
    w = _peer(m, torch.randn(8, 6), "S1", requires_grad=True)
    x = torch.randn(8, 6, requires_grad=True)
    row = torch.randn(6, requires_grad=True)
    ((w * x - row) / (x.abs() + 1)).pow(2).sum().backward()
    return [w.grad, x.grad, row.grad]


CASES: Dict[str, Callable[[Any], Any]] = {
    "mul, Shard(0) peer": _elementwise("S0", (8, 6), lambda d, p: d * p),
    "add, plain on the left, Replicate peer": _elementwise("R", (8, 6), lambda d, p: p + d),
    "sub, broadcast row, Shard(1) peer": _elementwise("S1", (6,), lambda d, p: d - p),
    "in-place mul_": _elementwise("S0", (8, 6), lambda d, p: d.clone().mul_(p)),
    "mm": _mm,
    "_foreach_add with alpha": _foreach_add,
    "in-place _foreach_mul_ with a broadcast row": _foreach_mul_,
    "backward": _backward,
}


def _bits(value: Any) -> List[Tuple[Any, ...]]:
    """Everything a result is made of: per tensor its type, spec, local stride and local values."""
    from torch.distributed.tensor import DTensor

    values = value if isinstance(value, (list, tuple)) else [value]
    out: List[Tuple[Any, ...]] = []
    for item in values:
        assert isinstance(item, torch.Tensor), type(item)
        if isinstance(item, DTensor):
            local = item.to_local()
            out.append((DTensor, item._spec, local.stride(), local.detach().clone()))
        else:
            out.append((type(item), None, item.stride(), item.detach().clone()))
    return out


def _run(mode: str, name: str, m: Any) -> List[List[Tuple[Any, ...]]]:
    import keras_dtensor_mixfix as mf
    from keras_dtensor_mixfix._engine.caches import CACHES

    options: Dict[str, Any] = {"re-dispatched": {"direct": False}, "uncached": {"default": _replicate}}.get(mode, {})
    calls = []
    CACHES.clear()  # nothing remembered from another mode or case
    with mf.patched(**options):
        for _ in range(3):
            if mode == "uncached":
                CACHES.clear()
            calls.append(_bits(CASES[name](m)))
            _check_path_taken(mode, name)
    return calls


def _check_path_taken(mode: str, name: str) -> None:
    """The op states the calls left say which path they took."""
    from keras_dtensor_mixfix._engine.caches import CACHES
    from keras_dtensor_mixfix._engine.opstate import UNDECIDED

    entries = [entry for info in CACHES.op_states.values() for entry in info.fast.values()]
    if mode == "uncached" or (mode == "re-dispatched" and "_foreach" in name):
        assert not entries, (name, mode, entries)  # no cached path took the call
        return
    assert entries, f"{name}, {mode}: no call took a cached path"
    if mode == "re-dispatched":
        assert all(entry.direct is UNDECIDED for entry in entries), (name, entries)


def differential(world_size: int) -> bool:
    m = mesh_for(world_size)
    for name in CASES:
        results = {mode: _run(mode, name, m) for mode in MODES}
        reference = results["uncached"][0]
        for mode, calls in results.items():
            for number, bits in enumerate(calls):
                where = f"{name}, {mode}, call {number + 1}"
                assert len(bits) == len(reference), where
                for got, want in zip(bits, reference):
                    assert got[:3] == want[:3], (where, got[:3], want[:3])
                    assert got[3].dtype == want[3].dtype and torch.equal(got[3], want[3]), where
    return True


def test_cached_and_uncached_paths_give_the_same_bits(world_size):
    assert all(run_on_ranks(differential, world_size, world_size=world_size))

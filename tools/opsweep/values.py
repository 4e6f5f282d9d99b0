"""Running a sample's call on its flattened leaves, and reading/comparing what came out
(to full tensors, tolerance comparison, digests), DTensor operands built from plain ones."""

from __future__ import annotations

import hashlib
import math
from typing import Any, List, Optional, Sequence

from .common import MSG_LEN, describe_value, short


def call(fn: Any, leaves: Sequence[Any], spec: Any) -> Any:
    import torch.utils._pytree as pytree

    inp, args, kwargs = pytree.tree_unflatten(list(leaves), spec)
    return fn(inp, *args, **kwargs)


def clone_leaves(leaves: Sequence[Any]) -> List[Any]:
    import torch

    return [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]


def to_full(value: Any) -> Any:
    """Outputs/operands with every DTensor replaced by its full tensor (a collective: same order on all ranks)."""
    import torch
    import torch.utils._pytree as pytree
    from torch.distributed.tensor import DTensor

    def one(v: Any) -> Any:
        if isinstance(v, DTensor):
            return v.full_tensor().detach()
        if isinstance(v, torch.Tensor):
            return v.detach()
        return v

    leaves, spec = pytree.tree_flatten(value)
    return pytree.tree_unflatten([one(v) for v in leaves], spec)


def compare(actual: Any, expected: Any, rtol: float, atol: float, what: str) -> Optional[str]:
    """None when equal (structure, types, values); otherwise a short description of the difference."""
    import torch
    import torch.utils._pytree as pytree

    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    if len(a_leaves) != len(e_leaves) or str(a_spec) != str(e_spec):
        return f"{what}: structure differs: got {describe_value(actual, 80)}, expected {describe_value(expected, 80)}"
    for index, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        where = what if len(a_leaves) == 1 else f"{what}[{index}]"
        if isinstance(e, torch.Tensor) != isinstance(a, torch.Tensor):
            return f"{where}: got {type(a).__name__}, expected {type(e).__name__}"
        if isinstance(e, torch.Tensor):
            try:
                torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True, check_device=False)
            except AssertionError as exc:
                return f"{where}: " + short(str(exc).replace("\n", " "), MSG_LEN)
        elif isinstance(e, float) and isinstance(a, float):
            if not (a == e or (math.isnan(a) and math.isnan(e)) or math.isclose(a, e, rel_tol=rtol, abs_tol=atol)):
                return f"{where}: got {a!r}, expected {e!r}"
        elif a != e:
            return f"{where}: got {short(repr(a), 60)}, expected {short(repr(e), 60)}"
    return None


def value_digest(value: Any) -> str:
    import torch
    import torch.utils._pytree as pytree

    h = hashlib.sha1()
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach()
            h.update(f"{tuple(t.shape)}{t.dtype}".encode())
            try:
                h.update(t.cpu().contiguous().numpy().tobytes())
            except Exception:  # noqa: BLE001 - a dtype numpy lacks: fall back to the printed values
                h.update(repr(t.tolist()).encode())
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()[:16]


class SeededOpFinder:
    """Records the ops tagged ``nondeterministic_seeded`` (random) that a call dispatches."""

    def __init__(self) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        found: List[str] = []
        self.found = found

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if torch.Tag.nondeterministic_seeded in func.tags:
                    found.append(str(func))
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self) -> "SeededOpFinder":
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)


def mark_leaf(leaves: List[Any], index: int, placement: Any, device_mesh: Any) -> List[Any]:
    from torch.distributed.tensor import distribute_tensor

    out = clone_leaves(leaves)
    # Every rank holds the same full tensor (same seed), so no communication is needed.
    out[index] = distribute_tensor(out[index], device_mesh, [placement], src_data_rank=None)
    return out


def all_replicate(leaves: List[Any], device_mesh: Any) -> List[Any]:
    import torch
    from torch.distributed.tensor import Replicate, distribute_tensor

    return [distribute_tensor(v.clone(), device_mesh, [Replicate()], src_data_rank=None)
            if isinstance(v, torch.Tensor) else v for v in leaves]


def all_dtensor(leaves: List[Any], index: int, placement: Any, device_mesh: Any) -> List[Any]:
    """Every tensor operand a DTensor: ``leaves[index]`` with ``placement``, the others ``Replicate``."""
    marked = mark_leaf(leaves, index, placement, device_mesh)
    replicated = all_replicate(leaves, device_mesh)
    return [m if i == index else r for i, (m, r) in enumerate(zip(marked, replicated))]

"""Which ops and samples the sweep runs: torch's OpInfo database, random-op filter, usable samples,
the operands that take a turn as the DTensor and their placements, per-op tolerances."""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .common import DEFAULT_ATOL, DEFAULT_RTOL, MAX_POSITIONS, SCAN_LIMIT, describe_sample, short
from .extra import extra_samples


# Ops whose name says they draw random numbers. The words are the ones the sweep's issue lists;
# the names below contain such a word but are deterministic, so they are swept.
RANDOM_WORDS = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial")
NOT_RANDOM = frozenset({
    "__rand__",                  # reflected bitwise and
    "nn.functional.normalize",   # x / norm(x)
    "masked.normalize",
    "native_dropout_backward",   # grad * mask * scale: the mask is an input
})


_OPS: Optional[Dict[str, Any]] = None


def op_infos() -> Dict[str, Any]:
    """``{full name: OpInfo}`` for every entry of torch's ``op_db`` (name, or name.variant)."""
    global _OPS
    if _OPS is None:
        from torch.testing._internal.common_methods_invocations import op_db

        _OPS = {}
        for info in op_db:
            _OPS.setdefault(full_name(info), info)
    return _OPS


def full_name(info: Any) -> str:
    return info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")


def is_random_name(name: str) -> bool:
    base = name.split(".")[0] if name.startswith("__") else name
    if name in NOT_RANDOM or base in NOT_RANDOM:
        return False
    return any(word in name for word in RANDOM_WORDS)


def select_ops(names: Optional[Sequence[str]] = None) -> Tuple[List[str], List[str]]:
    """(ops to sweep, ops skipped as random). ``names`` match a full name or an OpInfo name."""
    infos = op_infos()
    if names:
        chosen = []
        for wanted in names:
            found = [wanted] if wanted in infos else [key for key, info in infos.items() if info.name == wanted]
            if not found:
                raise SystemExit(f"no OpInfo named {wanted!r}")
            chosen.extend(k for k in found if k not in chosen)
    else:
        chosen = list(infos)
    random_ops = [n for n in chosen if is_random_name(n)]
    return [n for n in chosen if n not in random_ops], random_ops


def opinfo_tolerance(info: Any, dtype: Any) -> Tuple[float, float]:
    """(rtol, atol): the largest float32 toleranceOverride any of the OpInfo's tests uses, or the defaults."""
    rtol, atol = DEFAULT_RTOL, DEFAULT_ATOL
    try:
        from torch.testing._internal.common_device_type import toleranceOverride
        from torch.testing._internal.opinfo.core import DecorateInfo

        for item in getattr(info, "decorators", ()) or ():
            decorators = item.decorators if isinstance(item, DecorateInfo) else [item]
            for decorator in decorators:
                if isinstance(decorator, toleranceOverride) and dtype in decorator.d:
                    tol = decorator.d[dtype]
                    rtol, atol = max(rtol, tol.rtol), max(atol, tol.atol)
    except Exception:  # noqa: BLE001 - metadata layout changed: keep the defaults
        pass
    return rtol, atol


def flatten(sample: Any) -> Tuple[List[Any], List[str], Any]:
    """Leaves of (input, args, kwargs), a label per leaf ('input', 'args[1]', "kwargs['weight']"), spec."""
    import torch.utils._pytree as pytree

    with_path, spec = pytree.tree_flatten_with_path((sample.input, tuple(sample.args), dict(sample.kwargs)))
    leaves, labels = [], []
    for path, leaf in with_path:
        head = ("input", "args", "kwargs")[path[0].idx]
        labels.append(head + pytree.keystr(path[1:]))
        leaves.append(leaf)
    return leaves, labels, spec


def sample_dtype(info: Any) -> Any:
    import torch

    for dtype in (torch.float32, torch.int64, torch.bool):
        if info.supports_dtype(dtype, "cpu"):
            return dtype
    return torch.float32


def seed_for(name: str) -> int:
    return int(hashlib.sha1(name.encode()).hexdigest()[:8], 16)


def usable(leaves: Sequence[Any]) -> Tuple[bool, str, List[int]]:
    import torch

    tensors = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    for i in tensors:
        t = leaves[i]
        if t.dtype not in (torch.float32, torch.int64, torch.bool):
            return False, f"tensor of dtype {t.dtype}", tensors
        if t.numel() == 0:
            return False, "empty tensor", tensors
        if t.layout != torch.strided:
            return False, f"layout {t.layout}", tensors
    if len(tensors) < 2:
        return False, "fewer than two tensor operands", tensors
    return True, "", tensors


def pick_positions(tensors: List[int]) -> List[int]:
    if len(tensors) <= MAX_POSITIONS:
        return tensors
    step = (len(tensors) - 1) / (MAX_POSITIONS - 1)
    return sorted({tensors[round(k * step)] for k in range(MAX_POSITIONS)})


SHARD_MODES = ("first-even", "even", "all")


def placements_for(tensor: Any, mode: str = "all") -> List[Any]:
    """``Replicate()`` and the ``Shard(d)`` placements to try: on the first dim of even size
    (``first-even``), on every dim of even size (``even``: the dims an op reduces over included), or
    on every dim of size >= 2 (``all``: uneven shards too)."""
    from torch.distributed.tensor import Replicate, Shard

    if mode not in SHARD_MODES:
        raise ValueError(f"shard mode {mode!r}: one of {SHARD_MODES}")
    found = [Replicate()]
    for dim, size in enumerate(tensor.shape):
        if size >= 2 and (mode == "all" or size % 2 == 0):
            found.append(Shard(dim))
            if mode == "first-even":
                break
    return found


def pick_samples(info: Any, dtype: Any, max_samples: int, shard_dims: str = "all",
                 extra: str = "all") -> Tuple[List[Any], Dict[str, int], str]:
    """(usable samples as (index, description, leaves, labels, spec, tensor positions, shard mode, tag),
    skip counts, error): up to ``max_samples`` of OpInfo's (shard mode ``shard_dims``, tag ""), then the
    sweep's own (``extra.extra_samples``: numbered from ``extra.EXTRA_BASE``, shard mode ``all``)."""
    import pickle

    picked: List[Any] = []
    skipped: Dict[str, int] = {}

    def take(index: int, sample: Any, mode: str, tag: str) -> None:
        leaves, labels, spec = flatten(sample)
        ok, why, tensors = usable(leaves)
        if ok:
            try:
                pickle.dumps((leaves, spec))
            except Exception as exc:  # noqa: BLE001 - any pickling error: the sample is skipped
                ok, why = False, f"sample not picklable ({type(exc).__name__})"
        if not ok:
            skipped[why] = skipped.get(why, 0) + 1
            return
        picked.append((index, describe_sample(sample), leaves, labels, spec, tensors, mode, tag))

    try:
        for index, sample in enumerate(info.sample_inputs("cpu", dtype)):
            if index >= SCAN_LIMIT or len(picked) >= max_samples:
                break
            take(index, sample, shard_dims, "")
    except Exception as exc:  # noqa: BLE001 - torch's sample generator failing: the op is skipped
        return [], {}, short(f"sample_inputs raised {type(exc).__name__}: {exc}")
    try:
        for index, tag, sample in extra_samples(full_name(info), seed_for(full_name(info)), extra):
            take(index, sample, "all", tag)
    except Exception as exc:  # noqa: BLE001 - the sweep's own samples failing: the op is skipped
        return [], {}, short(f"the sweep's own samples raised {type(exc).__name__}: {exc}")
    return picked, skipped, ""

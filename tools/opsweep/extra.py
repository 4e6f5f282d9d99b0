"""The sweep's own samples, beside OpInfo's: the keywords that change how an op reduces, and shapes whose
reduced or indexed dims can be sharded.

OpInfo's samples rarely pass the keywords that change a loss's reduction (``weight``, ``reduction``,
``ignore_index``, ``label_smoothing``, ``pos_weight``) and mostly use sizes of 5, so the dim an op reduces
over (a loss's batch, the scatter / index dim, a masked reduction's dim, a contraction, a norm's
normalized dim) can rarely be sharded evenly. These samples fill that in; every one is built from a
generator seeded by the op's name (the same on every run and rank, and made on rank 0 only anyway):

* losses: ``reduction`` in mean / sum / none (``kl_div`` also batchmean), with and without ``weight``
  (``pos_weight``), ``ignore_index`` with targets that hit it (batch 4: rows 0, 1, 3, so one rank's
  whole Shard(0) piece is ignored and the other's in part; batch 3: rows 0, 2), ``label_smoothing``
  0.1, class-index and probability targets; batch 4 (even shards) and batch 3 (uneven: 2 + 1 rows);
* scatter / index ops with the scatter (index) dim of size 4 and duplicate indices where the op
  accumulates (deterministic: no duplicates where the op overwrites);
* masked reductions with a plain mask, layer/rms/group/batch norm with plain weight, bias and running
  stats, contractions (mm, matmul, linear, einsum, ...) with the contracted dim of size 4.

Every dim of size >= 2 of these samples' operands is sharded in turn (``sampling.placements_for``
mode ``all``: uneven shards included). Sample numbers start at ``EXTRA_BASE`` so they never clash with
OpInfo's. Each builder marks a few samples per op as key: the CI subset runs those (``extra="key"``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

EXTRA_BASE = 100
# rtol and atol for these samples, where the OpInfo's are larger: OpInfo's float32 overrides (3e-3 for
# cross_entropy) would hide a biased mean of a few percent; these samples are small and well conditioned.
EXTRA_TOLERANCE = 1e-4
REDUCTIONS = ("mean", "sum", "none")

Extra = Tuple[str, Any, bool]  # (tag, SampleInput, key)


class _Rand:
    """Seeded draws (a torch.Generator of its own: the global RNG is left alone)."""

    def __init__(self, seed: int) -> None:
        import torch

        self.torch = torch
        self.g = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int) -> Any:
        return self.torch.randn(shape, generator=self.g)

    def rand(self, *shape: int) -> Any:
        return self.torch.rand(shape, generator=self.g)

    def randint(self, low: int, high: int, *shape: int) -> Any:
        return self.torch.randint(low, high, shape, generator=self.g)

    def sign(self, *shape: int) -> Any:
        return self.randint(0, 2, *shape).float() * 2 - 1

    def perm(self, n: int) -> Any:
        return self.torch.randperm(n, generator=self.g)


def _sample(inp: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.testing._internal.opinfo.core import SampleInput

    return SampleInput(inp, args=args, kwargs=kwargs)


def _ignored_rows(n: int, one: bool = False) -> List[int]:
    # Under Shard(0) on 2 ranks, batch 4: rank 0 holds rows 0-1 (all ignored: a local mean over
    # nothing), rank 1 rows 2-3 (one ignored); batch 3: rank 0 rows 0-1 (one ignored), rank 1 row 2
    # (all ignored). ``one``: row 0 only (rank 0 keeps one row, rank 1 both: an unweighted mean of the
    # ranks' means is biased too, without a NaN).
    if one:
        return [0]
    return [0, 1, 3] if n == 4 else [0, 2]


def _class_weight(r: _Rand, c: int) -> Any:
    """Class weights from 0.1 to 3.1: far enough apart that a mean weighted per rank is visibly off."""
    return r.rand(c) * 3 + 0.1


def _class_targets(r: _Rand, shape: Tuple[int, ...], c: int, ignore: Any = None, one: bool = False) -> Any:
    if ignore is None or ignore < 0 or ignore >= c:
        t = r.randint(0, c, *shape)
        k = min(c, shape[0])
        t[:k] = r.perm(c)[:k].reshape((k,) + (1,) * (len(shape) - 1))  # distinct classes: unequal weights per rank
    else:  # classes other than the ignored one, so only the rows below hit it
        t = (ignore + 1 + r.randint(0, c - 1, *shape)) % c
    if ignore is not None:
        t[_ignored_rows(shape[0], one)] = ignore
    return t


# ------------------------------------------------------------------------------------------ losses

IGNORE = 1  # a class in range: targets equal to it elsewhere would be ignored too (none are)


def _class_index_losses(r: _Rand, logits: bool) -> List[Extra]:
    """nll_loss (log-probabilities) and cross_entropy (logits), class-index targets."""
    import torch

    out: List[Extra] = []

    def one(n: int, reduction: str, opts: Tuple[str, ...], key: bool = False, spatial: int = 0) -> None:
        c = 4 if n % 2 == 0 else 3
        shape = (n, c) + ((spatial,) if spatial else ())
        x = r.randn(*shape)
        x = x if logits else torch.log_softmax(x, 1)
        explicit = "ignore" in opts or "ignore_one" in opts
        ignore = IGNORE if explicit else (-100 if "ignore_default" in opts else None)
        target_shape = (n,) + ((spatial,) if spatial else ())
        target = _class_targets(r, target_shape, c, ignore, one="ignore_one" in opts)
        kwargs: Dict[str, Any] = {}
        if "weight" in opts:
            kwargs["weight"] = _class_weight(r, c)
        if explicit:
            kwargs["ignore_index"] = IGNORE
        if "ls" in opts:
            kwargs["label_smoothing"] = 0.1
        kwargs["reduction"] = reduction
        rows = _ignored_rows(n, "ignore_one" in opts)
        hit = f" (targets hit it: rows {rows})" if explicit else ""
        default = f", targets -100 (the default ignore_index) at rows {rows}" if "ignore_default" in opts else ""
        named = [o.replace("ignore_one", "ignore") for o in opts if o != "ignore_default"]
        tag = f"batch {n}, {reduction}, {'+'.join(named) or 'no weight'}{hit}{default}"
        out.append((tag + (f", spatial {spatial}" if spatial else ""), _sample(x, target, **kwargs), key))

    smoothing = (("ls",), ("weight", "ignore", "ls")) if logits else ()
    for reduction in REDUCTIONS:
        for opts in ((), ("weight",), ("ignore",), ("weight", "ignore")) + smoothing:
            one(4, reduction, opts, key=(reduction == "mean" and opts in (("weight",), ("weight", "ignore"))))
    for opts in ((), ("weight",), ("weight", "ignore")) + (smoothing[1:] if logits else ()):
        one(3, "mean", opts, key=(opts == ("weight",)))
    one(3, "sum", ("weight", "ignore"))
    one(3, "none", ("weight", "ignore"))
    one(4, "mean", ("ignore_one",), key=True)
    one(4, "mean", ("weight", "ignore_one"))
    one(4, "mean", ("weight", "ignore_default"))
    one(4, "mean", ("weight", "ignore"), spatial=2)
    return out


def _nll_loss(r: _Rand) -> List[Extra]:
    return _class_index_losses(r, logits=False)


def _cross_entropy(r: _Rand) -> List[Extra]:
    import torch

    out = _class_index_losses(r, logits=True)
    # probability targets (no ignore_index there)
    for n, reduction, opts in ([(4, red, ("weight",)) for red in REDUCTIONS]
                               + [(4, red, ("weight", "ls")) for red in REDUCTIONS]
                               + [(4, "mean", ()), (4, "mean", ("ls",)), (3, "mean", ("weight", "ls"))]):
        c = 4 if n % 2 == 0 else 3
        kwargs: Dict[str, Any] = {}
        if "weight" in opts:
            kwargs["weight"] = _class_weight(r, c)
        if "ls" in opts:
            kwargs["label_smoothing"] = 0.1
        kwargs["reduction"] = reduction
        sample = _sample(r.randn(n, c), torch.softmax(r.randn(n, c), 1), **kwargs)
        tag = f"probability targets, batch {n}, {reduction}, {'+'.join(opts) or 'no weight'}"
        out.append((tag, sample, reduction == "mean" and opts == ("weight", "ls") and n == 4))
    return out


def _binary_cross_entropy(r: _Rand) -> List[Extra]:
    import torch

    out: List[Extra] = []
    for n, reduction, weight in ([(4, red, None) for red in REDUCTIONS] + [(4, red, "per-class") for red in REDUCTIONS]
                                 + [(4, "mean", "per-element"), (3, "mean", "per-class"), (3, "sum", "per-element")]):
        kwargs: Dict[str, Any] = {}
        if weight:
            kwargs["weight"] = r.rand(2) + 0.5 if weight == "per-class" else r.rand(n, 2) + 0.5
        kwargs["reduction"] = reduction
        sample = _sample(torch.sigmoid(r.randn(n, 2)), r.rand(n, 2), **kwargs)
        out.append((f"batch {n}, {reduction}, weight {weight or 'none'}", sample,
                    reduction == "mean" and weight == "per-class"))
    return out


def _binary_cross_entropy_with_logits(r: _Rand) -> List[Extra]:
    out: List[Extra] = []
    for n, reduction, opts in ([(4, red, ("pos_weight",)) for red in REDUCTIONS]
                               + [(4, red, ("weight", "pos_weight")) for red in REDUCTIONS]
                               + [(4, "mean", ()), (4, "mean", ("weight",)), (3, "mean", ("weight", "pos_weight")),
                                  (3, "sum", ("pos_weight",))]):
        kwargs: Dict[str, Any] = {}
        if "weight" in opts:
            kwargs["weight"] = r.rand(2) + 0.5
        if "pos_weight" in opts:
            kwargs["pos_weight"] = r.rand(2) + 0.5
        kwargs["reduction"] = reduction
        sample = _sample(r.randn(n, 2), r.rand(n, 2), **kwargs)
        out.append((f"batch {n}, {reduction}, {'+'.join(opts) or 'no weight'}", sample,
                    reduction == "mean" and opts == ("weight", "pos_weight")))
    return out


def _pair_loss(target: str = "randn", extra_kwargs: Dict[str, Any] = None, reductions: Tuple[str, ...] = REDUCTIONS,
               prepare: Callable[[Any], Any] = None) -> Callable[[_Rand], List[Extra]]:
    """(input [n, 2], target [n, 2]) losses: every reduction at batch 4, mean at batch 3."""

    def build(r: _Rand) -> List[Extra]:
        out: List[Extra] = []
        for n, reduction in [(4, red) for red in reductions] + [(3, "mean")]:
            x = r.randn(n, 2)
            y = {"randn": lambda: r.randn(n, 2), "sign": lambda: r.sign(n, 2),
                 "rand": lambda: r.rand(n, 2) + 0.1}[target]()
            if prepare is not None:
                x = prepare(x)
            sample = _sample(x, y, **dict(extra_kwargs or {}), reduction=reduction)
            out.append((f"batch {n}, {reduction}", sample, reduction == "mean"))
        return out

    return build


def _log_softmax(x: Any) -> Any:
    import torch

    return torch.log_softmax(x, 1)


def _kl_div(r: _Rand) -> List[Extra]:
    import torch

    out = _pair_loss("rand", reductions=REDUCTIONS + ("batchmean",), prepare=_log_softmax)(r)
    sample = _sample(torch.log_softmax(r.randn(4, 2), 1), torch.log_softmax(r.randn(4, 2), 1), reduction="batchmean",
                     log_target=True)
    out.append(("batch 4, batchmean, log_target", sample, False))
    return out


def _gaussian_nll_loss(r: _Rand) -> List[Extra]:
    out: List[Extra] = []
    for n, reduction, var_shape, full in ([(4, red, "full", False) for red in REDUCTIONS]
                                          + [(4, "mean", "one per row", True), (3, "mean", "full", False)]):
        var = r.rand(n, 2) + 0.5 if var_shape == "full" else r.rand(n, 1) + 0.5
        sample = _sample(r.randn(n, 2), r.randn(n, 2), var, full=full, reduction=reduction)
        out.append((f"batch {n}, {reduction}, var {var_shape}" + (", full" if full else ""), sample,
                    n == 4 and reduction == "mean" and not full))
    return out


def _margin_ranking_loss(r: _Rand) -> List[Extra]:
    return [(f"batch {n}, {red}",
             _sample(r.randn(n), r.randn(n), r.sign(n), margin=0.3, reduction=red), n == 4 and red == "mean")
            for n, red in [(4, red) for red in REDUCTIONS] + [(3, "mean")]]


def _cosine_embedding_loss(r: _Rand) -> List[Extra]:
    return [(f"batch {n}, {red}",
             _sample(r.randn(n, 2), r.randn(n, 2), r.sign(n), margin=0.2, reduction=red), n == 4 and red == "mean")
            for n, red in [(4, red) for red in REDUCTIONS] + [(3, "mean")]]


def _multi_margin_loss(r: _Rand) -> List[Extra]:
    out: List[Extra] = []
    for n, reduction, opts in ([(4, red, ("weight",)) for red in REDUCTIONS]
                               + [(4, "mean", ()), (3, "mean", ("weight",)), (4, "sum", ("weight", "p=2"))]):
        c = 4 if n % 2 == 0 else 3
        kwargs: Dict[str, Any] = {"p": 2} if "p=2" in opts else {}
        if "weight" in opts:
            kwargs["weight"] = _class_weight(r, c)
        sample = _sample(r.randn(n, c), r.randint(0, c, n), margin=0.5, reduction=reduction, **kwargs)
        out.append((f"batch {n}, {reduction}, {'+'.join(opts) or 'no weight'}", sample,
                    n == 4 and reduction == "mean" and opts == ("weight",)))
    return out


def _multilabel_margin_loss(r: _Rand) -> List[Extra]:
    import torch

    out: List[Extra] = []
    for n, reduction in [(4, red) for red in REDUCTIONS] + [(3, "mean")]:
        c = 4 if n % 2 == 0 else 3
        target = torch.stack([r.perm(c) for _ in range(n)])
        for row in range(n):  # the labels end at the first -1: 1 to c-1 labels per row
            target[row, 1 + row % (c - 1):] = -1
        out.append((f"batch {n}, {reduction}", _sample(r.randn(n, c), target, reduction=reduction),
                    n == 4 and reduction == "mean"))
    return out


def _multilabel_soft_margin_loss(r: _Rand) -> List[Extra]:
    out: List[Extra] = []
    for n, reduction, weighted in [(4, red, True) for red in REDUCTIONS] + [(4, "mean", False), (3, "mean", True)]:
        c = 4 if n % 2 == 0 else 3
        kwargs = {"weight": _class_weight(r, c)} if weighted else {}
        sample = _sample(r.randn(n, c), r.randint(0, 2, n, c).float(), reduction=reduction, **kwargs)
        out.append((f"batch {n}, {reduction}, {'weight' if weighted else 'no weight'}", sample,
                    n == 4 and reduction == "mean" and weighted))
    return out


def _triplet(with_distance: bool) -> Callable[[_Rand], List[Extra]]:
    def build(r: _Rand) -> List[Extra]:
        out: List[Extra] = []
        for n, reduction, swap in [(4, red, False) for red in REDUCTIONS] + [(3, "mean", False), (4, "sum", True)]:
            kwargs: Dict[str, Any] = {"margin": 0.5, "swap": swap, "reduction": reduction}
            if not with_distance:
                kwargs["p"] = 2.0
            sample = _sample(r.randn(n, 2), r.randn(n, 2), r.randn(n, 2), **kwargs)
            out.append((f"batch {n}, {reduction}" + (", swap" if swap else ""), sample, n == 4 and reduction == "mean"))
        return out

    return build


def _ctc_loss(r: _Rand) -> List[Extra]:
    import torch

    out: List[Extra] = []
    t_len, c, s_len = 6, 3, 2
    for n, reduction in [(4, red) for red in REDUCTIONS] + [(3, "mean")]:
        log_probs = torch.log_softmax(r.randn(t_len, n, c), 2)
        targets = r.randint(1, c, n, s_len)
        input_lengths = torch.tensor([t_len - (i % 2) for i in range(n)])
        target_lengths = torch.tensor([1 + (i % s_len) for i in range(n)])
        sample = _sample(log_probs, targets, input_lengths, target_lengths, reduction=reduction)
        out.append((f"batch {n} (dim 1), {reduction}", sample, n == 4 and reduction == "mean"))
    return out


# -------------------------------------------------------------------------------- scatter / index


def _dup_index(r: _Rand, *shape: int, high: int = 4) -> Any:
    """Indices in [0, high) with duplicates (column-wise for 2-D)."""
    import torch

    t = r.randint(0, high, *shape)
    t.view(-1)[0] = t.view(-1)[-1] = 1  # at least one repeated index
    return t if t.dim() else torch.tensor(1)


def _perm_index(r: _Rand, rows: int, cols: int) -> Any:
    """A permutation of 0..rows-1 down every column (unique per scatter target: deterministic)."""
    import torch

    return torch.stack([r.perm(rows) for _ in range(cols)], 1)


def _scatter_add(r: _Rand) -> List[Extra]:
    return [(f"dim {d}, duplicate indices", _sample(r.randn(4, 4), d, _dup_index(r, 4, 4), r.randn(4, 4)), d == 0)
            for d in (0, 1)]


def _scatter(r: _Rand) -> List[Extra]:
    return [("dim 0, a permutation per column", _sample(r.randn(4, 4), 0, _perm_index(r, 4, 4), r.randn(4, 4)), True),
            ("dim 0, duplicate indices, reduce='add'",
             _sample(r.randn(4, 4), 0, _dup_index(r, 4, 4), r.randn(4, 4), reduce="add"), False)]


def _scatter_reduce(reduce: str) -> Callable[[_Rand], List[Extra]]:
    def build(r: _Rand) -> List[Extra]:
        selfs = (False, True) if reduce in ("mean", "sum") else (False,)
        return [(f"dim 0, duplicate indices, include_self={inc}",
                 _sample(r.randn(4, 4), 0, _dup_index(r, 4, 4), r.randn(4, 4), reduce, include_self=inc), not inc)
                for inc in selfs]

    return build


def _index_add(r: _Rand) -> List[Extra]:
    return [(f"dim {d}, duplicate indices, alpha=2",
             _sample(r.randn(4, 4), d, _dup_index(r, 4), r.randn(4, 4), alpha=2), d == 0)
            for d in (0, 1)]


def _index_copy(r: _Rand) -> List[Extra]:
    return [("dim 0, a permutation", _sample(r.randn(4, 4), 0, r.perm(4), r.randn(4, 4)), True)]


def _index_fill(r: _Rand) -> List[Extra]:
    return [("dim 0, two rows", _sample(r.randn(4, 4), 0, _dup_index(r, 2), -2.5), True)]


def _index_reduce(reduce: str) -> Callable[[_Rand], List[Extra]]:
    def build(r: _Rand) -> List[Extra]:
        selfs = (False, True) if reduce == "mean" else (False,)
        return [(f"dim 0, duplicate indices, include_self={inc}",
                 _sample(r.randn(4, 4), 0, _dup_index(r, 4), r.randn(4, 4), reduce, include_self=inc), not inc)
                for inc in selfs]

    return build


def _index_select(r: _Rand) -> List[Extra]:
    return [(f"dim {d}, duplicate indices", _sample(r.randn(4, 4), d, _dup_index(r, 4)), d == 0) for d in (0, 1)]


def _gather(r: _Rand) -> List[Extra]:
    return [(f"dim {d}", _sample(r.randn(4, 4), d, _dup_index(r, 4, 4)), d == 0) for d in (0, 1)]


def _take_along_dim(r: _Rand) -> List[Extra]:
    return [("dim 0", _sample(r.randn(4, 4), _dup_index(r, 4, 4), 0), True)]


def _index_put(r: _Rand) -> List[Extra]:
    import torch

    mask = torch.tensor([True, False, True, True])
    return [("rows, duplicate indices, accumulate=True",
             _sample(r.randn(4, 4), (_dup_index(r, 4),), r.randn(4, 4), accumulate=True), True),
            ("rows, a permutation, accumulate=False",
             _sample(r.randn(4, 4), (r.perm(4),), r.randn(4, 4), accumulate=False), False),
            ("boolean row mask, accumulate=False",
             _sample(r.randn(4, 4), (mask,), r.randn(3, 4), accumulate=False), True)]


def _put(r: _Rand) -> List[Extra]:
    return [("duplicate flat indices, accumulate=True",
             _sample(r.randn(4, 4), _dup_index(r, 4, high=16), r.randn(4), True), True)]


def _take(r: _Rand) -> List[Extra]:
    return [("flat indices", _sample(r.randn(4, 4), _dup_index(r, 4, high=16)), True)]


def _masked_select(r: _Rand) -> List[Extra]:
    return [("mask [4, 4]", _sample(r.randn(4, 4), r.randint(0, 2, 4, 4).bool()), True)]


# ----------------------------------------------------------------- masked reductions, norms, matmuls


def _mask(r: _Rand) -> Any:
    m = r.randint(0, 2, 4, 4).bool()
    m.diagonal().fill_(True)  # every row and column keeps an element
    return m


def _masked_reduction(dims: Tuple[Any, ...], positional: Tuple[Any, ...] = ()) -> Callable[[_Rand], List[Extra]]:
    def build(r: _Rand) -> List[Extra]:
        return [(f"dim {d}, plain-shaped mask", _sample(r.randn(4, 4), *positional, dim=d, mask=_mask(r)), d == 0)
                for d in dims]

    return build


def _masked_along(dims: Tuple[int, ...]) -> Callable[[_Rand], List[Extra]]:
    """masked ops that take ``dim`` positionally (softmax, cumsum)."""

    def build(r: _Rand) -> List[Extra]:
        return [(f"dim {d}", _sample(r.randn(4, 4), d, mask=_mask(r)), d == 0) for d in dims]

    return build


def _layer_norm(r: _Rand) -> List[Extra]:
    return [("normalized dim 1 (size 4)", _sample(r.randn(4, 4), (4,), weight=r.randn(4), bias=r.randn(4)), True)]


def _rms_norm(r: _Rand) -> List[Extra]:
    return [("normalized dim 1 (size 4)", _sample(r.randn(4, 4), (4,), weight=r.randn(4)), True)]


def _group_norm(r: _Rand) -> List[Extra]:
    return [("2 groups of 2 channels", _sample(r.randn(4, 4, 2), 2, weight=r.randn(4), bias=r.randn(4)), True)]


def _batch_norm(r: _Rand) -> List[Extra]:
    out: List[Extra] = []
    for training in (True, False):
        sample = _sample(r.randn(4, 2), r.randn(2), r.rand(2) + 0.5, r.randn(2), r.randn(2), training=training,
                         momentum=0.3)
        out.append((f"batch 4, training={training} (running stats updated in place when training)", sample, training))
    return out


def _two(shape_a: Tuple[int, ...], shape_b: Tuple[int, ...], *args: Any,
         **kwargs: Any) -> Callable[[_Rand], List[Extra]]:
    def build(r: _Rand) -> List[Extra]:
        return [("contracted dim of size 4", _sample(r.randn(*shape_a), r.randn(*shape_b), *args, **kwargs), True)]

    return build


def _addmm(r: _Rand) -> List[Extra]:
    return [("contracted dim of size 4", _sample(r.randn(4, 4), r.randn(4, 4), r.randn(4, 4)), True)]


def _linear(r: _Rand) -> List[Extra]:
    return [("contracted dim of size 4", _sample(r.randn(4, 4), r.randn(4, 4), r.randn(4)), True)]


def _einsum(r: _Rand) -> List[Extra]:
    return [("ij,jk->ik", _sample([r.randn(4, 4), r.randn(4, 4)], "ij,jk->ik"), True)]


def _embedding_bag(r: _Rand) -> List[Extra]:
    import torch

    ids, offsets = _dup_index(r, 6, high=4), torch.tensor([0, 2, 3, 5])
    return [("mode mean, 4 bags", _sample(r.randn(4, 4), ids, offsets=offsets, mode="mean"), True),
            ("mode sum, per_sample_weights", _sample(r.randn(4, 4), ids, offsets=offsets, mode="sum",
                                                     per_sample_weights=r.rand(6)), False)]


BUILDERS: Dict[str, Callable[[_Rand], List[Extra]]] = {
    # losses
    "nn.functional.nll_loss": _nll_loss,
    "nn.functional.cross_entropy": _cross_entropy,
    "nn.functional.binary_cross_entropy": _binary_cross_entropy,
    "nn.functional.binary_cross_entropy_with_logits": _binary_cross_entropy_with_logits,
    "nn.functional.mse_loss": _pair_loss(),
    "nn.functional.l1_loss": _pair_loss(),
    "nn.functional.smooth_l1_loss": _pair_loss(extra_kwargs={"beta": 0.5}),
    "nn.functional.huber_loss": _pair_loss(extra_kwargs={"delta": 0.5}),
    "nn.functional.soft_margin_loss": _pair_loss("sign"),
    "nn.functional.hinge_embedding_loss": _pair_loss("sign", extra_kwargs={"margin": 0.5}),
    "nn.functional.poisson_nll_loss": _pair_loss("rand", extra_kwargs={"log_input": True, "full": True}),
    "nn.functional.kl_div": _kl_div,
    "nn.functional.gaussian_nll_loss": _gaussian_nll_loss,
    "nn.functional.margin_ranking_loss": _margin_ranking_loss,
    "nn.functional.cosine_embedding_loss": _cosine_embedding_loss,
    "nn.functional.multi_margin_loss": _multi_margin_loss,
    "nn.functional.multilabel_margin_loss": _multilabel_margin_loss,
    "nn.functional.multilabel_soft_margin_loss": _multilabel_soft_margin_loss,
    "nn.functional.triplet_margin_loss": _triplet(False),
    "nn.functional.triplet_margin_with_distance_loss": _triplet(True),
    "nn.functional.ctc_loss": _ctc_loss,
    # scatter / index
    "scatter_add": _scatter_add,
    "scatter": _scatter,
    **{f"scatter_reduce.{k}": _scatter_reduce(k) for k in ("sum", "prod", "mean", "amax", "amin")},
    "index_add": _index_add,
    "index_copy": _index_copy,
    "index_fill": _index_fill,
    **{f"index_reduce.{k}": _index_reduce(k) for k in ("mean", "prod", "amax", "amin")},
    "index_select": _index_select,
    "gather": _gather,
    "take_along_dim": _take_along_dim,
    "index_put": _index_put,
    "put": _put,
    "take": _take,
    "masked_select": _masked_select,
    "nn.functional.embedding_bag": _embedding_bag,
    # masked reductions (plain mask)
    "masked.sum": _masked_reduction((0, 1)),
    "masked.mean": _masked_reduction((0, 1)),
    "masked.prod": _masked_reduction((0,)),
    "masked.amax": _masked_reduction((0,)),
    "masked.amin": _masked_reduction((0,)),
    "masked.argmax": _masked_reduction((0,)),
    "masked.var": _masked_reduction((0,)),
    "masked.std": _masked_reduction((0,)),
    "masked.logsumexp": _masked_reduction((0,)),
    "masked.norm": _masked_reduction((0,), positional=(2.0,)),
    "masked.softmax": _masked_along((0,)),
    "masked.log_softmax": _masked_along((0,)),
    "masked.cumsum": _masked_along((0,)),
    # norms (plain weight, bias, running stats)
    "nn.functional.layer_norm": _layer_norm,
    "nn.functional.rms_norm": _rms_norm,
    "nn.functional.group_norm": _group_norm,
    "nn.functional.batch_norm": _batch_norm,
    # contractions
    "mm": _two((4, 4), (4, 4)),
    "matmul": _two((4, 4), (4, 4)),
    "bmm": _two((2, 4, 4), (2, 4, 4)),
    "mv": _two((4, 4), (4,)),
    "dot": _two((4,), (4,)),
    "inner": _two((4, 4), (4, 4)),
    "linalg.vecdot": _two((4, 4), (4, 4)),
    "tensordot": _two((4, 4), (4, 4), dims=1),
    "nn.functional.cosine_similarity": _two((4, 4), (4, 4), dim=1),
    "nn.functional.pairwise_distance": _two((4, 4), (4, 4)),
    "cdist": _two((4, 4), (4, 4)),
    "dist": _two((4, 4), (4, 4)),
    "addmm": _addmm,
    "nn.functional.linear": _linear,
    "einsum": _einsum,
}

EXTRA_MODES = ("all", "key", "none")


def extra_samples(name: str, seed: int, mode: str = "all") -> List[Tuple[int, str, Any]]:
    """The sweep's own samples for op ``name`` as (number, tag, SampleInput): [] for ops without any, or
    ``mode`` "none"; mode "key" keeps the CI subset's. Numbers run from ``EXTRA_BASE`` over all of the
    op's samples, so a sample has the same number in every mode."""
    build = BUILDERS.get(name)
    if build is None or mode == "none":
        return []
    if mode not in EXTRA_MODES:
        raise ValueError(f"extra mode {mode!r}: one of {EXTRA_MODES}")
    found = build(_Rand(seed))
    return [(EXTRA_BASE + number, tag, sample) for number, (tag, sample, key) in enumerate(found)
            if key or mode == "all"]

"""Which torch releases the package supports: the range CI runs the whole suite on.

Kept free of torch imports: auto-activation consults it while ``import torch`` is still running.

Three answers for a release: inside the range (supported); older than ``OLDEST_TORCH`` (not supported: torch
2.9.1 calls a dispatch rule that returns ``NotImplemented`` again instead of falling back to DTensor, and 2.9 to 2.11
drop in-place foreach writes into ``Partial`` DTensors, worked around on 2.11 only; 2.10 was not checked); newer than
``NEWEST_TORCH`` (refused unless the user opts in, and then only if the built-in self-check of every torch internal
the package uses passes: see ``selfcheck``).

Also here, the defects of supported releases that the engine works around on those releases only, each
tied to the releases it was seen on.
"""

from __future__ import annotations

import re
import sys
from typing import Dict, Optional, Tuple

OLDEST_TORCH: Tuple[int, int] = (2, 11)
"""Oldest supported torch (major, minor); CI runs the layers that meet torch on it (2.11.0)."""
NEWEST_TORCH: Tuple[int, int] = (2, 15)
"""Newest torch minor release the suite was run on (CI runs it on 2.15.0)."""

SUPPORTED = "supported"
OLDER = "older"
NEWER = "newer"
UNREADABLE = "unreadable"


def supported_range() -> str:
    """The supported range in words, e.g. ``"torch 2.11 to 2.15.x"``."""
    return f"torch {OLDEST_TORCH[0]}.{OLDEST_TORCH[1]} to {NEWEST_TORCH[0]}.{NEWEST_TORCH[1]}.x"


def running_torch_version() -> str:
    """The version of the torch this process runs (or will import): what the gate reads.

    ``torch.__version__`` once torch is (being) imported, else the installed distribution's version;
    reading it never imports torch.
    """
    version = getattr(sys.modules.get("torch"), "__version__", None)
    if version is None:
        from importlib.metadata import version as installed_version

        version = installed_version("torch")
    return str(version)


def release_of(version: str) -> Optional[Tuple[int, int]]:
    """(major, minor) of a version string such as ``"2.13.0+cpu"``; None when it cannot be read."""
    match = re.match(r"(\d+)\.(\d+)", str(version))
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def classify(version: str) -> str:
    """``SUPPORTED``, ``OLDER``, ``NEWER`` or ``UNREADABLE``."""
    release = release_of(version)
    if release is None:
        return UNREADABLE
    if release < OLDEST_TORCH:
        return OLDER
    if release > NEWEST_TORCH:
        return NEWER
    return SUPPORTED


ALLOW_NEWER_HINT = ("to try it anyway, set KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH=1 or call "
                    "patch(allow_newer_torch=True): the package then runs its self-check of those internals first "
                    "and activates only if it passes (`python -m keras_dtensor_mixfix doctor` shows it)")


def unsupported_reason(version: str) -> Optional[str]:
    """Why ``version`` (e.g. ``torch.__version__``) is not supported, or None when it is.

    A newer release's reason says how to opt in; an older one's, that it is never supported.
    """
    kind = classify(version)
    if kind == SUPPORTED:
        return None
    if kind == UNREADABLE:
        return f"cannot read torch's version {version!r}; supported: {supported_range()}"
    reason = (f"torch {version} is outside the supported range ({supported_range()}): the mechanism relies on torch "
              "internals checked only on those releases (see keras_dtensor_mixfix._torch.api)")
    if kind == NEWER:
        return f"{reason}; {ALLOW_NEWER_HINT}"
    return (f"{reason}; releases before {OLDEST_TORCH[0]}.{OLDEST_TORCH[1]} are never supported (torch 2.9 and 2.10 "
            "drop in-place foreach writes into Partial DTensors; 2.9 calls a dispatch rule that declines a call again "
            "instead of falling back to DTensor)")


# The defects of torch 2.11, the oldest supported release, that the package meets where it promotes a call; the
# rest of what 2.11's DTensor cannot do (with or without the package) is in docs/troubleshooting.md.
TORCH_DEFECTS: Dict[str, Tuple[Tuple[int, int], ...]] = {
    # DTensor runs an in-place _foreach_* op whose written list holds a Partial DTensor as a no-op (seen on 2.9.1,
    # 2.10.0 and 2.11.0; right on 2.12.1, 2.13.0, 2.14.1 and 2.15.0): repros/torch_foreach_inplace_partial.py,
    # worked around for the calls the package promotes by _engine/foreach_partial.py.
    "inplace_foreach_on_partial_dropped": ((2, 9), (2, 10), (2, 11)),
    # DTensor's stack with a negative dim normalizes it against the inputs' rank, not the output's, so an input
    # split along a dim at or after the new one comes out labelled split along the dim after it: a wrong global
    # shape (seen on 2.11.0; right on 2.12.1 and later): repros/torch_stack_negative_dim.py, worked around for the
    # calls the package promotes by _engine/corrections.py (the dim made non-negative: the same op).
    "stack_negative_dim_misplaced": ((2, 11),),
    # DTensor has no sharding strategy for the in-place index_put_ (the out-of-place index_put has one): seen on
    # 2.11.0 (keras_hub's generate writes its cache with it); there on 2.12.1 and later. Worked around for the calls
    # the package promotes by _engine/corrections.py (index_put, then its value written into self in place).
    "index_put_inplace_without_strategy": ((2, 11),),
    # DTensor's index_put into a self split along a dim the indices index keeps that split when the values have as
    # many dims as self (they broadcast), so each rank writes global indices into its own piece: an IndexError, a
    # shape mismatch, or a silently wrong row (seen on 2.11.0; right on 2.12.1 and later):
    # repros/torch_index_put_split_self.py, worked around for the calls the package promotes by
    # _engine/corrections.py (self replicated along those dims for the call, the result split back).
    "index_put_split_self_misplaced": ((2, 11),),
    # DTensor has no sharding strategy for ops that 2.12 and later derive from their decompositions
    # (binary_cross_entropy_with_logits, index_add_, index_copy_, ...), with every operand a DTensor too (seen on
    # 2.11.0):
    # repros/torch_no_decomposition_strategy.py, worked around for the calls the package promotes by
    # _engine/corrections.py (binary_cross_entropy_with_logits by its elementwise formula; index_add and index_copy
    # on each rank's whole local values).
    "no_strategy_from_decomposition": ((2, 11),),
    # DTensor labels a convolution's weight and bias gradients Partial over the first mesh dim whatever the input's
    # layout, so with a replicated input they come out multiplied by the mesh size (seen on 2.11.0; right on 2.12.1
    # and later): repros/torch_conv_weight_grad_partial.py; the built-in rule pack refuses the mixed calls that
    # would meet it (_rules/builtin_pack.py).
    "conv_weight_grad_partial": ((2, 11),),
    # DTensor's convolution handler holds every call to the limits of its tensor-parallel convolution (stride equal to
    # the kernel size where there is padding), a replicated input included (seen on 2.11.0; right on 2.12.1 and
    # later): repros/torch_conv_handler_unsplit.py; the Keras integration's convolution runs on local pieces there
    # (_keras/ops/convolution.py); a mixed call outside Keras gets torch's error.
    "conv_handler_refuses_unsplit": ((2, 11),),
    # DTensor cannot flatten several dims into one when a dim after the first is split, which its einsum and matmul
    # do on their way to bmm (seen on 2.11.0; right on 2.12.1 and later): repros/torch_view_flatten_split_dim.py; the
    # Keras integration's einsum and matmul run on whole values there where they cannot run on local pieces
    # (_keras/ops/local_einsum.py), and its slice_update of a plain tensor takes the update's whole value
    # (_keras/ops/tensor_ops.py); anything else gets torch's error.
    "view_flatten_split_dim": ((2, 11),),
    # DTensor's constant_pad_nd on a 2-D mesh gives its result one placement instead of one per mesh dim: malformed,
    # or an IndexError for a split input (seen on 2.11.0; right on 2.12.1 and later): repros/torch_pad_2d_mesh.py;
    # the Keras integration's pad pads each rank's piece there (_keras/ops/tensor_ops.py).
    "pad_2d_mesh_one_placement": ((2, 11),),
    # DTensor has no strategy for flip, which cumsum's backward calls (seen on 2.11.0; right on 2.12.1 and later):
    # repros/torch_flip_no_strategy.py; the Keras integration's cumsum runs on each rank's piece there
    # (_keras/ops/tensor_ops.py).
    "flip_without_strategy": ((2, 11),),
    # DTensor's cumsum with a negative dim ignores that the input is split along it: each rank sums its own piece,
    # silently (seen on 2.11.0, 2.12.1 and 2.13.0; right on 2.14.1 and 2.15.0): repros/torch_cumsum_negative_dim.py;
    # the Keras integration's cumsum counts the axis from the start there (_keras/ops/tensor_ops.py).
    "cumsum_negative_dim_ignored": ((2, 11), (2, 12), (2, 13)),
    # DTensor has no strategy for ne.Tensor (eq.Tensor and the other comparisons have one; seen on 2.11.0; right on
    # 2.12.1 and later): repros/torch_ne_tensor_no_strategy.py; a mixed call is computed as logical_not(eq) there
    # (_engine/corrections.py: keras_hub's RWKV7 compares its token ids with 0).
    "ne_tensor_without_strategy": ((2, 11),),
}
"""The defects of supported releases that the engine works around on those releases only: each one's name and
the (major, minor) releases it was seen on; ``tests/patterns/test_torch_repros.py`` runs each repro on every
supported release, so that this table stays what the releases do."""


def has_defect(name: str, version: str) -> bool:
    """Whether torch ``version`` has the defect ``name`` of ``TORCH_DEFECTS``."""
    return release_of(version) in TORCH_DEFECTS[name]


def drops_inplace_foreach_on_partial(version: str) -> bool:
    """Whether torch ``version`` runs in-place foreach ops into ``Partial`` DTensors as no-ops."""
    return has_defect("inplace_foreach_on_partial_dropped", version)

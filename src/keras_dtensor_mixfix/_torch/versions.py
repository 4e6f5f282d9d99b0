"""Which torch releases the package supports: the range CI runs the whole suite on.

Kept free of torch imports: auto-activation consults it while ``import torch`` is still running.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

OLDEST_TORCH: Tuple[int, int] = (2, 13)
"""Oldest supported torch (major, minor); CI runs the suite on it."""
NEWEST_TORCH: Tuple[int, int] = (2, 15)
"""Newest torch minor release the suite was run on (CI runs it on 2.15.0)."""


def supported_range() -> str:
    """The supported range in words, e.g. ``"torch 2.13 to 2.15.x"``."""
    return f"torch {OLDEST_TORCH[0]}.{OLDEST_TORCH[1]} to {NEWEST_TORCH[0]}.{NEWEST_TORCH[1]}.x"


class UnsupportedTorchError(RuntimeError):
    """``patch()`` on a torch release outside the supported range (see :func:`supported_range`)."""


def unsupported_reason(version: str) -> Optional[str]:
    """Why ``version`` (e.g. ``torch.__version__``) is not supported, or None when it is."""
    match = re.match(r"(\d+)\.(\d+)", str(version))
    if match is None:
        return f"cannot read torch's version {version!r}; supported: {supported_range()}"
    release = (int(match.group(1)), int(match.group(2)))
    if OLDEST_TORCH <= release <= NEWEST_TORCH:
        return None
    return (f"torch {version} is outside the supported range ({supported_range()}): the mechanism relies on torch "
            "internals checked only on those releases (see keras_dtensor_mixfix._torch.api)")

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
from typing import Optional, Tuple

from .._upstream import applies

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


def has_defect(name: str, version: str) -> bool:
    """Whether torch ``version`` has the defect ``name`` of the upstream-defect table (``_upstream.DEFECTS``), which
    decides where its workaround is installed."""
    return applies(name, release_of(version))


def drops_inplace_foreach_on_partial(version: str) -> bool:
    """Whether torch ``version`` runs in-place foreach ops into ``Partial`` DTensors as no-ops."""
    return has_defect("inplace_foreach_on_partial_dropped", version)

"""The version gate: may the package activate on the torch this process runs?

- inside the supported range (``_torch.versions``): yes;
- older than the oldest supported release: never;
- newer than the newest tested release: no, unless the user opted in (``patch(allow_newer_torch=True)`` or
  ``KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_TORCH=1``); then the self-check of every torch internal the package
  relies on runs first (once per process): it passes, and the package activates with one warning line; it
  fails, and the package refuses, naming the failing check.

Importing this module does not import torch: auto-activation consults it while ``import torch`` runs
(only the self-check imports torch, and it runs once DTensor is imported).
"""

from __future__ import annotations

from typing import Optional

from .._rules.env import ALLOW_NEWER_TORCH, allow_newer_torch, warn_once
from .._torch import versions  # read as attributes at each call: tests simulate another torch there

def opted_in(allow_newer: Optional[bool] = None) -> bool:
    """The opt-in in force: the argument when given, else the environment."""
    return allow_newer_torch() if allow_newer is None else bool(allow_newer)


def deferred_to_self_check(allow_newer: Optional[bool] = None) -> bool:
    """True for a newer torch with the opt-in on: only the self-check (run later, with DTensor) can decide."""
    return versions.classify(versions.running_torch_version()) == versions.NEWER and opted_in(allow_newer)


def refusal(allow_newer: Optional[bool] = None) -> Optional[str]:
    """None when the package may activate on this torch, else why not (one line).

    For a newer torch with the opt-in on this runs the self-check (imports DTensor; cached per process)
    and, the first time it passes, logs the one warning line that says the package runs on an untested torch.
    """
    version = versions.running_torch_version()
    reason = versions.unsupported_reason(version)
    if reason is None:
        return None
    if versions.classify(version) != versions.NEWER or not opted_in(allow_newer):
        return reason
    from .._torch.selfcheck import self_check

    report = self_check()
    how = "patch(allow_newer_torch=True)" if allow_newer else f"{ALLOW_NEWER_TORCH}=1"
    newer = (f"torch {version} is newer than the newest tested release ({versions.supported_range()}); opted in "
             f"with {how}")
    if not report.ok:
        return (f"{newer}, but the {report.summary()}; `python -m keras_dtensor_mixfix doctor` lists every check; "
                "install a supported torch")
    warn_once(("newer release", "torch"), "keras_dtensor_mixfix: %s, and the %s, so promotion is on", newer,
              report.summary())
    return None

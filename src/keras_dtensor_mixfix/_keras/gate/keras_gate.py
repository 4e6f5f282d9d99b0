"""The Keras gate: may the Keras integration install into the Keras this process imports?

- inside the supported releases (:data:`.keras_modules.OLDEST_KERAS` to :data:`.keras_modules.NEWEST_KERAS`): yes;
- older: never (untested; 3.0.5 lacks Keras' ``tree`` module, the common ``Variable`` class, the trainer's
  ``_compute_loss`` and Keras' torch ``dot_product_attention``, which the integration relies on);
- newer: no, unless the user opted in (``KERAS_DTENSOR_MIXFIX_ALLOW_NEWER_KERAS=1``, or
  ``keras_integration.install(allow_newer_keras=True)``); then the Keras self-check (:mod:`.selfcheck`)
  runs first, once per process: it passes, and the integration installs with one warning line; it fails,
  and the integration stays out, naming the failing check.

Where the answer is no, Keras is left exactly as it is (the torch promotion is decided by the torch gate
alone). Importing this module imports no Keras; :func:`refusal` reads the running Keras' version.
"""

from __future__ import annotations

from typing import Optional

from ..._rules.env import ALLOW_NEWER_KERAS, allow_newer_keras, warn_once
from ..._torch.versions import release_of
from ..boundary import keras_modules

SUPPORTED = "supported"
OLDER = "older"
NEWER = "newer"
UNREADABLE = "unreadable"

INSTALL_SUPPORTED = "pip install 'keras>={0}.{1},<{2}.{3}'"
"""The install command that brings a supported Keras (formatted with the range)."""


def supported_releases() -> str:
    """The supported releases in words, e.g. ``"Keras 3.12 to 3.16.x"``."""
    (old_major, old_minor), (new_major, new_minor) = keras_modules.OLDEST_KERAS, keras_modules.NEWEST_KERAS
    return f"Keras {old_major}.{old_minor} to {new_major}.{new_minor}.x"


def install_command() -> str:
    """The pip command that installs a supported Keras."""
    (old_major, old_minor), (new_major, new_minor) = keras_modules.OLDEST_KERAS, keras_modules.NEWEST_KERAS
    return INSTALL_SUPPORTED.format(old_major, old_minor, new_major, new_minor + 1)


def classify(version: str) -> str:
    """``SUPPORTED``, ``OLDER``, ``NEWER`` or ``UNREADABLE`` for a Keras version string (``"3.16.0.dev2026102704"``)."""
    release = release_of(version)
    if release is None:
        return UNREADABLE
    if release < keras_modules.OLDEST_KERAS:
        return OLDER
    if release > keras_modules.NEWEST_KERAS:
        return NEWER
    return SUPPORTED


def unsupported_reason(version: str) -> Optional[str]:
    """Why the integration does not install into Keras ``version`` by default, or None when it does."""
    kind = classify(version)
    if kind == SUPPORTED:
        return None
    left = ("the Keras integration (keras.distribution on the torch backend) is not installed and Keras runs as it "
            "is; torch promotion is unaffected")
    if kind == UNREADABLE:
        return f"cannot read Keras' version {version!r}: {left}; supported: {supported_releases()}"
    if kind == NEWER:
        return (f"Keras {version} is newer than the newest tested release ({supported_releases()}): {left}; to try it, "
                f"set {ALLOW_NEWER_KERAS}=1 (or call keras_integration.install(allow_newer_keras=True)): the package "
                "then runs its self-check of the Keras internals it uses first and installs only if it passes "
                "(`python -m keras_dtensor_mixfix doctor` shows it)")
    return (f"Keras {version} is older than the supported releases ({supported_releases()}): {left}; to shard with "
            f"keras.distribution on torch, install a supported Keras ({install_command()})")


def opted_in(allow_newer: Optional[bool] = None) -> bool:
    """The opt-in in force: the argument when given, else the environment."""
    return allow_newer_keras() if allow_newer is None else bool(allow_newer)


def refusal(allow_newer: Optional[bool] = None) -> Optional[str]:
    """None when the integration may install into the running Keras, else why not (one line).

    For a newer Keras with the opt-in on this runs the Keras self-check (in a subprocess; cached per
    process) and, the first time it passes, logs the one warning line that says the integration runs on
    an untested Keras.
    """
    version = keras_modules.running_keras_version()
    reason = unsupported_reason(version)
    if reason is None:
        return None
    if classify(version) != NEWER or not opted_in(allow_newer):
        return reason
    from .selfcheck import self_check

    report = self_check()
    how = "install(allow_newer_keras=True)" if allow_newer else f"{ALLOW_NEWER_KERAS}=1"
    newer = f"Keras {version} is newer than the newest tested release ({supported_releases()}); opted in with {how}"
    if not report.ok:
        return (f"{newer}, but the {report.summary()}; the Keras integration is not installed and Keras runs as it is "
                f"(`python -m keras_dtensor_mixfix doctor` lists every check); install a supported Keras "
                f"({install_command()})")
    warn_once(("newer release", "Keras"), "keras_dtensor_mixfix: %s, and the %s, so the Keras integration is installed",
              newer, report.summary())
    return None

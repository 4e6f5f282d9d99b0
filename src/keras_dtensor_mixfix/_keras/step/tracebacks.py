"""Keras' traceback filter hides the integration's frames, as it hides Keras' own.

Keras removes its internal frames from the traceback of an error raised in a model's call or a step
(``keras.config.enable_traceback_filtering``, on by default). The integration wraps some of those
internals (the step functions, ``Layer.__call__``): without this, the traceback of a user's own mistake
would show the wrappers' frames, which Keras alone would not, and so differ from the same program
without the package. With filtering off, every frame shows, ours included.
"""

from __future__ import annotations

import os

from ..._lifecycle.recorder import PatchRecorder
from ..boundary import keras_modules, keras_private
from ..boundary.overrides import Override

INTEGRATION_DIRECTORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""Where the integration's wrappers live (this package's ``_keras``, all its sub-packages): its frames are hidden."""


def _integration_frames_hidden(patches: PatchRecorder) -> None:
    traceback_utils = keras_modules.traceback_utils()
    excluded = tuple(keras_private.traceback_excluded_paths())
    if INTEGRATION_DIRECTORY not in excluded:
        patches.set(traceback_utils, keras_private.TRACEBACK_EXCLUDED_PATHS, excluded + (INTEGRATION_DIRECTORY,))


OVERRIDE = Override(
    name="tracebacks", attributes=(keras_private.TRACEBACK_EXCLUDED_PATHS,),
    description="tracebacks: Keras' filter hides the integration's frames as it hides its own",
    apply=_integration_frames_hidden)

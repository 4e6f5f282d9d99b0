"""What the installed Keras can do, for tests that need more than the supported floor (Keras 3.12)."""

from __future__ import annotations

import importlib.util
import re

import pytest


def _keras_release():
    if importlib.util.find_spec("keras") is None:
        return None
    from keras.src.version import __version__

    match = re.match(r"(\d+)\.(\d+)", __version__)
    return (int(match.group(1)), int(match.group(2))) if match else None


KERAS_RELEASE = _keras_release()
"""(major, minor) of the installed Keras, or None without Keras."""

OPS_TRACE_IN_ONE_GRAPH = KERAS_RELEASE is None or KERAS_RELEASE >= (3, 15)
"""Keras' ops trace in one graph under torch.compile (3.15 and later: repros/keras_ops_fullgraph.py)."""

one_graph = pytest.mark.skipif(not OPS_TRACE_IN_ONE_GRAPH, reason=(
    "Keras 3.12 to 3.14's ops do not trace in one graph: any_symbolic_tensors flattens its arguments with torch's "
    "pytree, which TorchDynamo cannot trace (repros/keras_ops_fullgraph.py, Keras alone); fullgraph=True is proven "
    "on Keras 3.15 and 3.16"))
"""For a test that compiles Keras ops with ``fullgraph=True``."""

"""Minimal repros of the Keras limitations the package's tests step around; each fails where the limitation is.

Each runs as a strict expected failure on the Keras releases where it shows and must pass on the others, so the
day a release lifts one, the suite says so.
"""

from __future__ import annotations

import os
import sys

import pytest

from _keras_releases import OPS_TRACE_IN_ONE_GRAPH

pytest.importorskip("keras", reason="the Keras repros need Keras")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "repros"))

import keras_duplicate_path_not_a_torch_parameter  # noqa: E402
import keras_layer_compile_region_reuse  # noqa: E402
import keras_ops_fullgraph  # noqa: E402


@pytest.mark.xfail(not OPS_TRACE_IN_ONE_GRAPH, strict=True, reason=(
    "Keras 3.12 to 3.14: any_symbolic_tensors' tree.flatten cannot be traced by TorchDynamo"))
def test_a_keras_op_traces_in_one_graph():
    import torch

    try:
        keras_ops_fullgraph.repro()
    except torch._dynamo.exc.Unsupported as exc:
        assert "Failed to trace builtin operator" in str(exc), exc
        raise


def _torch_release():
    import torch

    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


# reused on torch 2.12.1 with Keras 3.15.1; torch 2.13 refuses to reuse a region with side effects (Keras'
# Layer.__call__ sets _called); on Keras 3.12 to 3.14 a graph break inside the region is an error
@pytest.mark.xfail(not OPS_TRACE_IN_ONE_GRAPH or _torch_release() >= (2, 13), strict=True, reason=(
    "Keras' Layer.__call__ has side effects, so TorchDynamo (2.13 and later) traces a marked layer at every call"))
def test_a_repeated_keras_layer_is_compiled_once():
    keras_layer_compile_region_reuse.repro()


# seen on Keras 3.12.4, 3.15.1 and keras-nightly 3.16.0.dev2026102704
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "Keras' torch backend keys a layer's parameters by path: of two variables with one path, one is no torch parameter "
    "(Keras 3.16's DataParallel, DistributedDataParallel, then never reduces its gradient: keras_hub SmolLM3)"))
def test_every_trainable_variable_is_a_torch_parameter_of_the_model():
    keras_duplicate_path_not_a_torch_parameter.repro()

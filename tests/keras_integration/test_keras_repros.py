"""Minimal repros of the Keras limitations the package's tests step around; each fails where the limitation is.

Each takes its releases from the upstream-defect table (``_upstream.DEFECTS``): a strict expected failure where the
table says the running Keras has the defect, a test that must pass where it says not, so the day a release lifts one,
the suite says so.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from _keras_releases import KERAS_RELEASE, OPS_TRACE_IN_ONE_GRAPH
from keras_dtensor_mixfix._torch.versions import release_of
from keras_dtensor_mixfix._upstream import BY_NAME, DEFECTS

pytest.importorskip("keras", reason="the Keras repros need Keras")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "repros"))

import keras_duplicate_path_not_a_torch_parameter
import keras_layer_compile_region_reuse
import keras_ops_fullgraph

_TESTED: set = set()


def keras_defect(name, only_when=True, also_when=False, **xfail_arguments):
    """A strict expected failure where the table's entry ``name`` applies to the running Keras and ``only_when``
    holds (a defect that also needs a torch release), or where ``also_when`` holds (another defect in the way)."""
    _TESTED.add(name)
    defect = BY_NAME[name]
    expected = (defect.applies(KERAS_RELEASE) and only_when) or also_when
    return pytest.mark.xfail(expected, strict=True, **xfail_arguments,
                             reason=f"Keras {KERAS_RELEASE}: {defect.summary}; "
                                    f"{defect.workaround.value}: {defect.where}")


@keras_defect("keras_ops_not_one_graph")
def test_a_keras_op_traces_in_one_graph():
    import torch

    try:
        keras_ops_fullgraph.repro()
    except torch._dynamo.exc.Unsupported as exc:
        assert "Failed to trace builtin operator" in str(exc), exc
        raise


# Keras' side of a defect that also needs torch 2.13 or later (torch refuses to reuse a region with side effects:
# Keras' Layer.__call__ sets _called): reused on torch 2.12.1 with Keras 3.15.1; on Keras 3.12 to 3.14 a graph break
# inside the region is an error on every torch
@keras_defect("keras_layer_compile_no_region_reuse", only_when=release_of(torch.__version__) >= (2, 13),
              also_when=not OPS_TRACE_IN_ONE_GRAPH)
def test_a_repeated_keras_layer_is_compiled_once():
    keras_layer_compile_region_reuse.repro()


@keras_defect("keras_duplicate_path_not_a_parameter", raises=AssertionError)
def test_every_trainable_variable_is_a_torch_parameter_of_the_model():
    keras_duplicate_path_not_a_torch_parameter.repro()


def test_every_keras_defect_of_the_table_is_run_here():
    assert _TESTED == {defect.name for defect in DEFECTS if defect.upstream == "keras"}

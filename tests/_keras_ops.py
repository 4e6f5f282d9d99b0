"""What the Keras op tests share: the upstream-defect table asked of the running torch, the integration installed
as this torch installs it or as on torch 2.11, and placements from a short spec."""

from __future__ import annotations

import contextlib

import pytest

VOCAB, LENGTH, HEADS, DEPTH = 32, 6, 2, 4
"""The shapes of the op tests' small language model: vocabulary, sequence length, attention heads, head depth."""

def torch_has(defect):
    """Whether the running torch has the upstream-defect table's entry ``defect``."""
    import torch

    from keras_dtensor_mixfix._torch.versions import has_defect

    return has_defect(defect, torch.__version__)


def as_installed_and_as_on_2_11(defect, reason):
    """The ``as_on_2_11`` parameter of a test of a torch-2.11 workaround: the integration as this torch installs it
    (left out where this torch has ``defect``: ``reason``), and as on 2.11, ``defect`` forced."""
    return pytest.mark.parametrize("as_on_2_11", [
        pytest.param(False, marks=pytest.mark.skipif(torch_has(defect), reason=reason)), True],
        ids=["as-installed", "as-on-2.11"])


@contextlib.contextmanager
def installed(defect, as_on_2_11):
    """The integration installed (with ``as_on_2_11``: as on torch 2.11, ``defect`` forced), uninstalled after."""
    from _ranks import forced_defect

    from keras_dtensor_mixfix import keras_integration

    with forced_defect(defect, as_on_2_11):
        assert keras_integration.install()
    try:
        yield
    finally:
        keras_integration.uninstall()


def placements_of(spec):
    """DTensor placements from a spec of "R" (replicated) or a tensor dim (split along it), one per mesh dim."""
    from torch.distributed.tensor import Replicate, Shard

    return tuple(Replicate() if p == "R" else Shard(p) for p in spec)

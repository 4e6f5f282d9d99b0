"""What the installed Keras can do, for tests that need more than the supported floor (Keras 3.12)."""

from __future__ import annotations

import contextlib
import importlib.util
import re

import pytest

from keras_dtensor_mixfix._upstream import applies


def _keras_release():
    if importlib.util.find_spec("keras") is None:
        return None
    from keras.src.version import __version__

    match = re.match(r"(\d+)\.(\d+)", __version__)
    return (int(match.group(1)), int(match.group(2))) if match else None


KERAS_RELEASE = _keras_release()
"""(major, minor) of the installed Keras, or None without Keras."""

OPS_TRACE_IN_ONE_GRAPH = KERAS_RELEASE is None or not applies("keras_ops_not_one_graph", KERAS_RELEASE)
"""Keras' ops trace in one graph under torch.compile (3.15 and later: the upstream-defect table's
``keras_ops_not_one_graph``, repros/keras_ops_fullgraph.py)."""

one_graph = pytest.mark.skipif(not OPS_TRACE_IN_ONE_GRAPH, reason=(
    "Keras 3.12 to 3.14's ops do not trace in one graph: any_symbolic_tensors flattens its arguments with torch's "
    "pytree, which TorchDynamo cannot trace (repros/keras_ops_fullgraph.py, Keras alone); fullgraph=True is proven "
    "on Keras 3.15 and 3.16"))
"""For a test that compiles Keras ops with ``fullgraph=True``."""

compiles_whole = pytest.mark.skipif(not OPS_TRACE_IN_ONE_GRAPH, reason=(
    "Keras before 3.15 compiles op by op (minutes on 2 cores: repros/keras_ops_fullgraph.py); the code under test is "
    "the same on every Keras and runs on 3.15 and later (CI: the keras_hub environment, Keras 3.15.1)"))
"""For a compiled test whose code is the same on every Keras: where Keras' ops break the graph, each op compiles
alone, which costs minutes and proves nothing more."""


def feeds_own_shard():
    """Whether each process feeds its own shard of the batch (Keras 3.16's own data distribution, which refuses
    NumPy input on several processes unless told ``auto_shard_dataset = False``); earlier Keras with the package:
    each process feeds the global batch and keeps its slice."""
    from keras_dtensor_mixfix._keras.boundary import keras_modules

    return keras_modules.native_data_distribution()


def for_this_process(distribution, arrays, batch_size):
    """``distribution`` made ready for NumPy input, and ``arrays`` and ``batch_size`` as this process feeds them,
    so that every global batch holds the rows one process's batch holds: the global batch on Keras 3.12 to 3.15;
    on Keras 3.16, this process's rows of each global batch (the rows of its coordinate on the batch axis:
    consecutive ranks share one under ``ModelParallel``, as ``DeviceMesh`` lays devices out)."""
    import torch.distributed as dist

    if not feeds_own_shard():
        return distribution, arrays, batch_size
    distribution.auto_shard_dataset = False
    mesh = distribution.device_mesh
    shards = mesh.shape[mesh.axis_names.index(distribution.batch_dim_name)] if hasattr(
        distribution, "batch_dim_name") and distribution.batch_dim_name in mesh.axis_names else mesh.shape[0]
    ranks_per_shard = dist.get_world_size() // shards
    coordinate = dist.get_rank() // ranks_per_shard
    per_process = batch_size // shards

    def rows(array):
        batched = array.reshape(len(array) // batch_size, shards, per_process, *array.shape[1:])
        return batched[:, coordinate].reshape(-1, *array.shape[1:])

    return distribution, [rows(array) for array in arrays], per_process


@contextlib.contextmanager
def drawing_as_distributed_jobs():
    """For a one-process reference: within, Keras' element-wise random initializers draw the initial values a
    distributed job draws (``keras_integration.sharding_independent_initial_values``), the integration installed
    for the block where it is not."""
    from keras_dtensor_mixfix import keras_integration

    installed_here = not keras_integration.is_installed() and keras_integration.install()
    try:
        with keras_integration.sharding_independent_initial_values():
            yield
    finally:
        if installed_here:
            keras_integration.uninstall()

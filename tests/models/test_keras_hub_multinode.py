"""keras_hub Gemma under ModelParallel across two torchrun "nodes" on 127.0.0.1, against one process.

``torchrun --nnodes 2 --node-rank K --nproc-per-node 2`` twice (K = 0, 1), as on two machines: 4
ranks on a (2, 2) ("batch", "model") mesh, so the "model" axis stays inside a node (ranks 0-1 and
2-3) and the "batch" axis crosses nodes, the usual layout for tensor parallelism inside a node and
data parallelism across nodes. The program is ``test_keras_hub``'s (``fit``, ``train_on_batch``,
``evaluate``, ``predict``, ``get_weights``, ``generate()``); rank 0 saves its global values, which
must equal the single-process run's. Run as a script, this file is that program.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CASE = ("gemma", "model_parallel", (2, 2))


def _free_port() -> int:
    from keras_dtensor_mixfix._loopback_ports import free_port as below_the_ephemeral_range  # as rank pools draw

    return below_the_ephemeral_range()


def test_two_nodes_equal_single_process(tmp_path):
    hub = pytest.importorskip("test_keras_hub", reason="needs keras_hub (see tests/models/test_keras_hub.py)",
                              exc_type=ImportError)
    port = _free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", KERAS_BACKEND="torch", OMP_NUM_THREADS="1",
               KERAS_DTENSOR_MIXFIX="0")  # the program installs the integration itself, as the other hub tests do
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                               str(node), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                               str(port), os.path.abspath(__file__), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for node in (0, 1)]
    outputs = []
    for node in nodes:
        try:
            outputs.append(node.communicate(timeout=900)[0])
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            raise
    for node, (process, output) in enumerate(zip(nodes, outputs)):
        assert process.returncode == 0, f"node {node}:\n{output[-6000:]}"
    with np.load(tmp_path / "rank0.npz", allow_pickle=True) as saved:
        out = saved["out"].item()
    reference = hub._reference(CASE[0])
    np.testing.assert_allclose(out["history"]["loss"], reference["history"]["loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["logs"], reference["logs"], rtol=1e-5, atol=1e-6)
    for key, want in reference["evaluated"].items():
        np.testing.assert_allclose(out["evaluated"][key], want, rtol=1e-5, atol=1e-6, err_msg=key)
    for got, want in zip(out["trained"], reference["trained"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["predicted"], reference["predicted"][out["rows"]], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out["generated"], reference["generated"])
    # the vocabulary over "model" (inside a node), the hidden dim over "batch" (across nodes)
    assert dict(out["placements"])["token_embedding/embeddings"] == ("S(1)", "S(0)"), out["placements"]


def _node_main(directory: str) -> None:
    import torch.distributed as dist

    sys.path.insert(0, HERE)
    import test_keras_hub as hub

    dist.init_process_group("gloo")
    try:
        assert dist.get_world_size() == 4, dist.get_world_size()
        out = hub.distributed_cases([CASE])[CASE]
        if not isinstance(out, dict):
            raise RuntimeError(out)
        if dist.get_rank() == 0:
            np.savez(os.path.join(directory, "rank0.npz"), out=np.asarray(out, dtype=object))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _node_main(sys.argv[1])

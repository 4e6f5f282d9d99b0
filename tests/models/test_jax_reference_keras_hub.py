"""JAX as the reference: keras_hub's Gemma (tiny) under ModelParallel on torch (2 or 4 gloo ranks) and
on JAX (as many virtual CPU devices) gives the same losses, trained weights, predictions and tokens,
on a (1, 2) and a (2, 2) ("batch", "model") mesh.

Both runs use the same program (``test_keras_hub._run``: ``fit``, ``train_on_batch``, ``predict``,
greedy ``generate()``), the same layout map (``GemmaBackbone.get_layout_map`` on the same mesh),
the same data and the same initial weights (the torch run's, passed to the JAX process in an
.npz). JAX runs in a subprocess with ``KERAS_BACKEND=jax`` and
``XLA_FLAGS=--xla_force_host_platform_device_count=N``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("jax", reason="the JAX reference needs jax (pip install 'jax[cpu]')")
hub = pytest.importorskip("test_keras_hub", reason="needs keras_hub (see tests/models/test_keras_hub.py)",
                          exc_type=ImportError)

from keras_dtensor_mixfix.testing import run_on_ranks  # noqa: E402

NAME = "gemma"
# SGD: Adam's first steps move every weight by about the learning rate whatever the gradient's size,
# so float32 rounding that differs between backends in a near-zero gradient would flip whole steps
OPTIMIZER = "sgd"
HERE = os.path.dirname(os.path.abspath(__file__))


def _flat(out):
    """``_run``'s values as named arrays (for an .npz)."""
    flat = {f"history_{key}": values for key, values in out["history"].items()}
    flat.update({f"evaluated_{key}": value for key, value in out["evaluated"].items()})
    flat.update(logs=out["logs"], predicted=out["predicted"], generated=out["generated"],
                pipeline=np.asarray(out["pipeline"]))
    flat.update({f"trained_{i}": w for i, w in enumerate(out["trained"])})
    return flat


def jax_model_parallel(directory, shape):
    """Run in the JAX subprocess: the torch run's program, on ``prod(shape)`` virtual CPU devices."""
    import jax
    import keras

    count = int(np.prod(shape))
    assert keras.backend.backend() == "jax" and len(jax.devices()) == count, (keras.backend.backend(), jax.devices())
    with np.load(os.path.join(directory, "initial.npz")) as initial:
        weights = [initial[f"w{i}"] for i in range(len(initial.files))]
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(tuple(shape), ["batch", "model"], devices)
    layout_map = hub.keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    keras.distribution.set_distribution(keras.distribution.ModelParallel(layout_map=layout_map,
                                                                         batch_dim_name="batch"))
    lm = hub._causal_lm(NAME, OPTIMIZER)
    out = hub._run(lm, initial=weights)
    embeddings = lm.backbone.get_layer("token_embedding").embeddings.value
    out_flat = _flat(out)
    out_flat["embedding_shards"] = np.asarray([shard.data.shape for shard in embeddings.addressable_shards])
    np.savez(os.path.join(directory, "jax.npz"), **out_flat)


@pytest.mark.parametrize("shape", [(1, 2), (2, 2)], ids=["1x2", "2x2"])
def test_torch_model_parallel_equals_jax(tmp_path, shape):
    count = int(np.prod(shape))
    case = (NAME, "model_parallel", shape, OPTIMIZER)
    torch_out = run_on_ranks(hub.distributed_cases, [case], world_size=count, timeout=900)[0][case]
    assert isinstance(torch_out, dict), torch_out
    np.savez(tmp_path / "initial.npz", **{f"w{i}": w for i, w in enumerate(torch_out["initial"])})
    env = dict(os.environ, KERAS_BACKEND="jax", XLA_FLAGS=f"--xla_force_host_platform_device_count={count}",
               JAX_PLATFORMS="cpu", KERAS_DTENSOR_MIXFIX="0")
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import {__name__} as m; "
            f"m.jax_model_parallel({str(tmp_path)!r}, {tuple(shape)!r})")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    with np.load(tmp_path / "jax.npz") as loaded:
        jax_out = dict(loaded)
    # the table was sharded on JAX too: the vocabulary over "model", the hidden dim over "batch"
    vocabulary, hidden = hub.MODELS[NAME][2]["vocabulary_size"], hub.MODELS[NAME][2]["hidden_dim"]
    assert jax_out.pop("embedding_shards").tolist() == [[vocabulary // shape[1], hidden // shape[0]]] * count
    jax_out["predicted"] = jax_out["predicted"][torch_out["rows"]]  # the rows this torch rank fed (all, but on 3.16)
    torch_flat = _flat(torch_out)
    assert sorted(torch_flat) == sorted(jax_out)
    assert str(jax_out.pop("pipeline")) == str(torch_flat.pop("pipeline"))
    np.testing.assert_array_equal(torch_flat.pop("generated"), jax_out.pop("generated"))
    for key, want in sorted(jax_out.items()):  # losses, metrics, trained weights, logits
        np.testing.assert_allclose(torch_flat[key], want, rtol=1e-5, atol=1e-5, err_msg=key)
    assert not all(np.array_equal(got, before) for got, before in
                   zip(torch_out["trained"], torch_out["initial"]))  # it trained

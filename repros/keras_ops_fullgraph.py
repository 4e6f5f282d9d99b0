"""Keras limitation (3.12 to 3.14): a Keras op does not trace in one graph under ``torch.compile``.

Every ``keras.ops`` function first asks ``any_symbolic_tensors(args, kwargs)``, which on Keras 3.12 to 3.14
flattens its arguments with ``keras.src.tree`` (torch's pytree underneath); TorchDynamo cannot trace that
(``Failed to trace builtin operator `is_not` with argument types ['tuple', 'tuple']``), so with
``fullgraph=True`` the compile fails and without it the graph breaks at every op. Keras 3.15 rewrote
``any_symbolic_tensors`` to iterate its arguments itself, and the same call traces in one graph. Plain
tensors, one process, no keras_dtensor_mixfix: Keras and torch alone (seen with torch 2.13.0).

The Keras integration's compiled sharded ops (lookups, attention, argmax, one_hot, the kernel re-split) are
proven in one graph on Keras 3.15 and 3.16; on 3.12 to 3.14, ``jit_compile=True`` still compiles the step,
with graph breaks between Keras' ops (``tests/keras_integration/test_keras.py::test_jit_compile`` runs there).

Run: ``KERAS_BACKEND=torch python repros/keras_ops_fullgraph.py`` (exits 1 while the limitation is there);
``tests/keras_integration/test_keras_repros.py`` runs it, as an expected failure on Keras 3.12 to 3.14.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")
os.environ.setdefault("KERAS_DTENSOR_MIXFIX", "0")  # Keras and torch alone

import keras
import torch


def repro() -> None:
    """Raises ``torch._dynamo.exc.Unsupported`` while the limitation is there; returns (value checked) once not."""
    torch._dynamo.reset()
    product = torch.compile(lambda a, b: keras.ops.einsum("ij,jk->ik", a, b), backend="eager", fullgraph=True)
    a, b = torch.ones(2, 3), torch.ones(3, 4)
    torch.testing.assert_close(product(a, b), a @ b)


if __name__ == "__main__":
    repro()
    print(f"Keras {keras.__version__}: traces in one graph")

"""Keras limitation: of two variables with the same path, only one is a torch parameter of the model.

Keras' torch backend registers a layer's variables as torch parameters keyed by their path. A sublayer made and
built in its parent's ``__init__`` is built outside the parent's name scope, so two such parents give two variables
the same path ("proj/kernel"), and the second replaces the first in the parameter table: ``model.parameters()``
misses one of them. keras_hub's SmolLM3 builds each decoder block's ``o_proj`` that way.

Why it matters: Keras 3.16's ``DataParallel`` on torch wraps the model in ``DistributedDataParallel``, which
reduces the gradients of ``model.parameters()`` only, so the missed kernel trains on each process's own rows and
the processes' copies drift apart, silently (SmolLM3 on 2 ranks, Keras alone: one ``o_proj`` kernel 0.03 apart
after one step). The Keras integration averages such variables' gradients over DDP's process group itself
(``_keras/step/ddp.py``); its own DataParallel (Keras 3.12 to 3.15) does not go through ``model.parameters()``. Plain
tensors, one process, no keras_dtensor_mixfix: seen with Keras 3.12.4, 3.15.1 and keras-nightly 3.16.0.dev2026102704 on
torch 2.13.0 and 2.15.0.

Run: ``KERAS_BACKEND=torch python repros/keras_duplicate_path_not_a_torch_parameter.py`` (exits 1 while the
limitation is there); ``tests/keras_integration/test_keras_repros.py`` runs it as an expected failure.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")
os.environ.setdefault("KERAS_DTENSOR_MIXFIX", "0")  # Keras and torch alone

import keras


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(4, name="proj")
        self.proj.build((None, 4))  # outside this layer's name scope: the kernel's path is "proj/kernel"

    def call(self, x):
        return self.proj(x)


def repro() -> None:
    """Raises AssertionError while the limitation is there; returns once every variable is a torch parameter."""
    inputs = keras.Input((4,))
    model = keras.Model(inputs, Block(name="second")(Block(name="first")(inputs)))
    parameters = {id(parameter) for parameter in model.parameters()}
    missing = [variable.path for variable in model.trainable_variables if id(variable.value) not in parameters]
    assert not missing, f"trainable variables that are not torch parameters of the model: {missing}"


if __name__ == "__main__":
    repro()
    print(f"fixed in Keras {keras.__version__}")

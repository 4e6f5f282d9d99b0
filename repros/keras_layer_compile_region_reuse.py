"""Keras limitation: a repeated Keras layer cannot be compiled once and reused (torch's nested compile region).

``torch.compiler.nested_compile_region`` marks a function that TorchDynamo traces once and stamps out again for
later calls with inputs of the same kind: how torch compiles the N identical decoder blocks of an LLM once
instead of N times. Marking a Keras layer's ``call`` gives no reuse: every call of a sublayer inside it goes
through Keras' ``Layer.__call__``, which sets ``self._called = True`` (and pushes and pops Keras' name-scope
stack), and TorchDynamo refuses to reuse a region with side effects ("subgraph_reuse: not eligible -- subgraph
has side effects", ``TORCH_LOGS=hierarchical_compile``). Each call is traced again and, used once, inlined: the
traced graph holds no region at all. Plain tensors, one process, no keras_dtensor_mixfix: Keras and torch alone
(seen with Keras 3.15.1 and torch 2.13.0).

Why it matters here: a compiled keras_hub step (``jit_compile=True``) traces and compiles every decoder block
anew; the first compiled step of a 4-layer model takes minutes on CPU (BENCHMARKS.md, issue 31's P12).

Run: ``KERAS_BACKEND=torch python repros/keras_layer_compile_region_reuse.py`` (exits 1 while the limitation is
there); ``tests/keras_integration/test_keras_repros.py`` runs it as an expected failure.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "torch")
os.environ.setdefault("KERAS_DTENSOR_MIXFIX", "0")  # Keras and torch alone

import keras
import torch


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)

    def call(self, x):
        return x + self.dense(x)


def regions_in_traced_graph() -> int:
    """How many calls of a nested compile region the graph of two marked blocks holds (2 once reused)."""
    torch._dynamo.reset()
    original = Block.call
    Block.call = torch.compiler.nested_compile_region(original)
    try:
        blocks = [Block(), Block()]
        x = torch.ones(2, 4)
        for block in blocks:
            block(x)  # built outside the compile
        graphs = []

        def recording(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        compiled = torch.compile(lambda x: blocks[1](blocks[0](x)), backend=recording)
        torch.testing.assert_close(compiled(x), blocks[1](blocks[0](x)))
    finally:
        Block.call = original
    return sum(node.target is torch.ops.higher_order.invoke_subgraph
               for gm in graphs for node in gm.graph.nodes)


def repro() -> None:
    """Raises ``AssertionError`` while the limitation is there."""
    count = regions_in_traced_graph()
    assert count == 2, f"the traced graph holds {count} calls of the region, 2 once the block is reused"


if __name__ == "__main__":
    repro()
    print(f"Keras {keras.__version__}, torch {torch.__version__}: the block is traced once and reused")

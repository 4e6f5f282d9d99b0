"""Keras ops DTensor cannot run as Keras writes them, one module per op family, each declaring its ``Override``.

- :mod:`.embedding_ops`: ``take`` (an embedding lookup) on a table split along the looked-up axis;
- :mod:`.reduction_ops`: extreme and logical reductions (``min``, ``max``, ``all``, ``any``, ``argmax``, ...);
- :mod:`.tensor_ops`: ``slice_update``, ``one_hot``, ``stack`` and the other ops that write into, encode, stack,
  pad or sum along DTensors;
- :mod:`.attention_ops`: ``dot_product_attention`` on each rank's batch rows and heads;
- :mod:`.local_einsum`: ``einsum`` on each rank's pieces where the operands' shardings line up;
- :mod:`.einsum_kernel_split`: a kernel re-split so that more einsums line up;
- :mod:`.vocab_parallel_loss`: sparse categorical cross-entropy over class-split logits, never gathered;
- :mod:`.repeat`: ``repeat`` by a whole number, expanded as Keras 3.15 does (on older Keras);
- :mod:`.reshape`: ``reshape`` whose split DTensor cannot carry into the new shape;
- :mod:`.normalization`: RMS normalization over a split axis;
- :mod:`.convolution`: convolutions of DTensors split along anything but the batch;
- :mod:`.activations`: activations whose gradient DTensor lays out unlike torch's kernel;
- :mod:`.casting`: ``cast`` of a NumPy value while TorchDynamo traces.
"""

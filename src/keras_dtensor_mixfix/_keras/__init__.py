"""The Keras integration, one module per concern; :mod:`keras_dtensor_mixfix.keras_integration` installs them.

Each module declares what it changes in Keras as :class:`.overrides.Override` values (target attributes, what
they come after, the Keras releases that need them, a report line); ``keras_integration.install()`` applies them
in one loop through one patch recorder (``_lifecycle.recorder.PatchRecorder``), so that ``uninstall()`` restores
Keras exactly.

- :mod:`.overrides`: the declaration and its order (``keras_integration.install()`` applies them through one recorder);
- :mod:`.keras_modules`: the Keras boundary, the one module that names Keras' private package: where the
  installed Keras keeps what we patch, what it already does itself, and the Keras releases checked;
- :mod:`.keras_private`: the other half of the boundary, the one module that touches private attributes of Keras
  objects (a Variable's ``_value``, a layer's ``_losses``, the private methods the overrides replace);
- :mod:`.keras_gate`: which Keras releases the integration installs into (and the opt-in for a newer one);
- :mod:`.checks`, :mod:`.selfcheck`: the Keras self-check, one named check per Keras internal relied on;
- :mod:`.backend_lib`: the torch ``distribution_lib`` Keras uses (ours, or Keras' own completed);
- :mod:`.distribution_lib`: ours, the torch backend of ``keras.distribution`` for a Keras that has none;
- :mod:`.layouts`: Keras layouts as DTensor meshes and placements, and moving a tensor to one;
- :mod:`.variables`: layout-aware variables (DTensor parameters);
- :mod:`.values`: global values out of ``convert_to_numpy``;
- :mod:`.data`: batches distributed before each step, logs and predictions made global;
- :mod:`.compile`: ``jit_compile=True`` under a distribution;
- :mod:`.promotion_mode`: Keras' own mixed-operand dispatch mode, replaced by our promotion while patched;
- :mod:`.saving`: rank 0 writes;
- :mod:`.callback_files`: Keras' file-writing callbacks write once (rank 0), the ranks in step;
- :mod:`.ddp`: models with DTensor weights kept out of Keras' ``DistributedDataParallel`` wrap;
- Keras ops DTensor cannot run as Keras writes them, one module per op family: :mod:`.embedding_ops`
  (``take``), :mod:`.reduction_ops` (min/max/all/any, argmax/argmin), :mod:`.tensor_ops` (``slice_update``,
  ``one_hot``, ``stack``), :mod:`.attention_ops` (``dot_product_attention``);
- :mod:`.local_einsum`: ``einsum`` on each rank's pieces where the operands' shardings line up;
- :mod:`.einsum_kernel_split`: a kernel re-split so that more einsums line up;
- :mod:`.vocab_parallel_loss`: sparse categorical cross-entropy over class-split logits, never gathered;
- :mod:`.repeat`: ``repeat`` of a DTensor by a whole number, expanded as Keras 3.15 does (on older Keras);
- :mod:`.tracebacks`: Keras' traceback filter hides the integration's frames;
- :mod:`.sharding_report`: what is sharded (``keras_dtensor_mixfix.layouts.sharding_report``), and layout map keys
  that match no variable;
- :mod:`.reductions`: partial sums settled at layer outputs (forward and backward), gradients laid out
  like their parameters.
"""

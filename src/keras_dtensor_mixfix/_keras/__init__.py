"""The Keras integration, one module per concern; :mod:`keras_dtensor_mixfix.keras_integration` installs them.

- :mod:`.patches`: record replaced attributes, restore them exactly;
- :mod:`.keras_modules`: where the installed Keras keeps what we patch, and what it already does itself;
- :mod:`.backend_lib`: the torch ``distribution_lib`` Keras uses (ours, or Keras' own completed);
- :mod:`.variables`: layout-aware variables (DTensor parameters);
- :mod:`.values`: global values out of ``convert_to_numpy``;
- :mod:`.data`: batches distributed before each step, logs and predictions made global;
- :mod:`.compile`: ``jit_compile=True`` under a distribution;
- :mod:`.promotion_mode`: Keras' own mixed-operand dispatch mode, replaced by our promotion while patched;
- :mod:`.saving`: rank 0 writes;
- :mod:`.sharded_ops`: ``take``, ``slice_update``, attention and min/max/all/any reductions where DTensor
  cannot run Keras' version;
- :mod:`.local_einsum`: ``einsum`` on each rank's pieces where the operands' shardings line up;
- :mod:`.reductions`: partial sums settled at layer outputs (forward and backward), gradients laid out
  like their parameters.
"""

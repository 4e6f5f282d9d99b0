"""The train/test/predict step under a distribution.

- :mod:`.data`: the step functions (the promotion mode synced, static shapes) and, on 3.12 to 3.15, batches
  distributed before each step, logs and predictions made global;
- :mod:`.compile`: ``jit_compile=True`` under a distribution (static shapes, a traceable ``cast``, 3.16's compile
  switch);
- :mod:`.forked_train_step`: Keras 3.12 to 3.15's train step, forked to compile under a distribution (those
  releases only);
- :mod:`.layer_compile`: each distinct repeated block compiled once, shared by every block like it;
- :mod:`.block_groups`: which blocks are alike (what Keras says of them: class, configuration, variables, layouts);
- :mod:`.block_tracer`: a group's blocks traced by AOTAutograd alone, once per input signature (an opt-in);
- :mod:`.reductions`: partial sums settled at layer outputs (forward and backward), gradients laid out like their
  parameters;
- :mod:`.ddp`: models with DTensor weights kept out of Keras 3.16's ``DistributedDataParallel`` wrap;
- :mod:`.promotion_mode`: Keras 3.16's own mixed-operand dispatch mode, replaced by our promotion while patched;
- :mod:`.tracebacks`: Keras' traceback filter hides the integration's frames.
"""

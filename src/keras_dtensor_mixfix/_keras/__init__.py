"""The Keras integration, in sub-packages by role; :mod:`keras_dtensor_mixfix.keras_integration` installs it.

Each module declares what it changes in Keras as :class:`.boundary.overrides.Override` values (target attributes,
what they come after, the Keras releases that need them, a report line); ``keras_integration.install()`` applies the
tuple ``keras_integration.OVERRIDES`` in one loop through one patch recorder (``_lifecycle.recorder.PatchRecorder``),
so that ``uninstall()`` restores Keras exactly. ``tests/unit/keras_integration/test_keras_layout.py`` holds that every
declared ``Override`` is in that tuple and that each sub-package's docstring names each of its modules.

The sub-packages, top to bottom (each imports only from those below it: an import-linter contract in
``pyproject.toml``; ``|`` joins two that do not import each other):

- :mod:`.gate`: may the integration install into this Keras, and the Keras self-check it runs;
- :mod:`.step` | :mod:`.ops`: the train/test/predict step under a distribution (batches, compiling, reductions,
  the DDP wrap, the promotion mode, tracebacks) | Keras ops DTensor cannot run as Keras writes them, one module
  per op family;
- :mod:`.backend`: the torch ``distribution_lib`` protocol (ours for Keras 3.12 to 3.15, Keras 3.16's completed),
  layout-aware variables, global values, Keras layouts as DTensor placements, the CUDA device of each rank;
- :mod:`.files` | :mod:`.layout_maps`: Keras' files under a distribution (saving, slice loading, rank-zero
  gather, callbacks that write, the sharded checkpoint) | layout maps derived from a model, the sharding report
  and the whole-weight warning;
- :mod:`.ranks`: what every rank agrees on through rank 0 (its value broadcast, the barrier of the group the
  package created, the error a rank stops with when rank 0 stopped), which the backend and the files both use;
- :mod:`.boundary`: the Keras boundary (the only modules naming Keras' private package and private attributes),
  the ``Override`` declaration and rebinding a Keras function wherever it was imported.

Where a change goes: a Keras op DTensor cannot run, as a module of :mod:`.ops` (one per op family) declaring an
``Override`` whose report line starts "ops:", listed in ``keras_integration.OVERRIDES``; a workaround of an upstream
defect asks the defect table for it (``needed``, or where it takes its path: :mod:`.boundary.defects`); a private
Keras name, in :mod:`.boundary.keras_modules` or :mod:`.boundary.keras_private`, with a check in :mod:`.gate.checks`.
"""

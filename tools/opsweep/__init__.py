"""The OpInfo sweep behind ``tools/op_sweep.py`` (the CLI), by concern:

* ``sampling``  - ops and samples from torch's OpInfo database, operands and placements to try;
* ``extra``     - the sweep's own samples: reduction keywords of losses, reduced / indexed dims of size 4;
* ``values``    - calling a sample, reading and comparing results;
* ``classify``  - correct / clear_error / wrong / crash, fault attribution, totals;
* ``differential`` - calls torch accepts unpatched must be unchanged patched: same / differs;
* ``runner``    - the phases inside each rank and the chunked run on 2 gloo ranks;
* ``report``    - OP_SWEEP.md.

The package must be importable in the rank workers (they are spawned with the parent's ``sys.path``):
put ``tools/`` on ``sys.path`` and import ``opsweep``.
"""

"""The torch boundary: every private torch API the package uses, the supported torch range, and a self-check of both.

Every torch-private name (a ``torch._...`` module or attribute, ``torch.distributed.tensor._...``,
``torch._C``, a ``_``-prefixed attribute of a torch object) is named in this package only:
``api`` (DTensor internals, dispatch rules, torch.compile), ``operators`` (operator classes,
schemas, the dispatcher's list of names), ``dtensor_attributes`` (DTensor's local tensor and spec,
off the hot path), ``processes`` (torchrun's worker environment, the rank simulator). ``checks`` checks
each of them on the running torch; ``versions`` says which releases they were checked on.
``tests/unit/torch_boundary/test_torch_boundary.py`` fails when a module outside this package names one.

The one documented exception: the promotion engine (``_engine/``) reads ``DTensor._local_tensor``
and ``DTensor._spec`` directly. It reads them several times per promoted op, on the hot path of
every mixed op (BENCHMARKS.md), where a Python function call around each read would add cost for
no gain in safety. Both attributes are checked like every other private name
(``checks.check_dtensor_attributes``), and ``dtensor_attributes`` serves the code off that path.
"""

"""Self-checks of what the package reads of torchrun's worker environment
(``processes.elastic_attempt_on_agent_store``)."""

from __future__ import annotations

from . import processes
from .probe import Probe, require


def check_elastic_agent_store(probe: Probe) -> str:
    import importlib
    import os
    from unittest import mock

    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # torch.distributed.rendezvous: a function

    reads = getattr(rendezvous, "_torchelastic_use_agent_store", None)
    require(callable(reads), "torch.distributed.rendezvous._torchelastic_use_agent_store is missing")
    assert callable(reads)  # for type checkers: require() raised otherwise
    with mock.patch.dict(os.environ, TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="2"):
        shared = reads(), processes.elastic_attempt_on_agent_store()
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        own = reads(), processes.elastic_attempt_on_agent_store()
    require(shared == (True, 2) and own == (False, None),
            f"TORCHELASTIC_USE_AGENT_STORE no longer decides the store: {shared}, {own}")
    return "TORCHELASTIC_USE_AGENT_STORE=True: a worker's group goes on the agent's store; its attempt is read"

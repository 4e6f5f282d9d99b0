"""The torch boundary for the processes a program runs in: torchrun's worker environment and torch's rank simulator.

Each function says what torch internal it relies on; ``checks_launch`` and ``checks_dtensor`` check them on the torch a
process runs (the self-check), and a torch without one makes the caller do nothing of its own (torch's own path).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable, Optional

__all__ = ["elastic_attempt_on_agent_store", "per_simulated_rank"]

# --------------------------------------------------------------------------- torchrun's worker environment
# torchrun's agent tells its workers whether they build their process group on its own TCP store
# (``TORCHELASTIC_USE_AGENT_STORE``, read by ``torch.distributed.rendezvous._torchelastic_use_agent_store``), which
# outlives a restart, and which attempt they are (``TORCHELASTIC_RESTART_COUNT``).


def elastic_attempt_on_agent_store() -> Optional[int]:
    """The restart count of this torchrun worker where its process group goes on the agent's own store (shared by
    every attempt); None outside torchrun or where each attempt gets a store of its own."""
    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # torch.distributed.rendezvous: a function

    if not rendezvous._torchelastic_use_agent_store():
        return None
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return int(count) if count.isdigit() else None


# --------------------------------------------------------------------------- torch's rank simulator
# LocalTensorMode (torch.distributed._local_tensor) holds every simulated rank's value in one process; a
# rank's coordinate there is a symbolic int with each rank's value.


def per_simulated_rank(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` that, under torch's rank simulator, runs once per simulated rank with each per-rank symbolic int
    and ``LocalTensor`` among its arguments read as that rank's value, its results combined into per-rank values
    (``torch.distributed._local_tensor.maybe_run_for_local_tensor``); elsewhere ``function`` itself. For a function
    with no collective and no side effect (a piece computed from a rank's coordinate)."""
    module = sys.modules.get("torch.distributed._local_tensor")  # not imported: no simulator can be running
    runner = getattr(module, "maybe_run_for_local_tensor", None)
    return function if runner is None else runner(function)

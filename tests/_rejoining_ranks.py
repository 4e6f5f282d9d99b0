"""``run_on_ranks`` for calls expected to fail (the torch repros' strict expected failures): after a call in which
every rank answered (some raised, none died or timed out) the workers are kept and join a new process group instead of
being restarted, which saves seconds per failing call.

For pure-torch functions only: state a failed call left in the workers' modules stays (a library's cache of meshes on
the old group, for one), which ``run_on_ranks``'s restart would have cleared.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, List

from keras_dtensor_mixfix import testing
from keras_dtensor_mixfix._loopback_ports import free_port
from keras_dtensor_mixfix.testing import RankError

_retired_meshes: List[Any] = []
"""Meshes of a process group this worker left, kept alive so that no cache keyed by a mesh's identity can meet a new
mesh at a freed one's address."""


def rejoin_group(port: int) -> bool:
    """Run on every rank: leave the process group and join a new one on ``port``, with fresh compile caches.

    Nothing a failed call left in flight (a message one rank sent that another never received) can reach a later call
    over the new group's connections. Meshes built on the old group are retired; ``testing.mesh`` builds new ones.
    """
    import torch.distributed as dist

    from keras_dtensor_mixfix._torch.api import reset_compiled_code

    dist.destroy_process_group()
    _retired_meshes.extend(testing._worker_meshes.values())
    testing._worker_meshes.clear()
    reset_compiled_code()
    # graphs compiled on the old group name its groups; a new cache directory keeps them from the new group (inside
    # the pool's own directory, which the pool removes when it closes)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="rejoined-",
                                                             dir=os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    testing._join_group(port)
    return True


def _rejoin(run_on_the_pool: Callable[..., List[Any]], start_timeout: float) -> bool:
    """Keeps the workers where every rank joins the new group; else they are restarted."""
    try:
        run_on_the_pool(rejoin_group, (free_port(),), {}, start_timeout)
    except RankError:
        return False
    return True


def run_on_ranks_rejoining(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 300.0,
                           start_timeout: float = 120.0, **kwargs: Any) -> List[Any]:
    """``testing.run_on_ranks``, keeping the workers after a call every rank answered (above)."""
    return testing._run(fn, args, kwargs, world_size, timeout, start_timeout, keep_after_failure=_rejoin)

"""What every rank agrees on through rank 0: one value broadcast from it, a barrier that names the rank that did not
arrive on the group the package created, and the error a rank stops with when rank 0 raised or ended early.

Below both :mod:`..backend` (the seed every rank draws with, whether rank 0 drew an initial value) and :mod:`..files`
(rank 0 writes the files for all), which each use it.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from ..._rules.errors import MixfixError
from ..boundary import keras_modules

__all__ = ["RankZeroStopped", "barrier", "created_group", "from_rank_zero", "multi_process"]


class RankZeroStopped(MixfixError, RuntimeError):
    """Rank 0 raised or ended early in a collective step the other ranks wait on it for (a save it writes, an
    initial value it draws): they stop with this instead of waiting."""


def multi_process() -> bool:
    """Whether a Keras distribution is in force over several processes: then rank 0 writes files for all."""
    import torch.distributed as dist

    return keras_modules.distribution() is not None and dist.is_initialized() and dist.get_world_size() > 1


def from_rank_zero(value: int) -> int:
    """Rank 0's ``value`` on every rank (a broadcast; the other ranks' ``value`` is ignored)."""
    import torch
    import torch.distributed as dist

    word = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(word, src=0)
    return int(word.item())


_created_group: List[Optional[Tuple[Any, Any]]] = [None]


def created_group(timeout: Any) -> None:
    """The default group was just created by the package (``keras.distribution.initialize()`` on Keras 3.12 to 3.15)
    with collective timeout ``timeout`` (a ``timedelta``)."""
    import torch.distributed as dist

    _created_group[0] = (dist.group.WORLD, timeout)


def barrier() -> None:
    """Every rank of the default group waits for the others. On a gloo group the package created, torch's monitored
    barrier with that group's timeout: a rank that does not arrive is named in rank 0's error (``Rank 1 failed to
    pass monitoredBarrier``) instead of every rank timing out alike (torch's monitored barrier would otherwise wait
    gloo's default, 30 minutes, whatever the group's own timeout)."""
    import torch.distributed as dist

    created = _created_group[0]
    if created is not None and created[0] is dist.group.WORLD and dist.get_backend() == dist.Backend.GLOO:
        dist.monitored_barrier(timeout=created[1])
    else:
        dist.barrier()

"""Run a function on a small CPU mesh (gloo on 127.0.0.1) and get every rank's result.

    from keras_dtensor_mixfix.testing import run_on_ranks, mesh

    def step(scale):
        m = mesh()                      # 1-D mesh over all ranks, cached in the worker
        ...
        return value                    # anything picklable

    results = run_on_ranks(step, 2.0, world_size=2)   # [rank0_value, rank1_value]

Worker processes are started once per world size and reused by later calls, so a test suite
pays the start-up cost once. If any rank raises, :class:`RankError` carries the lowest failing
rank's exception type, message and traceback; the workers are then restarted (ranks that
raised at different points could otherwise be out of step). The function and its arguments
must be picklable: define it at module level.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import multiprocessing
import os
import pickle
import queue
import shutil
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from ._loopback_ports import LOOPBACK, free_port, port_taken
from ._rules.errors import ArgumentTypeError, MixfixError

log = logging.getLogger(__name__)

__all__ = ["RankError", "WorkerStartError", "run_on_ranks", "mesh", "rank", "world_size", "shutdown_workers"]

# How long a rank waits in a collective for the others before gloo raises. Generous because ranks that compile
# (TorchDynamo, inductor's C++ kernels) share few cores and reach their next collective minutes apart on a loaded
# machine. It also bounds how long the others wait for a rank that raised before they raise too (RankError).
_COLLECTIVE_TIMEOUT_S = 300


class RankError(MixfixError, RuntimeError):
    """A function run by :func:`run_on_ranks` raised (or timed out) on at least one rank.

    Lives here, with the helper that raises it; ``keras_dtensor_mixfix.RankError`` still finds it
    for one more release, with a ``DeprecationWarning``.
    """

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str,
                 failures: Optional[Dict[int, Tuple[str, str, str]]] = None) -> None:
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        self.failures = failures or {}
        self.every_rank_answered = False
        """Whether every rank answered the call (some raised; none died or timed out)."""
        others = sorted(set(self.failures) - {rank})
        extra = f" (ranks {others} failed too)" if others else ""
        super().__init__(f"rank {rank} raised {exc_type}: {message}{extra}\n"
                         f"--- traceback on rank {rank} ---\n{remote_traceback}")


class WorkerStartError(MixfixError, RuntimeError):
    """The worker processes of :func:`run_on_ranks` did not all join their process group (one exited
    at start, or they did not start within ``start_timeout``)."""


# ----------------------------------------------------------------------------- worker side

_worker_meshes: Dict[Tuple[Any, ...], Any] = {}


def rank() -> int:
    """This worker's global rank."""
    import torch.distributed as dist

    return dist.get_rank()


def world_size() -> int:
    """Number of ranks in this worker's process group."""
    import torch.distributed as dist

    return dist.get_world_size()


def mesh(shape: Optional[Sequence[int]] = None, names: Optional[Sequence[str]] = None) -> Any:
    """A CPU ``DeviceMesh`` over all ranks (1-D by default), built once per worker and cached."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(shape) if shape is not None else (world_size(),)
    key = (shape, tuple(names) if names else None)
    found = _worker_meshes.get(key)
    if found is None:
        found = init_device_mesh("cpu", shape, mesh_dim_names=key[1])
        _worker_meshes[key] = found
    return found


_worker_identity: Tuple[int, int] = (0, 1)
"""This worker's rank and world size (set when it starts)."""
def _join_group(port: int) -> None:
    """Join this worker's gloo process group on ``port`` (its rank and size: ``_worker_identity``)."""
    import torch.distributed as dist

    os.environ["MASTER_PORT"] = str(port)
    rank, size = _worker_identity
    dist.init_process_group("gloo", init_method=f"tcp://{LOOPBACK}:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=_COLLECTIVE_TIMEOUT_S))


def _pickled(fn: Callable[..., Any], value: Any) -> bytes:
    """``value`` pickled as the result queue would pickle it, or an error saying it cannot go back to the parent
    process. Pickled here, once, because the queue pickles in a thread of its own, whose error would only be printed,
    leaving the parent to wait for a result until its timeout."""
    from multiprocessing.reduction import ForkingPickler

    try:
        return bytes(ForkingPickler.dumps(value))
    except Exception as exc:
        raise ArgumentTypeError(
            f"the value {getattr(fn, '__qualname__', fn)!s} returned cannot be sent back to the calling process "
            f"({type(exc).__name__}: {exc}); return plain values (a tensor that requires grad: .detach() it, a "
            f"DTensor: .full_tensor() or .to_local())") from exc


def _worker_main(rank: int, size: int, port: int, tasks: Any, results: Any, parent_pid: int) -> None:
    global _worker_identity
    _worker_identity = (rank, size)
    os.environ["MASTER_ADDR"] = LOOPBACK
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks share two cores
    try:
        _join_group(port)
    except Exception as exc:
        if rank == 0 and port_taken(exc):  # the parent starts the ranks again on another port
            results.put(("ready", rank, False, str(exc)))
            return
        raise
    results.put(("ready", rank, True, None))
    while True:
        try:
            task = tasks.get(timeout=2.0)
        except queue.Empty:
            if not _alive(parent_pid):
                break
            continue
        if task is None:
            break
        task_id, fn, args, kwargs = task
        try:
            results.put((task_id, rank, True, _pickled(fn, fn(*args, **kwargs))))
        except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit, to the parent
            results.put((task_id, rank, False, (type(exc).__qualname__, str(exc), traceback.format_exc())))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - leaving anyway: a group that cannot be destroyed goes with the process
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


# ----------------------------------------------------------------------------- parent side


class _PortTaken(Exception):
    """Rank 0 found its store's port taken between the draw and its listen (another process's listener)."""


_PORT_ATTEMPTS = 3


def _start_pool(size: int, start_timeout: float) -> "_Pool":
    """A started pool of ``size`` ranks: on a port taken before rank 0 listened, started again on another one."""
    for attempt in range(1, _PORT_ATTEMPTS + 1):
        try:
            return _Pool(size, start_timeout)
        except _PortTaken as taken:
            log.info("rank 0's port %s was taken before it listened (attempt %d of %d): %s", taken.args[0],
                     attempt, _PORT_ATTEMPTS, taken.args[1])
    raise WorkerStartError(f"rank 0 of {size} CPU ranks found its store's port taken {_PORT_ATTEMPTS} times in a row: "
                           f"other programs listen on many of the ports below the ephemeral range it draws from; "
                           f"stop them, or run again")


class _Pool:
    def __init__(self, size: int, start_timeout: float) -> None:
        context = multiprocessing.get_context("spawn")
        self.size = size
        self.results = context.Queue()
        self.tasks = [context.Queue() for _ in range(size)]
        port = free_port()
        # Keep gloo's traffic on the loopback interface, and give the workers a compile cache of
        # their own: torch.compile's on-disk caches key DTensor graphs without the process-group
        # names baked into their collectives, so a graph cached by another run can name a group
        # that does not exist (or is another one) here.
        self._cache_dir = (None if "TORCHINDUCTOR_CACHE_DIR" in os.environ
                           else tempfile.mkdtemp(prefix="mixfix-inductor-"))
        overrides = {"GLOO_SOCKET_IFNAME": "lo"}
        if self._cache_dir is not None:
            overrides["TORCHINDUCTOR_CACHE_DIR"] = self._cache_dir
        env_backup = {name: os.environ.get(name) for name in overrides}
        os.environ.update(overrides)
        try:
            self.processes = [
                context.Process(target=_worker_main, args=(r, size, port, self.tasks[r], self.results, os.getpid()),
                                name=f"mixfix-rank{r}-of{size}", daemon=False)
                for r in range(size)
            ]
            for process in self.processes:
                process.start()
        finally:
            for name, value in env_backup.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        self._counter = 0
        ready: Set[int] = set()
        deadline = time.monotonic() + start_timeout
        while len(ready) < size:
            try:
                _, r, joined, detail = self.results.get(timeout=0.5)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self.processes)
                        if r not in ready and p.exitcode is not None]
                if dead:
                    self.close()
                    raise WorkerStartError(_DIED_AT_START.format(rank=dead[0][0], code=dead[0][1])) from None
                if time.monotonic() > deadline:
                    self.close()
                    raise WorkerStartError(f"{size} CPU ranks did not start within {start_timeout}s") from None
                continue
            if not joined:
                self.close()
                raise _PortTaken(port, detail)
            ready.add(r)

    def healthy(self) -> bool:
        return all(process.is_alive() for process in self.processes)

    def run(self, fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any], timeout: float) -> List[Any]:
        self._counter += 1
        task_id = self._counter
        for task_queue in self.tasks:
            task_queue.put((task_id, fn, args, kwargs))
        values: Dict[int, Any] = {}
        failures: Dict[int, Tuple[str, str, str]] = {}
        deadline = time.monotonic() + timeout
        while len(values) + len(failures) < self.size:
            try:
                wait = min(_LIVENESS_POLL_S, max(deadline - time.monotonic(), 0.01))
                got_id, r, ok, payload = self.results.get(timeout=wait)
            except queue.Empty:
                missing = sorted(set(range(self.size)) - set(values) - set(failures))
                dead = [(m, code) for m in missing if (code := self.processes[m].exitcode) is not None]
                if dead:
                    # A rank that died (a crash in native code, a signal) answers nothing: say so at once rather
                    # than wait out the timeout; the others may be stuck in a collective it never joined.
                    died = {m: ("WorkerDied", _died_message(m, code), "") for m, code in dead}
                    raise RankError(dead[0][0], "WorkerDied", died[dead[0][0]][1], "", {**failures, **died})
                if time.monotonic() < deadline:
                    continue
                if failures:
                    break  # the others are most likely stuck in a collective the failed rank never joined
                raise RankError(missing[0], "TimeoutError", f"no result from ranks {missing} within {timeout}s", "",
                                {m: ("TimeoutError", "", "") for m in missing})
            if got_id != task_id:
                continue  # a late answer from a task that timed out
            if ok:
                values[r] = pickle.loads(payload)
            else:
                failures[r] = payload
        if failures:
            first = min(failures)
            exc_type, message, remote_tb = failures[first]
            error = RankError(first, exc_type, message, remote_tb, failures)
            error.every_rank_answered = len(values) + len(failures) == self.size
            raise error
        return [values[r] for r in range(self.size)]

    def close(self) -> None:
        for task_queue in self.tasks:
            try:
                task_queue.put(None)
            except Exception:  # noqa: BLE001 - a queue already closed: its worker is stopped below
                pass
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
        if self._cache_dir is not None:
            shutil.rmtree(self._cache_dir, ignore_errors=True)


_LIVENESS_POLL_S = 2.0
"""How often a waiting ``run`` looks whether a rank that has not answered is still alive."""


def _died_message(rank: int, exitcode: int) -> str:
    how = f"was killed by signal {-exitcode}" if exitcode < 0 else f"exited with code {exitcode}"
    return (f"rank {rank} {how} while running the function (a crash in native code, or os._exit); its output above "
            "may say where; the ranks are restarted for the next call")


_DIED_AT_START = (
    "rank {rank} exited (exit code {code}) before joining the process group. The workers are started with "
    "'spawn': each one imports your main module again, so a script that calls run_on_ranks must do so under "
    "`if __name__ == \"__main__\":` (its traceback is printed above); the function it runs must be importable "
    "(defined at module level)."
)

_pools: Dict[int, _Pool] = {}
_pools_lock = threading.Lock()
_exit_hook_registered = False


def run_on_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 300.0,
                 start_timeout: float = 120.0, **kwargs: Any) -> List[Any]:
    """Call ``fn(*args, **kwargs)`` on every rank of a ``world_size``-process gloo group on 127.0.0.1.

    Returns the per-rank return values, rank 0 first. Raises :class:`RankError` with the
    lowest failing rank's traceback if any rank raised or did not answer within ``timeout``, at
    once (within seconds) if a rank's process died (``exc_type`` ``"WorkerDied"``), and
    :class:`WorkerStartError` if the workers could not start.
    """
    return _run(fn, args, kwargs, world_size, timeout, start_timeout)


def _run(fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any], world_size: int, timeout: float,
         start_timeout: float, keep_after_failure: Optional[Callable[[Callable[..., List[Any]], float], bool]] = None
         ) -> List[Any]:
    """:func:`run_on_ranks`; after a call in which every rank answered and some raised, ``keep_after_failure`` (if
    given) is called with the pool's ``run`` and ``start_timeout``: where it returns True the workers are kept, else
    (and without it) they are restarted for the next call."""
    global _exit_hook_registered
    with _pools_lock:
        pool = _pools.get(world_size)
        if pool is None or not pool.healthy():
            if pool is not None:
                pool.close()
            pool = _pools[world_size] = _start_pool(world_size, start_timeout)
            if not _exit_hook_registered:
                # Registered after multiprocessing's own exit handler (atexit runs last-in first-out),
                # which would otherwise wait forever for these non-daemon workers.
                atexit.register(shutdown_workers)
                _exit_hook_registered = True
        try:
            return pool.run(fn, args, kwargs, timeout)
        except RankError as error:
            if (keep_after_failure is not None and error.every_rank_answered
                    and keep_after_failure(pool.run, start_timeout)):
                raise
            pool.close()
            del _pools[world_size]
            raise


def shutdown_workers() -> None:
    """Stop every worker process started by :func:`run_on_ranks`."""
    with _pools_lock:
        for pool in _pools.values():
            pool.close()
        _pools.clear()


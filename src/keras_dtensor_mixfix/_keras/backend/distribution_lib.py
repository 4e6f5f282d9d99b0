"""A torch backend for ``keras.distribution`` (Keras 3.12 to 3.15 ship none).

Installed by :mod:`keras_dtensor_mixfix.keras_integration` (:mod:`.backend_lib`) as the
``distribution_lib`` of Keras' backend package, and under the module name Keras 3.16 gives its own
(:data:`.keras_modules.TORCH_DISTRIBUTION_LIB`), with the functions Keras 3.16's module of that name
has. One process per device: a Keras device id is the process's global rank. A Keras
``TensorLayout`` becomes ``(torch DeviceMesh, placements)``: for each mesh dim, ``Shard(d)`` if
the layout puts that mesh axis on tensor dim ``d``, else ``Replicate()`` (:mod:`.layouts`).
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Dict, List, Optional, Tuple, Union, cast

import numpy as np
import torch
import torch.distributed as dist

from ..._rules import env
from ..._rules.errors import InvalidArgumentError
from ..boundary import keras_modules
from ..ranks import agreement
from ..ranks.agreement import from_rank_zero
from . import cuda_devices
# DTensorLayout is not used here: Keras 3.16's module of this name has it.
from .layouts import (DTensorLayout, TorchLayout, fit_placements, is_symbolic,  # noqa: F401
                      placements_for, relayout)

log = logging.getLogger("keras_dtensor_mixfix")


def _device_kind() -> str:
    return "gpu" if torch.cuda.is_available() else "cpu"


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def list_devices(device_type: Optional[str] = None) -> List[str]:
    """Every process's device, ``"cpu:<rank>"`` (or ``"gpu:<rank>"``): one device per process."""
    kind = (device_type or _device_kind()).lower()
    return [f"{kind}:{rank}" for rank in range(_world_size())]


def get_device_count(device_type: Optional[str] = None) -> int:
    return len(list_devices(device_type))


def num_processes() -> int:
    return _world_size()


def process_id() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
"""How long a collective of the group :func:`initialize` creates waits for every rank before it raises: NCCL's own
default, for gloo too (whose own is 30 minutes), so that a job with a rank that stopped without exiting ends within
ten minutes, while a first compiled step or a save of a large model on rank 0 (minutes) stays well inside it."""

_timeout_override: List[Optional[float]] = [None]


def set_collective_timeout(timeout: Union[float, datetime.timedelta, None]) -> None:
    """The timeout of the process group :func:`initialize` creates from now on (seconds or a ``timedelta``); None goes
    back to ``KERAS_DTENSOR_MIXFIX_COLLECTIVE_TIMEOUT``'s, else :data:`DEFAULT_COLLECTIVE_TIMEOUT_S`."""
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
                                or timeout == float("inf")):
        raise InvalidArgumentError(f"keras_dtensor_mixfix: set_collective_timeout({timeout!r}): expected a number of "
                                   "seconds above 0, a datetime.timedelta, or None for "
                                   f"{env.COLLECTIVE_TIMEOUT}'s (default {DEFAULT_COLLECTIVE_TIMEOUT_S:g} s)")
    _timeout_override[0] = None if timeout is None else float(timeout)


def collective_timeout() -> datetime.timedelta:
    """The timeout in force: :func:`set_collective_timeout`'s, else the environment's, else the default."""
    seconds = _timeout_override[0]
    if seconds is None:
        seconds = env.collective_timeout_s()
    return datetime.timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT_S if seconds is None else seconds)


def initialize(job_addresses: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None) -> None:
    """Start the process group (torchrun's ``env://`` unless addresses are given) and agree on a seed.

    Its collectives time out after :func:`collective_timeout` (default 10 minutes; torch's own defaults are 10 for
    NCCL, 30 for gloo): a rank that stops taking part without exiting ends the job with an error then.

    With CUDA, each rank's current device is set from ``LOCAL_RANK`` *before* the group is built (also when it
    already exists, and when CUDA was touched before: :func:`.cuda_devices.select_device`), the group built is
    ``cpu:gloo,cuda:nccl`` (torch's own default: NCCL for CUDA tensors, gloo for the CPU tensors the integration
    exchanges), and two ranks of one host on one GPU raise :class:`~keras_dtensor_mixfix.DeviceAssignmentError`
    (:func:`.cuda_devices.check_one_rank_per_device`, once) instead of NCCL's error at a later collective.
    """
    cuda = torch.cuda.is_available()
    cuda_devices.select_device()
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        timeout = collective_timeout()
        if job_addresses:
            coordinator = job_addresses.split(",")[0].strip()
            dist.init_process_group(backend, init_method=f"tcp://{coordinator}",
                                    world_size=num_processes,  # type: ignore[arg-type]  # as given; torch rejects None
                                    rank=process_id,  # type: ignore[arg-type]  # as given; torch rejects None
                                    timeout=timeout)
        else:
            store = _attempt_store(timeout)
            if store is None:
                dist.init_process_group(backend, timeout=timeout)
            else:
                dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                        world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
        agreement.created_group(timeout)
        log.info("keras_dtensor_mixfix: process group %s, collective timeout %g s", backend, timeout.total_seconds())
    cuda_devices.check_one_rank_per_device()
    _agree_on_seed()


def _attempt_store(timeout: datetime.timedelta) -> Optional[Any]:
    """Under torchrun, where the group goes on the agent's store (which outlives a restart): that store under a
    prefix of this attempt, so that no worker of a restarted job reads an address a dead worker left there
    (``repros/torch_elastic_restart_stale_gloo_address.py``); None elsewhere: torch's own ``env://``."""
    from ..._torch.processes import elastic_attempt_on_agent_store
    from ..._torch.versions import has_defect, running_torch_version

    attempt = elastic_attempt_on_agent_store()
    if attempt is None or not has_defect("elastic_restart_stale_gloo_address", running_torch_version()):
        return None
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"keras_dtensor_mixfix/attempt-{attempt}", agent_store)


def _agree_on_seed() -> None:
    # Shuffling and initializers draw from the global RNGs: every rank must draw the same numbers.
    rng_utils = keras_modules.rng_utils()
    if rng_utils.get_random_seed() is not None and dist.get_world_size() == 1:
        return
    rng_utils.set_random_seed(from_rank_zero(int(np.random.randint(0, 2**31 - 1))))


def activate_dtensor_promotion() -> None:
    """Keras 3.16 enters its promotion mode here; ours is the package's patch (process-wide)."""
    from ..._lifecycle.patching import is_patched, patch

    if not is_patched():
        patch()


def deactivate_dtensor_promotion() -> None:
    """Nothing to undo per distribution: the patch belongs to whoever made it (``uninstall()`` undoes its own)."""


def _ensure_process_group() -> None:
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        initialize()
        return
    # A single process with no launcher: a one-rank group on an in-memory store (no network).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    log.info("keras_dtensor_mixfix: started a one-process gloo group for keras.distribution")


def _to_backend_device(device_name: Any) -> torch.device:
    name = str(device_name).lower()
    if name.startswith("gpu") or name.startswith("cuda"):
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name.split(":")[0] if name.split(":")[0] in ("cpu", "meta") else "cpu")


_MESHES: Dict[Tuple[Any, ...], Any] = {}


def _to_backend_mesh(device_mesh: Any) -> Any:
    """A torch ``DeviceMesh`` for a Keras ``DeviceMesh`` (cached: building one is collective)."""
    from torch.distributed.device_mesh import DeviceMesh

    _ensure_process_group()
    devices = np.asarray(device_mesh.devices)
    kinds = {str(d).split(":")[0].lower() for d in devices.flatten()}
    if len(kinds) != 1:
        raise InvalidArgumentError(f"keras_dtensor_mixfix: a DeviceMesh needs one device type, got {sorted(kinds)}")
    kind = kinds.pop()
    ranks = [int(str(d).split(":")[1]) if ":" in str(d) else 0 for d in devices.flatten()]
    if max(ranks) >= dist.get_world_size():
        raise InvalidArgumentError(f"keras_dtensor_mixfix: DeviceMesh names devices {sorted(set(ranks))} but only "
                         f"{dist.get_world_size()} processes exist (one device per process)")
    key = (kind, tuple(ranks), tuple(devices.shape), tuple(device_mesh.axis_names))
    found = _MESHES.get(key)
    if found is None:
        if kind in ("gpu", "cuda"):
            # The current device before the mesh (its NCCL communicators and every tensor moved to
            # mesh.device_type use it), whoever built the process group; then one rank per GPU.
            cuda_devices.select_device()
            cuda_devices.check_one_rank_per_device()
        found = DeviceMesh("cuda" if kind in ("gpu", "cuda") else kind,
                           torch.tensor(ranks, dtype=torch.int64).reshape(devices.shape),
                           mesh_dim_names=tuple(device_mesh.axis_names))
        _MESHES[key] = found
    return found


def _to_backend_layout(tensor_layout: Any) -> TorchLayout:
    if tensor_layout.device_mesh is None:
        raise InvalidArgumentError("Cannot create sharding when device mesh is not set for TensorLayout.")
    mesh = tensor_layout.device_mesh.backend_mesh
    return TorchLayout(mesh, placements_for(tensor_layout.axes, tensor_layout.device_mesh.axis_names,
                                            tensor_layout.device_mesh.shape))


def _resolve(layout: Any) -> TorchLayout:
    if isinstance(layout, keras_modules.tensor_layout_class()):
        return layout.backend_layout
    if isinstance(layout, TorchLayout):
        return layout
    if hasattr(layout, "device_mesh") and hasattr(layout, "placements"):  # Keras 3.16's DTensorLayout
        return TorchLayout(layout.device_mesh, tuple(layout.placements))
    mesh, placements = layout
    return TorchLayout(mesh, tuple(placements))


def resolved_layout(layout: Any) -> TorchLayout:
    """``layout`` (Keras' ``TensorLayout``, 3.16's ``DTensorLayout``, a ``TorchLayout`` or a (mesh, placements) pair)
    as a ``TorchLayout``."""
    return _resolve(layout)


def this_ranks_device() -> torch.device:
    """Where this rank's pieces of a variable live: its CUDA device, or the CPU."""
    return _to_backend_device(_device_kind())


def on_one_device(layout: Any) -> bool:
    """Whether ``layout``'s mesh is one device and the job one process: every layout of it is the whole tensor, so
    variables and batches stay plain tensors on that device, as without a distribution (DTensor's dispatch would
    only add host time: BENCHMARKS.md "What a GPU will see"), unless ``KERAS_DTENSOR_MIXFIX_DTENSORS_ON_ONE_DEVICE``
    asks for DTensors."""
    return _holds_plain_tensors(_resolve(layout).mesh)


def _holds_plain_tensors(mesh: Any) -> bool:
    """:func:`on_one_device` of a torch mesh."""
    return mesh.size() == 1 and _world_size() == 1 and not env.dtensors_on_one_device()


def _on_the_device(tensor: Any, mesh: Any) -> Any:
    """A tensor that is whole on a one-device ``mesh``: a DTensor's local value, a plain one moved to the mesh's
    device (without blocking) where it is elsewhere; non-tensors and symbolic tensors pass."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.to_local()
    if not isinstance(tensor, torch.Tensor) or is_symbolic(tensor):
        return tensor
    device = batch_device(mesh)
    return tensor if tensor.device == device else tensor.to(device, non_blocking=True)


def distribute_tensor(tensor: Any, layout: Any) -> Any:
    """Give ``tensor`` (or every tensor in a structure) ``layout``; differentiable; symbolic tensors pass. On one
    device (:func:`on_one_device`) the whole tensor on that device."""
    if layout is None:
        return tensor
    resolved = _resolve(layout)
    if _holds_plain_tensors(resolved.mesh):
        return keras_modules.tree().map_structure(lambda leaf: _on_the_device(leaf, resolved.mesh), tensor)
    return keras_modules.tree().map_structure(lambda leaf: relayout(leaf, resolved), tensor)


def distribute_variable(value: torch.Tensor, layout: Any, trainable: bool = True) -> torch.nn.Parameter:
    """An ``nn.Parameter`` holding a DTensor with ``layout``; rank 0's value wins, so ranks agree. On one device
    (:func:`on_one_device`) a plain parameter on that device, as Keras makes without a distribution."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    mesh, placements = _resolve(layout)
    if _holds_plain_tensors(mesh):
        return torch.nn.Parameter(_on_the_device(value.detach(), mesh), requires_grad=trainable)
    placements = fit_placements(value.shape, mesh, placements, "variable")
    if isinstance(value, DTensor):
        distributed = cast(DTensor, value.detach()).redistribute(mesh, placements)  # detach() keeps the DTensor
    else:
        distributed = torch_distribute(value.detach(), mesh, list(placements), src_data_rank=0)
    return torch.nn.Parameter(distributed, requires_grad=trainable)


def batch_device(mesh: Any) -> torch.device:
    """Where a batch's local piece goes on ``mesh``: the mesh's device type, and on CUDA this rank's current
    device (set from ``LOCAL_RANK`` before the mesh was built: :mod:`.cuda_devices`), as ``DTensor`` puts a
    local tensor made for a ``"cuda"`` mesh."""
    kind = mesh.device_type
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def local_batch_on(batch: torch.Tensor, device: torch.device, mesh: Any, placements: Tuple[Any, ...],
                   is_global: bool) -> Any:
    """``batch`` (on another device than ``device``, needing no gradient) as a DTensor with ``placements``, its
    local piece on ``device``: a global batch is sliced where it is and only this rank's slice is copied, a
    per-process batch copied whole; one ``non_blocking`` copy per batch (from pinned memory it overlaps the
    step; from pageable memory CUDA stages it, and the host never waits for queued kernels)."""
    from torch.distributed.tensor import DTensor

    from ..._engine.specs import region
    from ..._torch.api import compute_local_shape_and_global_offset

    if is_global:
        local_shape, offset = compute_local_shape_and_global_offset(tuple(batch.shape), mesh, placements)
        local = batch[region(offset, local_shape)].to(device, non_blocking=True)
        return DTensor.from_local(local, mesh, list(placements), run_check=False, shape=batch.shape,
                                  stride=batch.stride())  # distribute_tensor's global stride
    return DTensor.from_local(batch.to(device, non_blocking=True), mesh, list(placements), run_check=False)


def distribute_data_input(per_process_batch: Any, layout: Any, batch_dim_name: Optional[str] = None,
                          is_global: bool = False) -> Any:
    """A batch as a DTensor sharded on the batch axis, its local piece on the mesh's device (:func:`batch_device`).

    ``is_global=False`` (JAX's and Keras 3.16's meaning of this function): the batch is this
    process's own shard. ``is_global=True`` (what the trainer passes unless ``auto_shard_dataset``
    is off): every process holds the same global batch; each keeps its slice (no communication).
    ``batch_dim_name`` is accepted for JAX's signature; the layout says it all. A batch on another device
    (a CPU batch for a CUDA mesh) is copied once, only this rank's piece of it (:func:`local_batch_on`):
    never the blocking whole-batch ``.to(mesh.device_type)`` of ``distribute_tensor``/``from_local``.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(per_process_batch, torch.Tensor) or isinstance(per_process_batch, DTensor):
        return per_process_batch
    resolved = _resolve(layout)
    if _holds_plain_tensors(resolved.mesh):
        return _on_the_device(per_process_batch, resolved.mesh)
    symbolic = is_symbolic(per_process_batch)
    if not symbolic and not per_process_batch.requires_grad:
        device = batch_device(resolved.mesh)
        if per_process_batch.device != device:
            return local_batch_on(per_process_batch, device, resolved.mesh, tuple(resolved.placements), is_global)
    if is_global:
        if per_process_batch.requires_grad or symbolic:
            return relayout(per_process_batch, resolved)
        # The usual case, data that needs no gradient: every rank slices its own copy (no
        # communication) without the autograd machinery of from_local/redistribute.
        from torch.distributed.tensor import distribute_tensor as torch_distribute

        return torch_distribute(per_process_batch, resolved.mesh, list(resolved.placements), src_data_rank=None)
    return DTensor.from_local(per_process_batch, resolved.mesh, list(resolved.placements), run_check=False)

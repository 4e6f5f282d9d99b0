"""Each rank's CUDA device: set before the process group and mesh, and never shared by two ranks of one host.

This machine has no GPU, so ``torch.cuda`` is faked (:class:`FakeCuda`): it stands for a host with ``count``
GPUs whose current device starts at 0 (CUDA untouched, or touched on device 0), and records the order of
``set_device`` and ``init_process_group``. The exchange between real ranks is in
tests/keras_integration/test_cuda_devices_ranks.py.
"""

from __future__ import annotations

from typing import Any, List, Optional

import pytest
import torch
import torch.distributed as dist

import keras_dtensor_mixfix as mf
from keras_dtensor_mixfix._keras.backend import cuda_devices
from keras_dtensor_mixfix._keras.backend.cuda_devices import Placement, device_to_set, duplicate_error, shared_devices


class FakeCuda:
    """``torch.cuda`` on a host with ``count`` GPUs (UUID ``GPU-<index>``); ``events`` records calls in order."""

    def __init__(self, count: int, current: int = 0, initialized: bool = False,
                 events: Optional[List[Any]] = None) -> None:
        self.count, self.current, self.initialized = count, current, initialized
        self.events = events if events is not None else []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> "FakeCuda":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda index: type("Props", (), {"uuid": f"GPU-{index}"})())
        return self

    def set_device(self, index: int) -> None:
        self.events.append(("set_device", index))
        self.current, self.initialized = index, True


@pytest.mark.parametrize("local_rank, count, current, expected", [
    (3, 8, 0, 3),        # torchrun's LOCAL_RANK, CUDA untouched (current device 0)
    (3, 8, 3, None),     # already there
    (0, 8, 0, None),     # LOCAL_RANK 0 is the default
    (3, 8, 5, None),     # the program chose device 5 itself: kept
    (3, 1, 0, None),     # one visible GPU per rank (CUDA_VISIBLE_DEVICES): the one it sees
    (9, 8, 0, None),     # more ranks than GPUs: left to the duplicate check, which names it
    (None, 8, 0, None),  # no LOCAL_RANK: left to the duplicate check
])
def test_local_rank_names_the_device_unless_the_program_chose_one(local_rank, count, current, expected):
    assert device_to_set(local_rank, count, current) == expected


def test_select_device_sets_local_rank_also_when_cuda_was_touched_on_device_0(monkeypatch):
    fake = FakeCuda(count=4, current=0, initialized=True).install(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert cuda_devices.select_device() == 2
    assert fake.events == [("set_device", 2)]
    assert cuda_devices.select_device() == 2 and fake.events == [("set_device", 2)]  # idempotent


def test_initialize_sets_the_device_before_the_process_group(monkeypatch):
    """``initialize()`` on a fake 4-GPU host as torchrun's rank 1 starts it: the device is set before the group is
    built, the group is ``cpu:gloo,cuda:nccl``, and the duplicate check runs before anything communicates."""
    from keras_dtensor_mixfix._keras.backend import distribution_lib

    events: List[Any] = []
    FakeCuda(count=4, events=events).install(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: events.append(("init", backend)))
    monkeypatch.setattr(cuda_devices, "check_one_rank_per_device", lambda: events.append(("check",)))
    monkeypatch.setattr(distribution_lib, "_agree_on_seed", lambda: events.append(("seed",)))
    distribution_lib.initialize()
    assert events == [("set_device", 1), ("init", "cpu:gloo,cuda:nccl"), ("check",), ("seed",)]


def test_initialize_sets_the_device_when_the_process_group_already_exists(monkeypatch):
    from keras_dtensor_mixfix._keras.backend import distribution_lib

    events: List[Any] = []
    FakeCuda(count=4, events=events).install(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: events.append(("init",)))
    monkeypatch.setattr(cuda_devices, "check_one_rank_per_device", lambda: events.append(("check",)))
    monkeypatch.setattr(distribution_lib, "_agree_on_seed", lambda: None)
    distribution_lib.initialize()
    assert events == [("set_device", 3), ("check",)]


def _placement(host: str, gpu: str, index: int, local_rank: int) -> Placement:
    return Placement(cuda_devices._hash(host), cuda_devices._hash(gpu), index, local_rank)


def test_ranks_sharing_a_gpu_are_named_with_the_fix():
    placements = [_placement("a", "GPU-0", 0, -1), _placement("a", "GPU-0", 0, -1),
                  _placement("b", "GPU-0", 0, -1), _placement("b", "GPU-1", 1, -1)]
    shared = shared_devices(placements)
    assert list(shared.values()) == [[0, 1]]  # host b's two ranks are on two GPUs
    error = duplicate_error(shared, placements, 1, "a")
    assert isinstance(error, mf.DeviceAssignmentError) and isinstance(error, RuntimeError)
    text = str(error)
    assert "ranks 0 (LOCAL_RANK unset), 1 (LOCAL_RANK unset) all compute on cuda:0 on host a" in text
    assert 'torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))' in text and "--nproc-per-node" in text
    assert error.ranks == {"cuda:0 on host a": [0, 1]}


def test_one_gpu_seen_through_two_visible_device_lists_is_one_gpu():
    """Per-rank ``CUDA_VISIBLE_DEVICES``: every rank's index is 0, the GPUs differ (not shared); the same GPU
    under two indices is shared."""
    assert not shared_devices([_placement("a", "GPU-0", 0, 0), _placement("a", "GPU-1", 0, 1)])
    assert shared_devices([_placement("a", "GPU-3", 0, 0), _placement("a", "GPU-3", 3, 1)])


def test_without_nccl_or_cuda_nothing_is_exchanged(monkeypatch):
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda *a, **k: pytest.fail("exchanged"))
    cuda_devices.check_one_rank_per_device()  # no CUDA here
    FakeCuda(count=2).install(monkeypatch)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    cuda_devices.check_one_rank_per_device(group=object())


def test_nccls_duplicate_gpu_error_becomes_ours(monkeypatch):
    """An NCCL-only group: the exchange is NCCL's first collective, whose ``Duplicate GPU detected`` error
    (faked here, as NCCL words it) is turned into a DeviceAssignmentError saying what to do."""
    FakeCuda(count=2).install(monkeypatch)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    real_tensor, real_empty = torch.tensor, torch.empty
    monkeypatch.setattr(torch, "tensor", lambda data, dtype=None, device=None: real_tensor(data, dtype=dtype))
    monkeypatch.setattr(torch, "empty", lambda *shape, dtype=None, device=None: real_empty(*shape, dtype=dtype))

    def nccl(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1727, invalid usage\nncclInvalidUsage: This usually "
                           "reflects invalid usage of NCCL library.\nLast error:\nDuplicate GPU detected : rank 1 and "
                           "rank 0 both on CUDA device 1000")

    monkeypatch.setattr(dist, "all_gather_into_tensor", nccl)
    with pytest.raises(mf.DeviceAssignmentError) as raised:
        cuda_devices.check_one_rank_per_device(group=type("Group", (), {})())
    text = str(raised.value)
    assert "rank 1 (LOCAL_RANK unset) computes on cuda:0" in text
    assert "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000" in text
    assert "--nproc-per-node" in text

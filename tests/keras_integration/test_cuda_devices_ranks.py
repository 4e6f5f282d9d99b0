"""The one-rank-per-GPU check between real ranks: the exchange is real (gloo, 2 ranks), CUDA is faked.

No GPU here: each rank fakes ``torch.cuda`` (available, its current device given by the test, the GPU behind
index ``i`` has UUID ``GPU-<i>``) and ``dist.get_backend`` reports ``cpu:gloo,cuda:nccl`` (what the Keras
integration's ``initialize()`` builds with CUDA), so the check exchanges over gloo as on an NCCL job.
"""

from __future__ import annotations


from keras_dtensor_mixfix.testing import run_on_ranks


def _check_on_a_fake_nccl_host(indices):
    """One rank of a fake NCCL job whose ranks' current devices are ``indices``: the exchange is real (gloo)."""
    import torch
    import torch.distributed as dist

    from keras_dtensor_mixfix._keras.backend import cuda_devices

    rank = dist.get_rank()
    saved = {name: getattr(torch.cuda, name) for name in ("is_available", "current_device", "get_device_properties")}
    saved_backend = dist.get_backend
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: indices[rank]
    torch.cuda.get_device_properties = lambda index: type("Props", (), {"uuid": f"GPU-{index}"})()
    dist.get_backend = lambda group=None: "cpu:gloo,cuda:nccl"
    try:
        cuda_devices.check_one_rank_per_device(group=dist.new_group(list(range(dist.get_world_size()))))
        return None
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return type(exc).__name__, str(exc), getattr(exc, "ranks", None)
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
        dist.get_backend = saved_backend


def test_two_ranks_on_cuda_0_are_refused_on_every_rank_and_one_per_gpu_passes():
    """Two real ranks exchange over gloo (the CPU half of ``cpu:gloo,cuda:nccl``) with faked CUDA devices: both on
    cuda:0 (LOCAL_RANK unset) raises on both ranks, naming both; cuda:0 and cuda:1 passes."""
    shared = run_on_ranks(_check_on_a_fake_nccl_host, [0, 0], world_size=2)
    for kind, text, ranks in shared:
        assert kind == "DeviceAssignmentError"
        assert "ranks 0 (LOCAL_RANK unset), 1 (LOCAL_RANK unset) all compute on cuda:0 on host" in text
        assert list(ranks.values()) == [[0, 1]]
    assert run_on_ranks(_check_on_a_fake_nccl_host, [0, 1], world_size=2) == [None, None]

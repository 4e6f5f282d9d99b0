"""Reading a DTensor as NumPy or Python values: a whole value on every rank gives it, with no collective; a value
spread over the ranks says which call every rank must make; unpatched, torch's own error.

On 2 ranks and on a (1, 2) mesh (a dim of one rank splits nothing), against the same values in one process.
"""

from __future__ import annotations

import numpy as np
import pytest

from keras_dtensor_mixfix.testing import run_on_ranks


def read_values(mesh_shape):
    """Each reading of a replicated, a partial and a split DTensor, patched and unpatched, on this rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import keras_dtensor_mixfix as mf
    from keras_dtensor_mixfix.testing import mesh

    device_mesh = mesh(mesh_shape, ("batch", "model")[-len(mesh_shape):])
    value = torch.arange(6.0).reshape(2, 3) / 7
    whole = [Replicate()] * device_mesh.ndim
    replicated = distribute_tensor(value, device_mesh, whole)
    # split on the mesh dim of one rank (the first of a (1, 2) mesh): still the whole value here
    trivially_split = distribute_tensor(value, device_mesh, [Shard(0)] + whole[1:]) if mesh_shape[0] == 1 else None
    partial = DTensor.from_local(value / dist.get_world_size(), device_mesh, whole[:-1] + [Partial()],
                                 run_check=False)
    split = distribute_tensor(value, device_mesh, whole[:-1] + [Shard(1)])

    def outcome(call):
        try:
            return ("ok", call())
        except Exception as exc:  # noqa: BLE001 - the error is the outcome
            return ("raised", type(exc).__name__, str(exc), isinstance(exc, RuntimeError))

    def readings():
        got = {
            "numpy": outcome(lambda: replicated.numpy()),
            "asarray": outcome(lambda: np.asarray(replicated)),
            "tolist": outcome(lambda: replicated.tolist()),
            "float": outcome(lambda: float(replicated[1, 2])),
            "partial": outcome(lambda: partial.numpy()),
            "split": outcome(lambda: np.asarray(split)),
            "advice": outcome(lambda: (partial.full_tensor().numpy(), split.full_tensor().numpy())),
            "requires_grad": outcome(lambda: replicated.detach().requires_grad_().numpy()),
        }
        if trivially_split is not None:
            got["trivially_split"] = outcome(lambda: trivially_split.numpy())
        return got

    unpatched = readings()
    with mf.patched():
        patched = readings()
        # only rank 0 reads: no collective may be involved (the others go straight to the barrier)
        if dist.get_rank() == 0:
            patched["rank_zero_only"] = outcome(lambda: replicated.numpy())
        dist.barrier()
    return unpatched, patched


@pytest.mark.parametrize("mesh_shape", [(2,), (1, 2)], ids=["2 ranks", "1x2 mesh"])
def test_a_whole_value_reads_as_in_one_process_and_a_spread_one_names_the_collective(mesh_shape):
    import torch

    value = (torch.arange(6.0).reshape(2, 3) / 7)
    plain_grad_error = None
    try:
        value.clone().requires_grad_().numpy()
    except RuntimeError as exc:
        plain_grad_error = str(exc)
    for rank, (unpatched, patched) in enumerate(run_on_ranks(read_values, mesh_shape, world_size=2, timeout=120)):
        for key in ("numpy", "asarray", "tolist", "partial", "split"):
            assert unpatched[key][0] == "raised" and "not supported for tensor subclasses" in unpatched[key][2], key
        for key in ("numpy", "asarray"):
            assert patched[key][0] == "ok", patched[key]
            np.testing.assert_array_equal(patched[key][1], value.numpy())
        assert patched["tolist"] == ("ok", value.tolist())
        assert patched["float"] == unpatched["float"] == ("ok", float(value[1, 2]))
        for key, kind in (("partial", "a partial sum"), ("split", "split")):
            status, error_type, text, is_runtime_error = patched[key]
            # the package's own error, still a RuntimeError as torch's refusal was
            assert (status, error_type, is_runtime_error) == ("raised", "SpreadValueError", True), patched[key]
            assert kind in text and "full_tensor()" in text and "every rank" in text, text
        for got in patched["advice"][1]:  # the advice followed
            np.testing.assert_allclose(got, value.numpy(), rtol=1e-6)
        assert patched["requires_grad"] == ("raised", "RuntimeError", plain_grad_error, True)
        if mesh_shape == (1, 2):
            assert patched["trivially_split"][0] == "ok"
            np.testing.assert_array_equal(patched["trivially_split"][1], value.numpy())
        if rank == 0:
            np.testing.assert_array_equal(patched["rank_zero_only"][1], value.numpy())

"""torch limitation: under the rank simulator (``LocalTensorMode(N)``), the first use of a mesh costs O(N²): its
``get_coordinate`` re-runs the same mesh-layout computation (``_MeshLayout.remap_to_tensor``) once per simulated rank,
each run dispatched through the mode, where it does not depend on the rank. 64 s for a 512-rank mesh here, once per
mesh and mode; a result computed once and indexed per rank is the same (``tests/_simulator.py`` does that, checked equal
to torch's).

Seen on torch 2.11.0, 2.12.1, 2.13.0, 2.14.1 and 2.15.0. No keras_dtensor_mixfix involved. Nothing of the package
changes under it (docs/testing.md says what it costs); the package's own simulated tests compute the coordinates once.

Run: ``python repros/torch_local_tensor_mesh_coordinate_per_rank.py`` (exits 1 while the layout is computed once per
rank: it counts the computations for a 16-rank mesh); ``tests/patterns/test_torch_repros.py`` runs it from the
upstream-defect table.
"""

import subprocess
import sys

PROGRAM = r"""
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed._mesh_layout import _MeshLayout
from torch.testing._internal.distributed.fake_pg import FakeStore

calls = []
original = _MeshLayout.remap_to_tensor
def counted(self, *args, **kwargs):
    calls.append(1)
    return original(self, *args, **kwargs)
_MeshLayout.remap_to_tensor = counted
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=16)
with LocalTensorMode(16):
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (4, 4))
    before = len(calls)
    mesh.get_coordinate()
    print(len(calls) - before)
dist.destroy_process_group()
"""
RANKS = 16


def repro() -> None:
    """Raises AssertionError while a mesh's coordinate computes its layout once per simulated rank."""
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    computed = int(done.stdout.strip().splitlines()[-1])
    assert computed <= 1, (f"get_coordinate computed the mesh layout {computed} times for {RANKS} simulated ranks "
                           "(once per rank: O(ranks²) per mesh)")


if __name__ == "__main__":
    repro()
    print("fixed: the mesh layout is computed once")

"""torch limitation: loading a tensor ``torch.distributed.checkpoint`` saved whole into a sharded DTensor reads the
whole saved tensor on every rank, not only the slice each rank's piece needs.

``FileSystemReader`` reads a stored item's bytes whole, loads the tensor and narrows it to the requested region.
A checkpoint saved by ranks holding pieces stores each piece as its own item, so resharded loads read little more
than the pieces; one saved by a single process (or from a replicated tensor) stores each weight as one item, and
every rank of the loading job then reads and holds the whole weight for a moment.

Seen on torch 2.11.0, 2.12.1, 2.13.0 and 2.15.0; no keras_dtensor_mixfix involved. keras_dtensor_mixfix.checkpoint uses
DCP as it is (docs/keras.md, "Saving, loading and memory" says what a rank holds while loading).

Run: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 repros/torch_dcp_load_reads_whole_saved_tensor.py``
(exits 1 while the limitation is there); ``tests/patterns/test_torch_repros.py`` runs it as an expected failure.
"""

import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

ROWS, COLUMNS = 4096, 2048  # 32 MB of float32


def _bytes_read() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


def repro() -> None:
    """Raises AssertionError while a rank reads the whole saved tensor; returns once it reads about its slice."""
    directory = [tempfile.mkdtemp(prefix="dcp-repro-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    path = os.path.join(directory[0], "whole")
    if dist.get_rank() == 0:  # saved whole, as one process would
        dcp.save({"w": torch.ones(ROWS, COLUMNS)}, checkpoint_id=path, no_dist=True)
    dist.barrier()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    target = distribute_tensor(torch.zeros(ROWS, COLUMNS), mesh, [Shard(0)])
    before = _bytes_read()
    try:
        dcp.load({"w": target}, checkpoint_id=path)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(directory[0], ignore_errors=True)
    read = _bytes_read() - before
    whole = ROWS * COLUMNS * 4
    assert bool(target.to_local().eq(1).all())
    assert read < whole // dist.get_world_size() + whole // 8, (
        f"rank {dist.get_rank()} read {read} bytes to load its {whole // dist.get_world_size()}-byte piece")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        repro()
        print(f"rank {dist.get_rank()}: fixed in torch {torch.__version__}")
    finally:
        dist.destroy_process_group()

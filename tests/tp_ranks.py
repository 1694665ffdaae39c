"""The rank runner the tensor-parallel tests share (tests/test_tensor_parallel*.py).

``run_ranks(body, world, folder)`` forks ``world`` CPU processes on gloo (a file rendezvous; fork,
so the ranks inherit this process's imports instead of re-importing torch and transformers), calls
``body(tp)`` on each with its ``TPGroup`` and returns the dicts they returned, in rank order (saved
with torch.save, so tensors come back with their bits). ``FakeTP`` stands for a group's place where
only rank and world are read (sharding refusals), with no process group.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bitmatch.parallel import TPGroup


def _rank(rank, world, store, folder, body):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.save(body(TPGroup.current()), os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(body, world: int, folder) -> list:
    folder = str(folder)
    mp.start_processes(_rank, args=(world, os.path.join(folder, "store"), folder, body), nprocs=world, join=True,
                       start_method="fork")
    return [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(world)]


class FakeTP:
    """A TP group's place without a process group (sharding reads only rank and world)."""

    def __init__(self, rank, world):
        self.rank, self.world, self.group = rank, world, None

"""Tensor-parallel ranks as forked CPU processes on gloo, on one machine: what the tests and
``bitmatch locate --tp N`` use to run a body on every rank of a group without a launcher.

``run_ranks(body, world)`` forks ``world`` processes (fork: the ranks inherit this process's
imports and any model built before the call, so nothing is pickled on the way in), joins them in
one gloo group (a file rendezvous), calls ``body(tp)`` on each with its ``TPGroup`` and returns what
each returned, in rank order (through torch.save, so tensors keep their bits). A collective that one
rank never joins fails after ``timeout_s`` instead of hanging.
"""
from __future__ import annotations

import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .collectives import TPGroup


def _rank(rank, world, store, folder, body, timeout_s):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        torch.save(body(TPGroup.current()), os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(body, world: int, folder=None, *, timeout_s: float = 90) -> list:
    """``[body(tp) of rank 0, ..., of rank world - 1]``, each rank a forked CPU process on gloo.
    ``folder``: where the rendezvous file and the results go (default: a temporary folder)."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"run_ranks: world must be an int >= 1, got {world!r}")
    if dist.is_initialized():
        raise RuntimeError("run_ranks: this process is already in a process group; call it from a plain process")
    with tempfile.TemporaryDirectory(prefix="bitmatch-ranks-") as tmp:
        folder = str(folder or tmp)
        mp.start_processes(_rank, args=(world, os.path.join(folder, "store"), folder, body, timeout_s),
                           nprocs=world, join=True, start_method="fork")
        # results written by this library's own ranks a moment ago (LocateResult objects, not only tensors)
        return [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(world)]

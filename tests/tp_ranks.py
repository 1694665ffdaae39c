"""The rank runner the tensor-parallel tests share (tests/test_tensor_parallel*.py).

``run_ranks(body, world, folder)`` forks ``world`` CPU processes on gloo (a file rendezvous; fork,
so the ranks inherit this process's imports instead of re-importing torch and transformers), calls
``body(tp)`` on each with its ``TPGroup`` and returns the dicts they returned, in rank order (saved
with torch.save, so tensors come back with their bits); ``ranks_fixture`` makes it a module fixture
per world size; ``padded_batch`` and ``packed_ctx`` are the inputs they score. ``FakeTP`` stands for
a group's place where only rank and world are read (sharding refusals), with no process group.
"""
from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bitmatch.context import ForwardContext
from bitmatch.parallel import TPGroup


def _rank(rank, world, store, folder, body):
    torch.set_num_threads(1)
    # a collective one rank never joins fails the test after this long instead of hanging CI
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    try:
        torch.save(body(TPGroup.current()), os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(body, world: int, folder) -> list:
    folder = str(folder)
    mp.start_processes(_rank, args=(world, os.path.join(folder, "store"), folder, body), nprocs=world, join=True,
                       start_method="fork")
    return [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(world)]


def ranks_fixture(body, prefix: str, worlds=(2, 4)):
    """A module-scoped fixture, one instance per world size: ``(world, [each rank's body(tp)])``."""
    @pytest.fixture(scope="module", params=list(worlds), ids=lambda n: f"tp{n}")
    def ranks(request, tmp_path_factory):
        world = request.param
        return world, run_ranks(body, world, tmp_path_factory.mktemp(f"{prefix}{world}"))
    return ranks


def padded_batch():
    """3 rows of 13 tokens: one whole, one left-padded, one right-padded."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 99, (3, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    return ids, mask


def packed_ctx(ids):
    """One sequence of packed prefill (the trainer's context) for 1-D ``ids``."""
    t = ids.shape[0]
    return ForwardContext(positions=torch.arange(t), cu_seqlens=torch.tensor([0, t], dtype=torch.int32),
                          max_query_len=t, max_seq_len=t)


class FakeTP:
    """A TP group's place without a process group (sharding reads only rank and world)."""

    def __init__(self, rank, world):
        self.rank, self.world, self.group = rank, world, None

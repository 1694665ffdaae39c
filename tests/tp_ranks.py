"""The rank runner the tensor-parallel tests share (tests/test_tensor_parallel*.py).

``run_ranks(body, world, folder)``: ``bitmatch.parallel.launch.run_ranks`` (forked CPU ranks on
gloo, each ``body(tp)``'s result in rank order); ``ranks_fixture`` makes it a module fixture
per world size; ``padded_batch`` and ``packed_ctx`` are the inputs they score. ``FakeTP`` stands for
a group's place where only rank and world are read (sharding refusals), with no process group.
"""
from __future__ import annotations

import pytest
import torch

from bitmatch.context import ForwardContext
from bitmatch.parallel.launch import run_ranks


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

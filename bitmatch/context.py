"""The forward context: per-step metadata that attention layers read (nano-vllm style).

One object instead of threading positions, sequence boundaries and the paged-cache tables
through every module call. The trainer sets a packed-prefill context (``cu_seqlens``); the
engine sets a paged one (``slot_mapping``, ``block_table``, ``kv_caches``).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

_state = threading.local()


@dataclass
class ForwardContext:
    positions: torch.Tensor                      # [T] int64, absolute position of each token
    cu_seqlens: torch.Tensor | None = None       # [B+1] int32, packed-prefill mode
    query_start_loc: torch.Tensor | None = None  # [B+1] int32, paged mode
    seq_lens: torch.Tensor | None = None         # [B] int32, context incl. this step's tokens
    block_table: torch.Tensor | None = None      # [B, max_blocks] int32
    slot_mapping: torch.Tensor | None = None     # [T] int64
    kv_caches: list | None = None                # per layer (k_cache, v_cache)

    @property
    def paged(self) -> bool:
        return self.slot_mapping is not None


def get_forward_context() -> ForwardContext | None:
    return getattr(_state, "ctx", None)


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext | None):
    """Install ``ctx`` for the duration of the block; nests and restores on any exit."""
    prev = get_forward_context()
    _state.ctx = ctx
    try:
        yield ctx
    finally:
        _state.ctx = prev

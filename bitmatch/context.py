"""The forward context: per-step metadata that attention layers read (nano-vllm style).

One object instead of threading positions, sequence boundaries and the paged-cache tables
through every module call; it is passed to ``bitmatch.models.forward_hidden`` explicitly. The
trainer builds a packed-prefill context (``cu_seqlens``); the engine builds a paged one
(``slot_mapping``, ``block_table``, ``state_slots`` and ``caches``: one entry per cache group of the model's
family, ``{group name: {layer index: cache}}``, allocated by ``bitmatch.models.allocate_caches``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    positions: torch.Tensor                      # [T] int64, absolute position of each token
    cu_seqlens: torch.Tensor | None = None       # [B+1] int32, packed-prefill mode
    query_start_loc: torch.Tensor | None = None  # [B+1] int32, paged mode
    seq_lens: torch.Tensor | None = None         # [B] int32, context incl. this step's tokens
    block_table: torch.Tensor | None = None      # [B, max_blocks] int32
    slot_mapping: torch.Tensor | None = None     # [T] int64
    caches: dict | None = None                   # {cache group: {layer: cache}}
    state_slots: torch.Tensor | None = None      # [B] int64, paged mode: each sequence's per_seq slot
    # host-side step metadata (ModelRunner.prepare computes them once per step from its host lists):
    # kernels read these ints instead of reading device tensors back, so a step has no per-layer
    # host sync and can be captured in a CUDA graph. None: the kernels compute them (direct callers).
    max_query_len: int | None = None             # longest query chunk of the step
    max_seq_len: int | None = None               # longest context (seq_lens bound); positions < it
    cu_seqlens_host: tuple | None = None         # cu_seqlens' values on the host (the trainer's pack)
    # every sequence of the step starts at position 0 (no cached prefix): attention may run on the
    # step's own contiguous K/V (attention_prefill over query_start_loc), same bits as the paged path
    fresh_prefill: bool = False
    # None, or "fp8": the family's projection linears on block-FP8 weights (bitmatch.models.fp8_mode);
    # the trainer and the engine set it from their own quantization= argument
    quantization: str | None = None

    @property
    def paged(self) -> bool:
        return self.slot_mapping is not None

    def cache(self, group: str, layer: int):
        """The cache of ``layer`` in cache group ``group``; ValueError naming what is missing."""
        if self.caches is None or group not in self.caches:
            raise ValueError(f"bitmatch: paged ForwardContext without the {group!r} cache group "
                             f"(has {sorted(self.caches or {})})")
        per_layer = self.caches[group]
        if layer not in per_layer:
            raise ValueError(f"bitmatch: cache group {group!r} has no entry for layer {layer}")
        return per_layer[layer]

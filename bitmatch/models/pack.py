"""Padded batch <-> packed tokens (the layout every bitmatch forward runs on)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from bitmatch.context import ForwardContext


@dataclass
class Packed:
    input_ids: torch.Tensor    # [T] int64, real tokens in row-major order
    positions: torch.Tensor    # [T] int64, 0 at each sequence's first token
    cu_seqlens: torch.Tensor   # [S+1] int32
    rows: torch.Tensor         # [T] int64, row of each packed token in the padded batch
    cols: torch.Tensor         # [T] int64, column of each packed token
    seq_start: torch.Tensor    # [T] bool, first token of its sequence
    seq_end: torch.Tensor      # [T] bool, last token of its sequence
    cu_host: tuple | None = None  # cu_seqlens' values on the host, when the layout was built there

    def context(self) -> ForwardContext:
        return ForwardContext(positions=self.positions, cu_seqlens=self.cu_seqlens)


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
         position_ids: torch.Tensor | None = None) -> Packed:
    """Pack the real tokens of a padded batch (left, right or mixed padding).

    Each row's real tokens (mask != 0) form one sequence; positions count from 0 at its first
    real token. With explicit ``position_ids`` the real tokens take those positions and a new
    sequence starts wherever a position is 0 (padding-free packing), or resets downward.
    """
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError("pack: input_ids must be a tensor [B, L]")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise ValueError(f"pack: input_ids must be [B, L], got shape {tuple(input_ids.shape)}")
    B, L = input_ids.shape
    dev = input_ids.device
    if attention_mask is None:
        mask = torch.ones((B, L), dtype=torch.bool, device=dev)
    else:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            raise ValueError("pack: attention_mask must be a 2-D tensor shaped like input_ids "
                             f"(got {getattr(attention_mask, 'shape', type(attention_mask))})")
        mask = attention_mask.to(dev) != 0
    rows, cols = mask.nonzero(as_tuple=True)
    ids = input_ids[rows, cols].to(torch.long)
    T = ids.shape[0]
    new_row = torch.ones(T, dtype=torch.bool, device=dev)
    if T > 1:
        new_row[1:] = rows[1:] != rows[:-1]
    if position_ids is not None:
        if position_ids.dim() == 1:
            position_ids = position_ids[None].expand(B, L)
        if position_ids.shape != input_ids.shape:
            raise ValueError("pack: position_ids must be shaped like input_ids")
        pos = position_ids.to(dev)[rows, cols].to(torch.long)
        start = new_row.clone()
        if T > 1:
            start[1:] |= (pos[1:] == 0) | (pos[1:] <= pos[:-1])
        # positions must count up by one inside a sequence
        if T > 1:
            bad = (~start[1:]) & (pos[1:] != pos[:-1] + 1)
            if bool(bad.any()):
                raise ValueError("pack: position_ids must increase by 1 within each sequence")
    else:
        start = new_row
    seq_id = torch.cumsum(start.to(torch.long), 0) - 1
    S = int(seq_id[-1]) + 1 if T > 0 else 0
    counts = torch.bincount(seq_id, minlength=S) if T > 0 else torch.zeros(0, dtype=torch.long, device=dev)
    cu = torch.zeros(S + 1, dtype=torch.int32, device=dev)
    cu[1:] = torch.cumsum(counts, 0).to(torch.int32)
    starts = cu[:-1].to(torch.long)
    positions = torch.arange(T, device=dev, dtype=torch.long) - starts[seq_id] if T > 0 else \
        torch.zeros(0, dtype=torch.long, device=dev)
    if position_ids is not None and T > 0:
        positions = pos  # validated above: +1 steps inside each sequence
    end = torch.zeros(T, dtype=torch.bool, device=dev)
    if T > 0:
        end[(cu[1:] - 1).to(torch.long)] = True
    return Packed(ids, positions, cu, rows, cols, start, end)

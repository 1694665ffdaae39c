"""The Lightning Indexer's scores on the Triton backend: one fused kernel for every query row of a
step (packed rows or paged caches), a block of keys per program.

Canonical order (this backend's bits), for query row i (position t) and key c (c < (t+1) // m,
read at the address of position (c+1)*m - 1 of the row's sequence):
    d_h   = dot(q_h, k_c)                       one tensor-core dot over Di, fp32 accumulation
                                                (IEEE fp32 for fp32 inputs)
    score = tl.sum over the head axis of  (max(d_h, 0) * softmax_scale) * w_h      (fp32; the
            sum's tree fixed by BLOCK_HI = next_pow2(H) (padded heads add exact zeros), BLOCK_C
            and the warps, constants of this order: op_versions["indexer"] = 2)
Keys not complete at t score -inf. A score depends on (q_t, w_t, k_c) alone: never on the batch,
the number of rows or keys, or the store's layout. The selection (kernels.indexer.select_rows) is
a stable sort: ties to the lowest index. ``indexer_scores`` (one sequence, keys 0..C-1, all
scored) runs the same kernel.
"""
import torch
import triton
import triton.language as tl

from ..compressed_attention import KeyRows
from . import interpreting
from .compressed_attention import block_dot, key_address

BLOCK_C = 64
WARPS = 4


@triton.jit
def _index_scores_kernel(q_ptr, k_ptr, w_ptr, o_ptr, pos_ptr, start_ptr, seq_ptr, bt_ptr, bt_stride, page_size,
                         H, n_cols, softmax_scale, rate,
                         DI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_C: tl.constexpr,
                         PAGED: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t = tl.load(pos_ptr + i).to(tl.int32)
    n_vis = (t + 1) // rate
    c_ok = c < n_vis
    score = tl.full((BLOCK_C,), float("-inf"), tl.float32)
    if tl.program_id(1) * BLOCK_C < n_vis:
        start = tl.zeros((), tl.int64)
        bt_row = bt_ptr
        if PAGED:
            bt_row = bt_ptr + tl.load(seq_ptr + i) * bt_stride
        else:
            start = tl.load(start_ptr + i)
        h = tl.arange(0, BLOCK_HI)
        h_ok = h < H
        d = tl.arange(0, BLOCK_D)
        d_ok = d < DI
        q = tl.load(q_ptr + i.to(tl.int64) * H * DI + h[:, None] * DI + d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_ptr + i.to(tl.int64) * H + h, mask=h_ok, other=0.0)
        addr = key_address(tl.where(c_ok, (c + 1) * rate - 1, 0), start, bt_row, page_size, PAGED)
        k = tl.load(k_ptr + addr[:, None] * DI + d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        s = block_dot(q, tl.trans(k), INTERP, PREC)                        # [BLOCK_HI, BLOCK_C]
        per_head = (tl.maximum(s, 0.0) * softmax_scale) * w[:, None]
        score = tl.where(c_ok, tl.sum(per_head, axis=0), float("-inf"))
    tl.store(o_ptr + i.to(tl.int64) * n_cols + c, score, mask=c < n_cols)


def indexer_scores_rows(q, qpos, keys, weights, rows, rate, n_cols, softmax_scale):
    T, H, DI = q.shape
    out = torch.empty((T, n_cols), dtype=torch.float32, device=q.device)
    if T == 0:
        return out
    interp = interpreting(q)
    if rows.paged_mode:
        start, seq, bt, bt_stride, page = qpos, rows.seq_idx, rows.block_table, rows.block_table.stride(0), rows.block_size
    else:
        start, seq, bt, bt_stride, page = rows.row_start, qpos, qpos, 0, 1
    kw = {} if interp else dict(num_warps=WARPS, enable_fp_fusion=False)
    prec = "ieee" if (q.dtype == torch.float32 or interp) else "tf32"
    _index_scores_kernel[(T, triton.cdiv(n_cols, BLOCK_C))](
        q, keys, weights, out, qpos, start, seq, bt, bt_stride, page, H, n_cols, float(softmax_scale), int(rate),
        DI=DI, BLOCK_D=triton.next_power_of_2(DI), BLOCK_HI=max(16, triton.next_power_of_2(H)), BLOCK_C=BLOCK_C,
        PAGED=rows.paged_mode, INTERP=interp, PREC=prec, **kw)
    return out


def indexer_scores(q, keys, weights, softmax_scale):
    """One sequence, every key 0..C-1 scored: the rows kernel on a packed store from row 0, each
    row placed at position C-1 so all C keys are complete (rate 1)."""
    n = keys.shape[0]
    pos = torch.full((q.shape[0],), max(n - 1, 0), dtype=torch.int64, device=q.device)
    rows = KeyRows.packed(pos, row_start=torch.zeros_like(pos), max_len=max(n, 1))
    return indexer_scores_rows(q, pos, keys, weights.float().contiguous(), rows, 1, n, softmax_scale)[:, :n]

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
a stable sort: ties to the lowest index; ``select_rows`` here selects the same entries in one
launch per step (``_select_kernel``: the K-th largest score by a bitwise search over order-keeping
integer keys, integer counts only, so exact). ``indexer_scores`` (one sequence, keys 0..C-1, all
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
        start, seq, bt, bt_stride, page = (qpos, rows.seq_idx, rows.block_table, rows.block_table.stride(0),
                                           rows.block_size)
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


SELECT_BLOCK = 256  # scores per counting step (speed only: counts are exact)


@triton.jit
def _sort_key(s):
    """fp32 -> uint32 whose unsigned order is torch.sort's order of the scores: -0.0 as +0.0, every
    NaN above +inf (equal keys: equal under the sort, ties then go by index)."""
    s = s + 0.0                                        # -0.0 + 0.0 = +0.0
    u = s.to(tl.uint32, bitcast=True)
    top = tl.full(u.shape, 1, tl.uint32) << 31
    ones = top | (top - 1)                             # 0xFFFFFFFF (xor, not ~: the interpreter's ~ is signed)
    key = tl.where((u >> 31) != 0, u ^ ones, u | top)
    return tl.where(s != s, ones, key)


@triton.jit
def _select_kernel(s_ptr, pos_ptr, out_ptr, C, rate, K, TOP_K, BLOCK: tl.constexpr):
    """Row r: the K largest of its visible scores (ties to the lowest index), ascending, then -1.
    thr = the K-th largest key (32 counting passes when more than K are visible, else 0: every
    visible key is > 0); the keys > thr, then the lowest-index keys == thr up to K in all."""
    r = tl.program_id(0).to(tl.int64)
    row = s_ptr + r * C
    n_vis = tl.minimum((tl.load(pos_ptr + r).to(tl.int64) + 1) // rate, C)
    thr = tl.zeros((), tl.uint32)   # every visible key is > 0: all selected unless n_vis > K
    if n_vis > K:
        # the K-th largest visible key, bit by bit from the top (counts: exact)
        bit = tl.full((), 1, tl.uint32) << 31
        for _ in range(0, 32):
            cand = thr | bit
            bit = bit >> 1
            cnt = tl.zeros((), tl.int64)
            for c0 in range(0, n_vis, BLOCK):
                c = c0 + tl.arange(0, BLOCK)
                key = _sort_key(tl.load(row + c, mask=c < n_vis, other=0.0))
                cnt += tl.sum(((key >= cand) & (c < n_vis)).to(tl.int64), 0)
            thr = tl.where(cnt >= K, cand, thr)
    n_gt = tl.zeros((), tl.int64)
    for c0 in range(0, n_vis, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        key = _sort_key(tl.load(row + c, mask=c < n_vis, other=0.0))
        n_gt += tl.sum(((key > thr) & (c < n_vis)).to(tl.int64), 0)
    need = tl.minimum(K, n_vis) - n_gt               # keys equal to the threshold taken, lowest index first
    n_eq = tl.zeros((), tl.int64)
    n_sel = tl.zeros((), tl.int64)
    for c0 in range(0, n_vis, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        ok = c < n_vis
        key = _sort_key(tl.load(row + c, mask=ok, other=0.0))
        eq = (ok & (key == thr)).to(tl.int64)
        sel = ok & ((key > thr) | ((key == thr) & (n_eq + tl.cumsum(eq, 0) - eq < need)))
        f = sel.to(tl.int64)
        tl.store(out_ptr + r * TOP_K + n_sel + tl.cumsum(f, 0) - f, c.to(tl.int32), mask=sel)
        n_eq += tl.sum(eq, 0)
        n_sel += tl.sum(f, 0)
    for o0 in range(0, TOP_K, BLOCK):
        o = o0 + tl.arange(0, BLOCK)
        tl.store(out_ptr + r * TOP_K + o, tl.full((BLOCK,), -1, tl.int32), mask=(o >= n_sel) & (o < TOP_K))


def select_rows(scores, qpos, rate, top_k):
    """kernels.indexer.select_rows (a stable descending sort, the top min(top_k, C) visible entries,
    ascending, -1 padded) in one launch: int32 [T, top_k] from scores fp32 [T, C] whose entries past
    a row's visible count score -inf (as the score kernels write them), so they never outrank a
    visible one and only the visible entries are read. Replaces two sorts and four elementwise
    launches a CSA layer and step (their cost in the V4 decode step: deepseek_v4_decode_ops.py)."""
    T, C = scores.shape
    out = torch.empty((T, top_k), dtype=torch.int32, device=scores.device)
    if T:
        _select_kernel[(T,)](scores.contiguous(), qpos.contiguous(), out, C, rate, min(top_k, C), top_k,
                             BLOCK=SELECT_BLOCK, **({} if interpreting(scores) else dict(num_warps=4)))
    return out

"""sink_attention on the Triton backend: one fused kernel for every query row of a step (varlen
packed rows or paged caches), MQA over the single K = V head, a group of heads per program.

Canonical order (this backend's bits), for the query row i (absolute position t) and head h, in
base-2 fp32 (``s = dot(q, k) * scale * log2 e``, the dot one tensor-core dot over the whole head
dim, IEEE fp32 for fp32 inputs):
    state  (m, l, acc) = (sink_h * log2 e, 1, 0)           the sink is the softmax's first term
    local  for each key block [b*BLOCK_N, (b+1)*BLOCK_N) of ABSOLUTE positions from the block of
           max(0, t-W+1) to the block of t, in order:
              m' = max(m, max_j s_j); a = 2^(m - m'); p_j = 2^(s_j - m')   (keys outside the window: p = 0)
              l  = l * a + sum_j p_j;  acc = acc * a + dot(round_dtype(p), v);  m = m'
    entries the same update over blocks of BLOCK_N entry-list positions from 0: HCA the list is
           the complete windows 0..(t+1)//m - 1, CSA the row's ``selected`` indices (ascending,
           -1 padded); only blocks holding a listed entry are walked
    out    = round_dtype(div_rn(acc, l))
BLOCK_N = 32 and BLOCK_H = 16 (heads per program, padded), 4 warps: constants of this order
(op_versions["compressed_attention"] = 2). The walk depends only on t, the window and the row's
own entry list: never on the batch, the number of rows, the cache layout or the block size.
Keys are read through the block table (paged) or ``row_start + j`` (packed), loads of keys
outside the window or list are masked to 0 (never 0 * garbage). ``sink_attention`` (one
sequence, an entry mask) runs the same kernel on a packed store with its mask as a list.
"""
import torch
import triton
import triton.language as tl

from ..compressed_attention import KeyRows, entry_list
from . import interpreting

_LOG2E = 1.4426950408889634
BLOCK_N = 32
BLOCK_H = 16
WARPS = 4


@triton.jit
def block_dot(a, b, INTERP: tl.constexpr, PREC: tl.constexpr):
    if INTERP:  # the interpreter's bf16 dot is unreliable: float64, rounded to fp32
        return tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def key_address(pos, start, bt_row_ptr, page_size, PAGED: tl.constexpr):
    """int64 store rows of positions ``pos`` of the program's sequence."""
    if PAGED:
        page = tl.load(bt_row_ptr + pos // page_size).to(tl.int64)
        return page * page_size + (pos % page_size).to(tl.int64)
    else:
        return start + pos.to(tl.int64)


@triton.jit
def _fold(q, kv_ptr, addr, ok, offs_d, d_ok, m, l, acc, qk_scale, D: tl.constexpr,
          INTERP: tl.constexpr, PREC: tl.constexpr):
    """One key block into the online softmax state; keys with ok False have p = 0 exactly."""
    k = tl.load(kv_ptr + addr[:, None] * D + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    s = block_dot(q, tl.trans(k), INTERP, PREC) * qk_scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))           # m is finite from the start (the sink)
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + block_dot(p.to(k.dtype), k, INTERP, PREC)
    return m_new, l, acc


@triton.jit
def _sink_rows_kernel(q_ptr, kv_ptr, ent_ptr, sel_ptr, sink_ptr, o_ptr, lse_ptr, pos_ptr, start_ptr, seq_ptr,
                      bt_ptr, bt_stride, page_size, H, n_sel, qk_scale, window, rate,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                      PAGED: tl.constexpr, MODE: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
                      STORE_LSE: tl.constexpr):
    i = tl.program_id(0)
    hg = tl.program_id(1)
    t = tl.load(pos_ptr + i).to(tl.int32)
    start = tl.zeros((), tl.int64)
    bt_row = bt_ptr
    if PAGED:
        bt_row = bt_ptr + tl.load(seq_ptr + i) * bt_stride
    else:
        start = tl.load(start_ptr + i)
    h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_n = tl.arange(0, BLOCK_N)
    row = i.to(tl.int64) * H * D
    q = tl.load(q_ptr + row + h[:, None] * D + offs_d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    l = tl.full((BLOCK_H,), 1.0, tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    lo = tl.maximum(t - window + 1, 0)
    for j0 in range((lo // BLOCK_N) * BLOCK_N, t + 1, BLOCK_N):
        j = j0 + offs_n
        ok = (j >= lo) & (j <= t)
        addr = key_address(tl.where(ok, j, 0), start, bt_row, page_size, PAGED)
        m, l, acc = _fold(q, kv_ptr, addr, ok, offs_d, d_ok, m, l, acc, qk_scale, D, INTERP, PREC)
    if MODE == 1:  # HCA: every complete window
        n_ent = (t + 1) // rate
        for c0 in range(0, n_ent, BLOCK_N):
            c = c0 + offs_n
            ok = c < n_ent
            addr = key_address(tl.where(ok, (c + 1) * rate - 1, 0), start, bt_row, page_size, PAGED)
            m, l, acc = _fold(q, ent_ptr, addr, ok, offs_d, d_ok, m, l, acc, qk_scale, D, INTERP, PREC)
    if MODE == 2:  # CSA: the row's selected entries (ascending, -1 padded): walk the listed prefix
        sel_row = sel_ptr + i.to(tl.int64) * n_sel
        n_ent = tl.zeros((), tl.int32)
        for p0 in range(0, n_sel, BLOCK_N):
            idx = tl.load(sel_row + p0 + offs_n, mask=p0 + offs_n < n_sel, other=-1)
            n_ent += tl.sum((idx >= 0).to(tl.int32), axis=0)
        for p0 in range(0, n_ent, BLOCK_N):
            idx = tl.load(sel_row + p0 + offs_n, mask=p0 + offs_n < n_ent, other=-1)
            ok = idx >= 0
            addr = key_address(tl.where(ok, (idx + 1) * rate - 1, 0), start, bt_row, page_size, PAGED)
            m, l, acc = _fold(q, ent_ptr, addr, ok, offs_d, d_ok, m, l, acc, qk_scale, D, INTERP, PREC)
    out = tl.math.div_rn(acc, l[:, None])
    if STORE_LSE:  # the backward's base-2 logsumexp (sink included); read after ``out``: no bit changes
        tl.store(lse_ptr + i.to(tl.int64) * H + h, m + tl.log2(l), mask=h_ok)
    tl.store(o_ptr + row + h[:, None] * D + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=h_ok[:, None] & d_ok[None, :])


def sink_attention_rows(q, qpos, kv, entries, selected, sinks, rows, scale, window, rate, lse=None):
    """``lse`` (fp32 [T, H] or None): filled with each row's base-2 logsumexp for the backward."""
    T, H, D = q.shape
    out = torch.empty_like(q)
    if T == 0:
        return out
    interp = interpreting(q)
    mode = 0 if entries is None else (1 if selected is None else 2)
    ent = entries if entries is not None else kv
    sel = selected.to(torch.int32).contiguous() if selected is not None else qpos
    n_sel = selected.shape[1] if selected is not None else 0
    if rows.paged_mode:
        start, seq, bt, bt_stride, page = (qpos, rows.seq_idx, rows.block_table, rows.block_table.stride(0),
                                           rows.block_size)
    else:
        start, seq, bt, bt_stride, page = rows.row_start, qpos, qpos, 0, 1
    kw = {} if interp else dict(num_warps=WARPS, num_stages=2, enable_fp_fusion=False)
    prec = "ieee" if (q.dtype == torch.float32 or interp) else "tf32"
    _sink_rows_kernel[(T, triton.cdiv(H, BLOCK_H))](
        q, kv, ent, sel, sinks.float().contiguous(), out, lse if lse is not None else out, qpos, start, seq, bt,
        bt_stride, page, H, n_sel,
        float(scale) * _LOG2E, int(window), int(rate), D=D, BLOCK_D=triton.next_power_of_2(D), BLOCK_H=BLOCK_H,
        BLOCK_N=BLOCK_N, PAGED=rows.paged_mode, MODE=mode, INTERP=interp, PREC=prec,
        STORE_LSE=lse is not None, **kw)
    return out


def sink_attention(q, qpos, kv, entries, entry_mask, sinks, scale, window):
    """One sequence (keys at rows 0..L-1, entries at rows 0..C-1, any entry mask): the rows kernel
    on a packed store whose every row starts at 0, the mask as each row's ascending entry list."""
    n_ent = entry_mask.shape[1]
    rows = KeyRows.packed(qpos, row_start=torch.zeros_like(qpos, dtype=torch.int64), max_len=kv.shape[0])
    if n_ent == 0:
        return sink_attention_rows(q, qpos, kv, None, None, sinks, rows, scale, window, 1)
    return sink_attention_rows(q, qpos, kv, entries, entry_list(entry_mask, n_ent), sinks, rows, scale, window, 1)

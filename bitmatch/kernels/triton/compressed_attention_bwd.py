"""sink_attention_rows backward on the Triton backend: one fused kernel, flash-attention style.

The forward stores each row's base-2 logsumexp (``lse2 = m + log2(l)``, the sink included), so p
is recomputed per key block, never stored ([rows, heads, keys] never exists). One program per
(query row, head group), walking the SAME key blocks as the forward (the window's absolute
position blocks, then the row's entries):

    delta = rowsum(dO * O)                       per (row, head)
    p     = 2^(s * scale * log2 e - lse2)         keys outside the window / list: p = 0
    ds    = p * (dO . k - delta)                  (K = V: dp reads the key row itself)
    dq   += ds @ k                               in registers, stored once (times scale)
    dkv  += scale * ds^T @ q + p^T @ dO          atomically into an fp32 [S, D] buffer at the
                                                 key's store address (the single MQA head is
                                                 shared by every head and every later row)
    dsink = -sum_rows p_sink * delta              per-row terms stored, summed after the kernel

Gradients are correct, not invariant (the atomics' order is free): the backward is no part of
the canonical order, so tiles and warps are tuned freely (BWD_* knobs).
"""
import torch
import triton
import triton.language as tl

from . import interpreting
from .compressed_attention import block_dot, key_address

_LOG2E = 1.4426950408889634
# Launch knobs, free (not timed on a GPU yet). Compiled for sm_90 at V4-Flash widths (D = 512, bf16):
# 32 heads x 16 keys on 8 warps fits without spills (255 registers, 96 KiB shared) and halves the
# atomics of 16 heads per program; 64 heads needs 288 KiB of shared memory (over the H200's 228).
BWD_BLOCK_N = 16
BWD_BLOCK_H = 32
BWD_WARPS = 8


@triton.jit
def _fold_grad(q, do, lse, delta, kv_ptr, dkv_ptr, addr, ok, row_ok, offs_d, d_ok, dq, qk_scale, sm_scale,
               D: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr):
    """One key block: dq accumulated, the block's dkv added atomically at its addresses."""
    k = tl.load(kv_ptr + addr[:, None] * D + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
    s = block_dot(q, tl.trans(k), INTERP, PREC) * qk_scale
    p = tl.where(row_ok[:, None] & ok[None, :], tl.exp2(s - lse[:, None]), 0.0)
    dp = block_dot(do, tl.trans(k), INTERP, PREC)
    ds = p * (dp - delta[:, None])
    dq = dq + block_dot(ds.to(k.dtype), k, INTERP, PREC)
    dk = block_dot(tl.trans(ds * sm_scale).to(q.dtype), q, INTERP, PREC)
    dk = dk + block_dot(tl.trans(p).to(do.dtype), do, INTERP, PREC)
    # relaxed: a pure reduction (nothing reads dkv before the kernel ends), so no fences
    tl.atomic_add(dkv_ptr + addr[:, None] * D + offs_d[None, :], dk, mask=ok[:, None] & d_ok[None, :], sem="relaxed")
    return dq


@triton.jit
def _sink_rows_bwd_kernel(q_ptr, kv_ptr, ent_ptr, sel_ptr, sink_ptr, o_ptr, do_ptr, lse_ptr, dq_ptr, dkv_ptr,
                          dent_ptr, dsink_ptr, pos_ptr, start_ptr, seq_ptr, bt_ptr, bt_stride, page_size, H,
                          n_sel, qk_scale, sm_scale, window, rate,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                          PAGED: tl.constexpr, MODE: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr):
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
    hd = h[:, None] * D + offs_d[None, :]
    hd_ok = h_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + row + hd, mask=hd_ok, other=0.0)
    do = tl.load(do_ptr + row + hd, mask=hd_ok, other=0.0)
    o = tl.load(o_ptr + row + hd, mask=hd_ok, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    lse = tl.load(lse_ptr + i.to(tl.int64) * H + h, mask=h_ok, other=0.0)
    sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
    p_sink = tl.exp2(sink * 1.4426950408889634 - lse)
    tl.store(dsink_ptr + i.to(tl.int64) * H + h, -p_sink * delta, mask=h_ok)
    dq = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    lo = tl.maximum(t - window + 1, 0)
    for j0 in range((lo // BLOCK_N) * BLOCK_N, t + 1, BLOCK_N):
        j = j0 + offs_n
        ok = (j >= lo) & (j <= t)
        addr = key_address(tl.where(ok, j, 0), start, bt_row, page_size, PAGED)
        dq = _fold_grad(q, do, lse, delta, kv_ptr, dkv_ptr, addr, ok, h_ok, offs_d, d_ok, dq, qk_scale, sm_scale,
                        D, INTERP, PREC)
    if MODE == 1:  # HCA: every complete window
        n_ent = (t + 1) // rate
        for c0 in range(0, n_ent, BLOCK_N):
            c = c0 + offs_n
            ok = c < n_ent
            addr = key_address(tl.where(ok, (c + 1) * rate - 1, 0), start, bt_row, page_size, PAGED)
            dq = _fold_grad(q, do, lse, delta, ent_ptr, dent_ptr, addr, ok, h_ok, offs_d, d_ok, dq, qk_scale,
                            sm_scale, D, INTERP, PREC)
    if MODE == 2:  # CSA: the row's selected entries (ascending, -1 padded): walk the listed prefix only
        sel_row = sel_ptr + i.to(tl.int64) * n_sel
        n_ent = tl.zeros((), tl.int32)
        for p0 in range(0, n_sel, BLOCK_N):
            idx = tl.load(sel_row + p0 + offs_n, mask=p0 + offs_n < n_sel, other=-1)
            n_ent += tl.sum((idx >= 0).to(tl.int32), axis=0)
        for p0 in range(0, n_ent, BLOCK_N):
            idx = tl.load(sel_row + p0 + offs_n, mask=p0 + offs_n < n_ent, other=-1)
            ok = idx >= 0
            addr = key_address(tl.where(ok, (idx + 1) * rate - 1, 0), start, bt_row, page_size, PAGED)
            dq = _fold_grad(q, do, lse, delta, ent_ptr, dent_ptr, addr, ok, h_ok, offs_d, d_ok, dq, qk_scale,
                            sm_scale, D, INTERP, PREC)
    tl.store(dq_ptr + row + hd, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=hd_ok)


def sink_attention_rows_backward(g, q, qpos, kv, entries, selected, sinks, rows, scale, window, rate, out, lse):
    """(dq, dkv, dentries or None, dsinks) of ``sink_attention_rows`` from its output ``out`` and the
    base-2 logsumexp ``lse`` [T, H] its forward stored. Inputs contiguous."""
    T, H, D = q.shape
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    dent = torch.zeros(entries.shape, dtype=torch.float32, device=q.device) if entries is not None else None
    if T == 0:
        return dq, dkv.to(kv.dtype), None if dent is None else dent.to(entries.dtype), torch.zeros_like(sinks)
    dsink_rows = torch.empty((T, H), dtype=torch.float32, device=q.device)
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
    kw = {} if interp else dict(num_warps=BWD_WARPS, num_stages=1)
    prec = "ieee" if (q.dtype == torch.float32 or interp) else "tf32"
    _sink_rows_bwd_kernel[(T, triton.cdiv(H, BWD_BLOCK_H))](
        q, kv, ent, sel, sinks.float().contiguous(), out, g.contiguous(), lse, dq, dkv,
        dent if dent is not None else dkv, dsink_rows, qpos, start, seq, bt, bt_stride, page, H, n_sel,
        float(scale) * _LOG2E, float(scale), int(window), int(rate), D=D, BLOCK_D=triton.next_power_of_2(D),
        BLOCK_H=BWD_BLOCK_H, BLOCK_N=BWD_BLOCK_N, PAGED=rows.paged_mode, MODE=mode, INTERP=interp, PREC=prec, **kw)
    dsink = dsink_rows.sum(0).to(sinks.dtype)
    return dq, dkv.to(kv.dtype), None if dent is None else dent.to(entries.dtype), dsink

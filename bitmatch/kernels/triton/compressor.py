"""compress_windows and compress_rows on the Triton backend: one launch each, one program per
(window or row, channel block).

Canonical order (this backend's bits; kernels/compressor.py has the reference's): over the
window's S = m (HCA) or 2m (CSA: the previous window's first-half channels in slots 0..m-1,
absent for window 0, then this window's second half) slots of one channel,
z = fp32(gate) + bias (absent slots -inf); p = exp(z - max_slots z) / fold(exp) rounded to the
dtype (``tl.exp``; IEEE division); entry = round_dtype(fold(fp32(kv) * p)). ``fold`` adds halves
(slot j + slot j + S'/2 over the slots padded with zeros to S' = next power of 2, until one is
left, then + 0.0): the order of ``_exact.tree_sum``, so an entry's bits depend on its window's
rows alone, whatever the number of windows in the call. Fused multiply-add is off (each product
is rounded before the fold adds it); the interpreter rounds to bf16 on the bits (``round_to``).

compress_rows reads each row's window straight from a per-token store through its KeyRows
addressing (packed rows or the engine's block table) instead of from gathered copies: the same
``_pool`` on the same values, so the bits are compress_windows' of the gathered windows.
"""
import torch
import triton
import triton.language as tl

from . import interpreting
from ._jit import round_to


@triton.jit
def _fold(x, SP: tl.constexpr, BD: tl.constexpr, LOG2: tl.constexpr):
    """[SP, BD] -> [BD]: slot halves added level by level (slot j + slot j + half), + 0.0."""
    for i in tl.static_range(LOG2):
        a, b = tl.split(tl.permute(tl.reshape(x, (2, SP >> (i + 1), BD)), (1, 2, 0)))
        x = a + b
    return tl.reshape(x, (BD,)) + 0.0


@triton.jit
def _pool(kv, g, bias, valid, dt: tl.constexpr, SP: tl.constexpr, LOG2: tl.constexpr, BD: tl.constexpr,
          BF16: tl.constexpr, INTERP: tl.constexpr):
    """[SP, BD] slots of one window (fp32 kv and gate, the bias, the slots present) -> [BD] fp32,
    rounded to dt."""
    z = tl.where(valid[:, None], g + bias, -float("inf"))
    e = tl.where(valid[:, None], tl.exp(z - tl.max(z, 0)[None, :]), 0.0)
    p = round_to(tl.math.div_rn(e, _fold(e, SP, BD, LOG2)[None, :]), dt, BF16, INTERP)
    return round_to(_fold(kv * p, SP, BD, LOG2), dt, BF16, INTERP)


@triton.jit
def _compress_kernel(kv_ptr, gate_ptr, bias_ptr, pkv_ptr, pgate_ptr, has_ptr, out_ptr, M, C, D,
                     OVERLAP: tl.constexpr, SP: tl.constexpr, LOG2: tl.constexpr, BD: tl.constexpr,
                     BF16: tl.constexpr, INTERP: tl.constexpr):
    w = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    md = d < D
    s = tl.arange(0, SP)
    dt = out_ptr.dtype.element_ty
    if OVERLAP:
        prev = s < M
        cur = (s >= M) & (s < 2 * M)
        r = tl.where(prev, s, s - M)                      # the slot's row in its window
        valid = cur | (prev & (tl.load(has_ptr + w) != 0))
        mp = prev[:, None] & md[None, :]
        mc = cur[:, None] & md[None, :]
        at_p = (w * M + r)[:, None] * D + d[None, :]
        at_c = (w * M + r)[:, None] * C + D + d[None, :]
        kv = tl.where(prev[:, None], tl.load(pkv_ptr + at_p, mask=mp, other=0.0),
                      tl.load(kv_ptr + at_c, mask=mc, other=0.0)).to(tl.float32)
        g = tl.where(prev[:, None], tl.load(pgate_ptr + at_p, mask=mp, other=0.0),
                     tl.load(gate_ptr + at_c, mask=mc, other=0.0)).to(tl.float32)
        col = tl.where(prev[:, None], d[None, :], D + d[None, :])
        bias = tl.load(bias_ptr + r[:, None] * C + col, mask=mp | mc, other=0.0)
    else:
        valid = s < M
        m2 = valid[:, None] & md[None, :]
        at = (w * M + s)[:, None] * C + d[None, :]
        kv = tl.load(kv_ptr + at, mask=m2, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + at, mask=m2, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + s[:, None] * C + d[None, :], mask=m2, other=0.0)
    out = _pool(kv, g, bias, valid, dt, SP, LOG2, BD, BF16, INTERP)
    tl.store(out_ptr + w * D + d, out.to(dt), mask=md)


@triton.jit
def _rows_kernel(kv_ptr, gate_ptr, bias_ptr, pos_ptr, start_ptr, seq_ptr, bt_ptr, out_ptr, M, C, D,
                 stride_s, stride_bt, NB, BS,
                 OVERLAP: tl.constexpr, PAGED: tl.constexpr, SP: tl.constexpr, LOG2: tl.constexpr,
                 BD: tl.constexpr, BF16: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    md = d < D
    s = tl.arange(0, SP)
    dt = out_ptr.dtype.element_ty
    p = tl.load(pos_ptr + t).to(tl.int64)
    if OVERLAP:
        prev = s < M
        cur = (s >= M) & (s < 2 * M)
        r = tl.where(prev, s, s - M)
        valid = cur | (prev & (p >= M))
        at_pos = p - M + 1 + r - tl.where(prev, M, 0)     # the previous window sits m positions back
        col = tl.where(prev[:, None], d[None, :], D + d[None, :])
    else:
        r = s
        valid = s < M
        at_pos = p - M + 1 + s
        col = d[None, :] + s[:, None] * 0
    at_pos = tl.maximum(at_pos, 0)
    if PAGED:  # KeyRows.slots: block_table[seq, min(pos // bs, nb - 1)] * bs + pos % bs
        seq = tl.load(seq_ptr + t).to(tl.int64)
        blk = tl.load(bt_ptr + seq * stride_bt + tl.minimum(at_pos // BS, NB - 1)).to(tl.int64)
        slot = blk * BS + at_pos % BS
    else:
        slot = tl.load(start_ptr + t) + at_pos
    present = ((s < 2 * M) if OVERLAP else (s < M))[:, None] & md[None, :]
    at = slot[:, None] * stride_s + col
    kv = tl.load(kv_ptr + at, mask=present, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + at, mask=present, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + r[:, None] * C + col, mask=present, other=0.0)
    out = _pool(kv, g, bias, valid, dt, SP, LOG2, BD, BF16, INTERP)
    tl.store(out_ptr + t * D + d, out.to(dt), mask=md)


def _setup(like, n, C, rate, overlap):
    """(out [n, D] in like's dtype, D, SP, BD, interp, launch kwargs) of one pooling launch: the
    slots padded to a power of 2, channel blocks of <= 4096 / SP tile elements."""
    D = C // 2 if overlap else C
    out = torch.empty((n, D), device=like.device, dtype=like.dtype)
    sp = triton.next_power_of_2(2 * rate if overlap else rate)
    interp = interpreting(like)
    kw = {} if interp else dict(num_warps=4, enable_fp_fusion=False)
    return out, D, sp, max(16, min(triton.next_power_of_2(D), 4096 // sp)), interp, kw


def compress_windows(kv, gate, bias, prev_kv, prev_gate, has_prev):
    """kv, gate [W, m, C], bias fp32 [m, C], CSA's prev_kv / prev_gate [W, m, C/2] and has_prev
    bool [W] (or all None: HCA), contiguous -> [W, D] in kv's dtype."""
    W, m, C = kv.shape
    overlap = prev_kv is not None
    out, D, sp, bd, interp, kw = _setup(kv, W, C, m, overlap)
    if W == 0 or D == 0:
        return out
    none = kv  # an unused pointer (HCA)
    _compress_kernel[(W, triton.cdiv(D, bd))](
        kv, gate, bias, prev_kv if overlap else none, prev_gate if overlap else none,
        has_prev if overlap else none, out, m, C, D,
        OVERLAP=overlap, SP=sp, LOG2=sp.bit_length() - 1, BD=bd, BF16=kv.dtype == torch.bfloat16,
        INTERP=interp, **kw)
    return out


def compress_rows(raw_kv, raw_gate, bias, positions, rows, rate, overlap):
    """raw_kv, raw_gate [S, C] (rows contiguous; C = 2D with ``overlap``), bias fp32 [m, C],
    positions [T], rows: KeyRows of the T rows -> [T, D] in raw_kv's dtype."""
    T = positions.shape[0]
    out, D, sp, bd, interp, kw = _setup(raw_kv, T, raw_kv.shape[1], rate, overlap)
    if T == 0 or D == 0:
        return out
    paged = rows.paged_mode
    bt = rows.block_table if paged else positions
    _rows_kernel[(T, triton.cdiv(D, bd))](
        raw_kv, raw_gate, bias, positions, positions if paged else rows.row_start,
        rows.seq_idx if paged else positions, bt, out, rate, raw_kv.shape[1], D, raw_kv.stride(0),
        bt.stride(0) if paged else 0, bt.shape[1] if paged else 1, rows.block_size if paged else 1,
        OVERLAP=overlap, PAGED=paged, SP=sp, LOG2=sp.bit_length() - 1, BD=bd,
        BF16=raw_kv.dtype == torch.bfloat16, INTERP=interp, **kw)
    return out

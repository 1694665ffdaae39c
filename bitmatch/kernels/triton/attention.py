"""Attention forward: packed varlen prefill and paged (chunked prefill / decode), one kernel.

Canonical order for query row (token t of sequence b, head h), independent of schedule:
  keys are walked from position 0 in KV blocks of kv_block (=64) positions; an online softmax
  (base-2, fp32) runs inside each KV partition of kv_partition (=512) positions starting from
  the empty state; partition states (m, l, acc) are merged in partition order into the empty
  state; out = acc / l. Fully masked blocks and partitions are exact no-ops (the -inf-safe
  update keeps the state bit-identical), so a program may skip them.
Prefill (contiguous K/V) and paged (K/V gathered through the block table at any page size)
use the same kernel, so their bits agree; the query tile (how many tokens x GQA heads share a
program) and whether partitions run in one program ("fused") or on separate programs merged by
_merge_kernel ("split", for decode / small batches) do not change the bits. The row sum l of P
is part of the order: it is taken on the tensor core (rowsum_mma: P rounded to the input dtype
times a ones column, the MMA's k-order, which mma.sync (< 64-row tiles) and wgmma share), so
16-row decode tiles give prefill's bits (the GPU harness checks it on every axis). With a register
tl.sum instead (rowsum_mma = False) the sum order follows the MMA's accumulator layout, which
differs between 16/32-row tiles (mma.sync) and 64-row ones (wgmma), so then every CUDA tile must
have >= 64 rows (min_block_m_cuda = 64), which makes decode slower.
kv_block, kv_partition and rowsum_mma are fields of the canonical order (kernels/order.py),
read from ``order.current()`` at every launch: ``order.override`` changes them and the stamp.
GQA: a program's rows are (token, head-in-group) pairs of one KV head, so K/V is read once per
group. Non-causal attention is only for prefill (causal=False), where every row sees the whole
sequence.
"""
import torch
import triton
import triton.language as tl

from .. import order
from . import interpreting, sm_count
from ._jit import dot
from .attention_bwd import attention_prefill_backward_any

_LOG2E = 1.4426950408889634


@triton.jit
def _merge(M, L, A, m, l, a):
    """Merge partition state (m, l, a) into the running state (M, L, A); exact no-op if empty."""
    M_new = tl.maximum(M, m)
    Ms = tl.where(M_new == float("-inf"), 0.0, M_new)
    e1 = tl.exp2(M - Ms)
    e2 = tl.exp2(m - Ms)
    A = tl.fma(A, e1[:, None], a * e2[:, None])
    L = tl.fma(L, e1, l * e2)
    return M_new, L, A


@triton.jit
def _finalize(L, A):
    Ls = tl.where(L == 0.0, 1.0, L)
    return tl.math.div_rn(A, Ls[:, None])


@triton.jit
def _store_lse(lse_ptr, q_rows, row_ok, M, L):
    # base-2 logsumexp of the scaled scores, for the backward (not part of the output's bits)
    tl.store(lse_ptr + q_rows, M + tl.log2(tl.where(L == 0.0, 1.0, L)), mask=row_ok)


@triton.jit
def _mask_scores(s, j, jok, row_ok, pos, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    vis = jok[None, :] & row_ok[:, None]
    if CAUSAL:
        vis = vis & (j[None, :] <= pos[:, None])
    if HAS_WINDOW:
        vis = vis & (j[None, :] > pos[:, None] - window)
    return tl.where(vis, s, float("-inf"))


@triton.jit
def _partition(q, k_ptr, v_ptr, bt_row_ptr, page_size, kv_row0, kvh, stride_blk, stride_tok,
               stride_head,
               pos, row_ok, kv_len, j_begin, j_end, qk_scale, window, pos_lo, pos_hi,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               PART: tl.constexpr, PAGED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               INTERP: tl.constexpr, PREC: tl.constexpr, ROWSUM_MMA: tl.constexpr,
               SKIP_MASKS: tl.constexpr):
    """Online softmax over KV blocks [j_begin, j_end) (block aligned) from the empty state.
    pos_lo / pos_hi: positions of the tile's first and last query token (SKIP_MASKS only)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    if PAGED:
        # the partition's slot offsets, one block-table read before the walk: inside the loop a
        # K/V address that depends on a load made Triton's pipeliner keep one K/V buffer and
        # issue block i+1 only after block i was consumed (no overlap); computed from registers
        # (a select over the partition's NB blocks), the loads are pipelined num_stages deep
        NB: tl.constexpr = PART // BLOCK_N
        blk = tl.arange(0, NB)
        jj = j_begin + blk[:, None] * BLOCK_N + offs_n[None, :]
        pages = tl.load(bt_row_ptr + jj // page_size, mask=jj < kv_len, other=0)
    for j0 in range(j_begin, j_end, BLOCK_N):
        j = j0 + offs_n
        jok = j < kv_len
        if PAGED:
            i = (j0 - j_begin) // BLOCK_N
            page = tl.sum(tl.where(blk[:, None] == i, pages, 0), axis=0).to(tl.int64)
            # strides applied after the select: their divisibility (specialized at launch) is
            # what lets the K/V loads be 16-byte vectors
            base = page * stride_blk + (j % page_size) * stride_tok + kvh * stride_head
        else:
            base = (kv_row0 + j).to(tl.int64) * stride_tok + kvh * stride_head
        kt = tl.load(k_ptr + base[None, :] + offs_d[:, None], mask=jok[None, :], other=0.0)
        s = dot(q, kt, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), INTERP, PREC)
        s = s * qk_scale
        if SKIP_MASKS:
            # a block every valid row sees whole (below the diagonal, inside the window, before
            # the end) needs no mask: for those rows the select is the identity, so the bits
            # are the same; rows past the tile's end / G (q = 0) are never stored
            full = j0 + BLOCK_N <= kv_len
            if CAUSAL:
                full = full & (j0 + BLOCK_N - 1 <= pos_lo)
            if HAS_WINDOW:
                full = full & (j0 > pos_hi - window)
            if not full:
                s = _mask_scores(s, j, jok, row_ok, pos, window, CAUSAL, HAS_WINDOW)
        else:
            s = _mask_scores(s, j, jok, row_ok, pos, window, CAUSAL, HAS_WINDOW)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        ms = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - ms)
        p = tl.exp2(s - ms[:, None])
        if not ROWSUM_MMA:
            l = tl.fma(l, alpha, tl.sum(p, axis=1))
        v = tl.load(v_ptr + base[:, None] + offs_d[None, :], mask=jok[:, None], other=0.0)
        if ROWSUM_MMA:
            # row sum of the (rounded) P through the tensor core: its k-order is the MMA's, not
            # the register layout's, so 16-row (mma.sync) and 64/128-row (wgmma) tiles agree;
            # the sum over the 16 output columns adds 15 exact zeros
            sel = (tl.arange(0, BLOCK_N)[:, None] >= 0) & (tl.arange(0, 16)[None, :] == 0)
            ones = tl.where(sel, 1.0, 0.0).to(v.dtype)
            rs = dot(p.to(v.dtype), ones, tl.zeros((BLOCK_M, 16), tl.float32), INTERP, PREC)
            l = tl.fma(l, alpha, tl.sum(rs, axis=1))
        acc = acc * alpha[:, None]
        acc = dot(p.to(v.dtype), v, acc, INTERP, PREC)
        m = m_new
    return m, l, acc


@triton.jit
def _tile_info(qstart_ptr, seqlens_ptr, b, tile, PAGED: tl.constexpr, CAUSAL: tl.constexpr,
               HAS_WINDOW: tl.constexpr, window, TPT: tl.constexpr, BLOCK_N: tl.constexpr,
               PART: tl.constexpr):
    q0 = tl.load(qstart_ptr + b)
    nq = tl.load(qstart_ptr + b + 1) - q0
    if PAGED:
        kv_len = tl.load(seqlens_ptr + b)
    else:
        kv_len = nq
    t_lo = tile * TPT
    t_hi = tl.minimum(nq, t_lo + TPT)
    if CAUSAL:
        kv_end = kv_len - nq + t_hi
    else:
        kv_end = kv_len
    kv_begin = 0
    if HAS_WINDOW:
        kv_begin = tl.maximum(0, kv_len - nq + t_lo - window + 1)
    kv_begin = (kv_begin // BLOCK_N) * BLOCK_N
    return q0, nq, kv_len, t_lo, kv_begin, kv_end


@triton.jit
def _attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, wsa_ptr, wsm_ptr, wsl_ptr, lse_ptr,
                 qstart_ptr, seqlens_ptr, bt_ptr, bt_stride, page_size,
                 stride_blk, stride_tok, stride_head, qk_scale, window, Hq, Hkv, G, NP,
                 D: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, PART: tl.constexpr, PAGED: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
                 INTERP: tl.constexpr, PREC: tl.constexpr, ROWSUM_MMA: tl.constexpr,
                 STORE_LSE: tl.constexpr, SKIP_MASKS: tl.constexpr):
    TPT: tl.constexpr = BLOCK_M // GP
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    kvh = bh % Hkv
    q0, nq, kv_len, t_lo, kv_begin, kv_end = _tile_info(
        qstart_ptr, seqlens_ptr, b, tile, PAGED, CAUSAL, HAS_WINDOW, window, TPT, BLOCK_N, PART)
    if t_lo >= nq:
        return
    if SPLIT:
        # a partition outside [kv_begin, kv_end) is one _merge_kernel never reads: leave at once
        # (a decode graph captured for a long context launches many of them)
        if tl.program_id(2) * PART >= kv_end:
            return
        if (tl.program_id(2) + 1) * PART <= kv_begin:
            return
    r = tl.arange(0, BLOCK_M)
    tok = t_lo + r // GP
    g = r % GP
    row_ok = (tok < nq) & (g < G)
    pos = kv_len - nq + tok
    pos_lo = kv_len - nq + t_lo
    pos_hi = kv_len - nq + tl.minimum(nq, t_lo + TPT) - 1
    offs_d = tl.arange(0, D)
    q_rows = (q0 + tok).to(tl.int64) * Hq + kvh * G + g
    q = tl.load(q_ptr + q_rows[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    bt_row_ptr = bt_ptr + b.to(tl.int64) * bt_stride
    if PAGED:
        kv_row0 = 0
    else:
        kv_row0 = q0
    if SPLIT:
        p = tl.program_id(2)
        jb = tl.maximum(p * PART, kv_begin)
        je = tl.minimum((p + 1) * PART, kv_end)
        m, l, acc = _partition(q, k_ptr, v_ptr, bt_row_ptr, page_size, kv_row0, kvh, stride_blk,
                               stride_tok, stride_head,
                               pos, row_ok, kv_len, jb, je, qk_scale, window, pos_lo, pos_hi,
                               D, BLOCK_M, BLOCK_N, PART, PAGED, CAUSAL, HAS_WINDOW, INTERP,
                               PREC, ROWSUM_MMA, SKIP_MASKS)
        widx = ((tile * tl.num_programs(1) + bh) * NP + p).to(tl.int64) * BLOCK_M + r
        tl.store(wsm_ptr + widx, m)
        tl.store(wsl_ptr + widx, l)
        tl.store(wsa_ptr + widx[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None])
    else:
        M = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        L = tl.zeros((BLOCK_M,), tl.float32)
        A = tl.zeros((BLOCK_M, D), tl.float32)
        for p in range(kv_begin // PART, tl.cdiv(kv_end, PART)):
            jb = tl.maximum(p * PART, kv_begin)
            je = tl.minimum((p + 1) * PART, kv_end)
            m, l, acc = _partition(q, k_ptr, v_ptr, bt_row_ptr, page_size, kv_row0, kvh,
                                   stride_blk, stride_tok, stride_head, pos, row_ok, kv_len,
                                   jb, je, qk_scale, window,
                                   pos_lo, pos_hi, D, BLOCK_M, BLOCK_N, PART, PAGED, CAUSAL, HAS_WINDOW,
                                   INTERP, PREC, ROWSUM_MMA, SKIP_MASKS)
            M, L, A = _merge(M, L, A, m, l, acc)
        out = _finalize(L, A)
        tl.store(o_ptr + q_rows[:, None] * D + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
        if STORE_LSE:
            _store_lse(lse_ptr, q_rows, row_ok, M, L)


@triton.jit
def _load_state(wsa_ptr, wsm_ptr, wsl_ptr, part_row, r, row_ok, ok, D: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """One partition's (m, l, acc) from the split workspace (ok False: nothing is read)."""
    widx = part_row.to(tl.int64) * BLOCK_M + r
    m = tl.load(wsm_ptr + widx, mask=ok, other=float("-inf"))
    l = tl.load(wsl_ptr + widx, mask=ok, other=0.0)
    a = tl.load(wsa_ptr + widx[:, None] * D + tl.arange(0, D)[None, :],
                mask=row_ok[:, None] & ok, other=0.0)
    return m, l, a


@triton.jit
def _merge_kernel(o_ptr, wsa_ptr, wsm_ptr, wsl_ptr, lse_ptr, qstart_ptr, seqlens_ptr, window, Hq, Hkv,
                  G, NP, D: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, PART: tl.constexpr, PAGED: tl.constexpr,
                  CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, STORE_LSE: tl.constexpr):
    TPT: tl.constexpr = BLOCK_M // GP
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    kvh = bh % Hkv
    q0, nq, kv_len, t_lo, kv_begin, kv_end = _tile_info(
        qstart_ptr, seqlens_ptr, b, tile, PAGED, CAUSAL, HAS_WINDOW, window, TPT, BLOCK_N, PART)
    if t_lo >= nq:
        return
    r = tl.arange(0, BLOCK_M)
    tok = t_lo + r // GP
    g = r % GP
    row_ok = (tok < nq) & (g < G)
    offs_d = tl.arange(0, D)
    M = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    L = tl.zeros((BLOCK_M,), tl.float32)
    A = tl.zeros((BLOCK_M, D), tl.float32)
    p_end = tl.cdiv(kv_end, PART)
    row0 = (tile * tl.num_programs(1) + bh) * NP
    for p in range(kv_begin // PART, p_end, 2):
        # two partitions' states are loaded before either is merged (their L2 round trips
        # overlap); the merges stay one at a time, in partition order
        m, l, a = _load_state(wsa_ptr, wsm_ptr, wsl_ptr, row0 + p, r, row_ok, True, D, BLOCK_M)
        m2, l2, a2 = _load_state(wsa_ptr, wsm_ptr, wsl_ptr, row0 + p + 1, r, row_ok,
                                 p + 1 < p_end, D, BLOCK_M)
        M, L, A = _merge(M, L, A, m, l, a)
        if p + 1 < p_end:
            M, L, A = _merge(M, L, A, m2, l2, a2)
    out = _finalize(L, A)
    q_rows = (q0 + tok).to(tl.int64) * Hq + kvh * G + g
    tl.store(o_ptr + q_rows[:, None] * D + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    if STORE_LSE:
        _store_lse(lse_ptr, q_rows, row_ok, M, L)


# Launch-shape knobs (free: they do not change the bits). Tuning rule: pick them per GPU by time
# alone; the harness (benchmarks/ops/gpu_ops.py) must still report 0 mismatching rows on every axis.
# Not a knob: the canonical order's rowsum_mma. True = row sums of P on the tensor core, so decode
# may use 16-row tiles (the faster decode); False = register row sums, >= 64-row tiles
# everywhere. Flipping it changes the bits of every attention output: kernels/order.py. Both
# orders' timings: docs/results.md.
PREFILL_BLOCK_M = 128
PREFILL_WARPS = 8
PREFILL_STAGES = 3
DECODE_WARPS = 4
DECODE_STAGES = 3
DECODE_SPLIT_MAX_PROGRAMS = None
# Launch knob: skip the mask select on KV blocks that every valid row of the tile sees whole
# (same bits by construction: the select would keep every score; interpreter tests check it). It
# wins back the prefill time the tensor-core row sums cost.
SKIP_FULL_BLOCK_MASKS = True


def _kv_strides(k, v, paged):
    """(block, token, head) element strides of K/V, shared by both: a paged cache may be a
    strided view (e.g. K and V interleaved per slot inside one tensor); addresses only, so the
    bits do not depend on the layout."""
    op = "attention_paged" if paged else "attention_prefill"
    if k.stride() != v.stride() or k.stride(-1) != 1:
        raise ValueError(f"bitmatch.kernels.{op}: K and V must share strides with a contiguous "
                         f"head_dim; got {k.stride()} and {v.stride()}")
    if paged:
        return k.stride(0), k.stride(1), k.stride(2)
    return 0, k.stride(0), k.stride(1)


def _run(q, k, v, qstart, seqlens, block_table, page_size, scale, causal, window, max_nq,
         max_kv, paged, force_mode=None, block_m=None, return_lse=False, launch=None):
    T, Hq, D = q.shape
    Hkv = k.shape[-2]
    G = Hq // Hkv
    GP = triton.next_power_of_2(G)
    B = qstart.numel() - 1
    out = torch.empty_like(q)
    lse = torch.empty((T, Hq), device=q.device, dtype=torch.float32) if return_lse else out
    if T == 0 or B == 0:
        return (out, lse) if return_lse else out
    interp = interpreting(q)
    o = order.current()
    min_block_m = 16 if interp else o.min_block_m_cuda
    if block_m is None:
        if paged and max_nq * GP <= 64:
            block_m = max(min_block_m,
                          triton.next_power_of_2(max_nq * GP))
        else:
            block_m = max(PREFILL_BLOCK_M, GP) if not interp else max(16, min(64, GP * 8))
    # On the GPU, query tiles below 64 rows compile to mma.sync (mma v2) instead of wgmma; with
    # register row sums (rowsum_mma False) their accumulator layout sums a row of P in another
    # order (some rows 1 ulp off), so then every CUDA launch uses >= 64-row tiles.
    # (The interpreter has no such split.)
    block_m = max(block_m, GP, min_block_m)
    tpt = block_m // GP
    n_tiles = triton.cdiv(max_nq, tpt)
    NP = max(1, triton.cdiv(max_kv, o.kv_partition))
    programs = n_tiles * B * Hkv
    if force_mode is not None:
        split = force_mode == "split"
    else:
        # decode-size tiles: split partitions over programs (unless the batch alone fills the
        # GPU many times over: DECODE_SPLIT_MAX_PROGRAMS); prefill tiles: only when too few
        # programs fill the GPU. Either way the same bits (partition merge order is fixed).
        small_split = block_m <= 64 and (DECODE_SPLIT_MAX_PROGRAMS is None
                                         or programs < DECODE_SPLIT_MAX_PROGRAMS)
        split = NP > 1 and (small_split or programs < 2 * sm_count(q.device))
    prec = "ieee" if (q.dtype == torch.float32 or interp) else "tf32"
    has_window = window is not None and window > 0
    qk_scale = float(scale) * _LOG2E
    if block_table is None:
        block_table = qstart  # unused
        bt_stride = 0
    else:
        bt_stride = block_table.stride(0)
    kv_strides = _kv_strides(k, v, paged)
    small = block_m <= 64
    # enable_fp_fusion=False: no compiler-chosen mul+add -> fma contraction, so the softmax
    # arithmetic is the same in every kernel variant (explicit tl.fma where wanted)
    kw = {} if interp else dict(num_warps=DECODE_WARPS if small else PREFILL_WARPS,
                                num_stages=DECODE_STAGES if small else PREFILL_STAGES,
                                enable_fp_fusion=False)
    if launch and not interp:
        kw.update(launch)
    common = dict(D=D, GP=GP, BLOCK_M=block_m, BLOCK_N=o.kv_block, PART=o.kv_partition, PAGED=paged,
                  CAUSAL=causal, HAS_WINDOW=has_window)
    win = int(window) if has_window else 0
    if split:
        rows = n_tiles * B * Hkv * NP * block_m
        wsa = torch.empty((rows, D), device=q.device, dtype=torch.float32)
        wsm = torch.empty((rows,), device=q.device, dtype=torch.float32)
        wsl = torch.empty((rows,), device=q.device, dtype=torch.float32)
        _attn_kernel[(n_tiles, B * Hkv, NP)](q, k, v, out, wsa, wsm, wsl, lse, qstart, seqlens,
                                             block_table, bt_stride, page_size, *kv_strides,
                                             qk_scale, win, Hq, Hkv, G, NP, SPLIT=True, INTERP=interp,
                                             PREC=prec, ROWSUM_MMA=o.rowsum_mma, STORE_LSE=False,
                                             SKIP_MASKS=SKIP_FULL_BLOCK_MASKS,
                                             **common, **kw)
        _merge_kernel[(n_tiles, B * Hkv)](out, wsa, wsm, wsl, lse, qstart, seqlens, win, Hq, Hkv,
                                          G, NP, STORE_LSE=return_lse, **common,
                                          **({} if interp else dict(num_warps=4,
                                                                    enable_fp_fusion=False)))
    else:
        _attn_kernel[(n_tiles, B * Hkv, 1)](q, k, v, out, out, out, out, lse, qstart, seqlens,
                                            block_table, bt_stride, page_size, *kv_strides,
                                            qk_scale, win, Hq, Hkv, G, NP, SPLIT=False, INTERP=interp,
                                            PREC=prec, ROWSUM_MMA=o.rowsum_mma,
                                            STORE_LSE=return_lse,
                                            SKIP_MASKS=SKIP_FULL_BLOCK_MASKS, **common, **kw)
    return (out, lse) if return_lse else out


def attention_prefill(q, k, v, cu_seqlens, scale, causal=True, sliding_window=None, *,
                      max_seqlen=None, force_mode=None, block_m=None, return_lse=False):
    """Packed varlen prefill: q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens [B+1] int32.
    return_lse: also the base-2 logsumexp [T, Hq] fp32 the backward needs (same output bits)."""
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    if max_seqlen is None:
        max_seqlen = int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0
    return _run(q, k, v, cu, cu, None, 1, scale, bool(causal), sliding_window, max_seqlen,
                max_seqlen, False, force_mode, block_m, return_lse)


class AttentionPrefillTriton(torch.autograd.Function):
    """attention_prefill with the Triton flash backward (attention_bwd)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale, causal, window, max_seqlen):
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
        if max_seqlen is None:
            max_seqlen = int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0
        out, lse = attention_prefill(q, k, v, cu, scale, causal, window, max_seqlen=max_seqlen,
                                     return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse, cu)
        ctx.args = (scale, causal, window, max_seqlen)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse, cu = ctx.saved_tensors
        scale, causal, window, max_seqlen = ctx.args
        dq, dk, dv = attention_prefill_backward_any(g, q, k, v, out, lse, cu, scale, causal, window,
                                                    max_seqlen=max_seqlen)
        return dq, dk, dv, None, None, None, None, None


def attention_prefill_autograd(q, k, v, cu_seqlens, scale, causal=True, sliding_window=None, *,
                               max_seqlen=None):
    """attention_prefill (same output bits) differentiable through the Triton backward: what the
    public ``bitmatch.kernels.attention_prefill`` runs on CUDA (max_seqlen None: one host sync)."""
    return AttentionPrefillTriton.apply(q, k, v, cu_seqlens, scale, causal, sliding_window,
                                        max_seqlen)


def attention_paged(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale,
                    sliding_window=None, *, max_query_len=None, max_seq_len=None,
                    force_mode=None, block_m=None, launch=None):
    """Paged causal attention: q [T, Hq, D]; caches [num_blocks, page_size, Hkv, D].
    force_mode / block_m / launch ({num_warps, num_stages}): launch shape, never the bits."""
    qsl = query_start_loc.to(device=q.device, dtype=torch.int32).contiguous()
    sl = seq_lens.to(device=q.device, dtype=torch.int32).contiguous()
    bt = block_table.to(device=q.device, dtype=torch.int32).contiguous()
    if max_query_len is None or max_seq_len is None:
        stats = torch.stack([(qsl[1:] - qsl[:-1]).max(), sl.max()]).tolist()
        max_query_len, max_seq_len = int(stats[0]), int(stats[1])
    page_size = k_cache.shape[1]
    return _run(q, k_cache, v_cache, qsl, sl, bt, page_size, scale, True, sliding_window,
                max_query_len, max_seq_len, True, force_mode, block_m, launch=launch)


_QSL = {}


def _decode_qsl(B, device):
    """query_start_loc 0..B of a decode batch, cached per (B, device): one launch less per step.
    Not cached while a CUDA graph is being captured (the tensor would live in the graph's pool)."""
    key = (B, str(device))
    t = _QSL.get(key)
    if t is None:
        t = torch.arange(B + 1, device=device, dtype=torch.int32)
        if not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
            _QSL[key] = t
    return t


def attention_decode(q, k_cache, v_cache, block_table, seq_lens, scale, sliding_window=None,
                     **kw):
    """One query per sequence: q [B, Hq, D] (= attention_paged with one query each)."""
    B = q.shape[0]
    qsl = _decode_qsl(B, q.device)
    kw.setdefault("max_query_len", 1)
    return attention_paged(q, k_cache, v_cache, block_table, qsl, seq_lens, scale,
                           sliding_window, **kw)

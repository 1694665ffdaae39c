"""Triton MoE: routing, a grouped expert GEMM and a rank-order combine (canonical orders in
kernels/moe.py).

- moe_route: one program per token (E scores in one block, block width and warps fixed by E);
  top-k by k rounds of "max, then the lowest index holding it", so ties go to the lowest index.
- moe_experts: the (token, rank) pairs are sorted by expert (torch.sort, exact); each program
  owns BM rows of ONE expert and BN output columns. Every row's dot runs through linear.py's
  chunk_acc with linear's split_for(N, K): the K order of kernels.linear, so a row's bits are
  linear's for that row whatever the tile shape or how many rows its expert got. GEMM 1 fuses
  the activation with silu_and_mul's rounding points (gate and up in two accumulators) and, for
  training, also stores the rounded pre-activations h for the backward (a runtime flag); GEMM 2
  writes y[t, r] back in token order; the combine adds w * y over ranks 0..k-1 in fp32 with
  fused multiply-add disabled (the CPU reference rounds the product, then adds).
No host synchronisation: the tile grid is sized by its upper bound cdiv(T*k, BM) + min(E, T*k)
and programs past the real tile count return at once (so the launch is CUDA-graph capturable).
The backward (kernels/triton/moe_bwd.py) reuses expert_layout and expert_tile.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import interpreting
from .linear import INTERP_BK, chunk_acc, split_for

_SCORING = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
ACT_CODE = {"swiglu": 0, "relu2": 1}


# ---------------------------------------------------------------- routing
@triton.jit
def _route_kernel(z_ptr, bias_ptr, w_ptr, ids_ptr, E, scaling, HAS_BIAS: tl.constexpr,
                  SCORING: tl.constexpr, RENORM: tl.constexpr, TOPK: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    z = tl.load(z_ptr + row * E + offs, mask=mask, other=-float("inf"))
    if SCORING == 0:
        e = tl.exp(z - tl.max(z, 0))
        sc = e / tl.sum(e, 0)
    elif SCORING == 1:
        sc = 1.0 / (1.0 + tl.exp(-z))
    else:
        y = tl.exp(tl.minimum(z, 20.0))
        u = 1.0 + y
        lp = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))  # log1p, accurate for tiny y
        sc = tl.sqrt(tl.where(z > 20.0, z, lp))                  # torch softplus threshold 20
    sel = sc
    if HAS_BIAS:
        sel = sc + tl.load(bias_ptr + offs, mask=mask, other=0.0)
    sel = tl.where(mask, sel, -float("inf"))
    offs_k = tl.arange(0, BLOCK_K)
    wv = tl.zeros((BLOCK_K,), dtype=tl.float32)
    iv = tl.zeros((BLOCK_K,), dtype=tl.int64)
    total = 0.0
    for r in tl.static_range(TOPK):
        best = tl.max(sel, 0)
        idx = tl.min(tl.where(sel == best, offs, BLOCK_E), 0)  # lowest index holding the max
        hit = offs == idx
        w = tl.sum(tl.where(hit, sc, 0.0), 0)                   # one value plus zeros: exact
        total = total + w                                        # rank-order fp32 sum
        wv = tl.where(offs_k == r, w, wv)
        iv = tl.where(offs_k == r, idx.to(tl.int64), iv)
        sel = tl.where(hit, -float("inf"), sel)
    if RENORM:
        wv = wv / (total + 1e-20)
    wv = wv * scaling
    tl.store(w_ptr + row * TOPK + offs_k, wv, mask=offs_k < TOPK)
    tl.store(ids_ptr + row * TOPK + offs_k, iv, mask=offs_k < TOPK)


def moe_route(logits, bias, top_k, scoring, renormalize, scaling):
    """logits fp32 [T, E] (contiguous) -> (weights fp32 [T, k], ids int64 [T, k])."""
    T, E = logits.shape
    w = torch.empty((T, top_k), device=logits.device, dtype=torch.float32)
    ids = torch.empty((T, top_k), device=logits.device, dtype=torch.int64)
    if T == 0:
        return w, ids
    interp = interpreting(logits)
    block_e = triton.next_power_of_2(E)
    kw = {} if interp else dict(num_warps=4 if block_e <= 1024 else 8)
    _route_kernel[(T,)](logits, bias if bias is not None else logits, w, ids, E, float(scaling),
                        HAS_BIAS=bias is not None, SCORING=_SCORING[scoring], RENORM=bool(renormalize),
                        TOPK=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), **kw)
    return w, ids


# ---------------------------------------------------------------- grouped expert GEMMs
@triton.jit
def expert_tile(tile_end_ptr, counts_ptr, row_start_ptr, E, BM: tl.constexpr, BLOCK_E: tl.constexpr):
    """The expert and sorted-row range of this program's row tile (e = E: no tile)."""
    pid = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    ends = tl.load(tile_end_ptr + offs_e, mask=offs_e < E, other=2**30)
    e = tl.sum((ends <= pid).to(tl.int32), 0)
    e_c = tl.minimum(e, E - 1)
    first_tile = tl.load(tile_end_ptr + e_c) - (tl.load(counts_ptr + e_c) + BM - 1) // BM
    row0 = tl.load(row_start_ptr + e_c)
    m0 = row0 + (pid - first_tile) * BM
    m_end = row0 + tl.load(counts_ptr + e_c)
    return e, e_c, m0, m_end


@triton.jit(do_not_specialize=["store_h"])
def _gemm_in_kernel(x_ptr, w_ptr, tok_ptr, a_ptr, h_ptr, tile_end_ptr, counts_ptr, row_start_ptr,
                    T, H, I, E, K_CHUNK, limit, store_h, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr,
                    SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr, INTERP: tl.constexpr,
                    PREC: tl.constexpr):
    e, e_c, m0, m_end = expert_tile(tile_end_ptr, counts_ptr, row_start_ptr, E, BM, BLOCK_E)
    if e >= E:
        return
    rows = m0 + tl.arange(0, BM)
    rmask = rows < m_end
    # gathered x rows; a row past the tile's end reads token T, which every load masks off
    tok = tl.where(rmask, tl.load(tok_ptr + rows, mask=rmask, other=0), T)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_in = I * (2 - ACT)
    w_e = w_ptr + e_c.to(tl.int64) * n_in * H
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for s in tl.static_range(SPLIT):  # linear's canonical order: chunk sums added in order
        acc = acc + chunk_acc(x_ptr, w_e, tok, offs_n, T, I, H, s * K_CHUNK, K_CHUNK, H, H,
                               BM, BN, BK, EVEN_K, INTERP, PREC)
    dt = a_ptr.dtype.element_ty
    omask = rmask[:, None] & (offs_n[None, :] < I)
    if ACT == 0:
        up = tl.zeros((BM, BN), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            up = up + chunk_acc(x_ptr, w_e + I * H, tok, offs_n, T, I, H, s * K_CHUNK,
                                 K_CHUNK, H, H, BM, BN, BK, EVEN_K, INTERP, PREC)
        gb = acc.to(dt)                          # linear's output rounding
        ub = up.to(dt)
        # the pre-activations for the backward; a runtime flag, not a variant: the trainer's call
        # runs the engine's binary
        if store_h != 0:
            hp = h_ptr + rows[:, None].to(tl.int64) * n_in + offs_n[None, :]
            tl.store(hp, gb, mask=omask)
            tl.store(hp + I, ub, mask=omask)
        g = gb.to(tl.float32)
        u = ub.to(tl.float32)
        if HAS_LIMIT:                            # DeepSeek-V4: clamp as torch.clamp on x.dtype
            g = tl.minimum(g, limit).to(dt).to(tl.float32)
            u = tl.minimum(tl.maximum(u, -limit), limit).to(dt).to(tl.float32)
        sl = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # silu_and_mul's formula
        a = (sl * u).to(dt)
    else:
        hb = acc.to(dt)
        if store_h != 0:
            tl.store(h_ptr + rows[:, None].to(tl.int64) * n_in + offs_n[None, :], hb, mask=omask)
        h = tl.maximum(hb.to(tl.float32), 0.0)
        a = (h * h).to(dt)                       # relu(h)^2: exact square for bf16, one rounding
    out = a_ptr + rows[:, None].to(tl.int64) * I + offs_n[None, :]
    tl.store(out, a, mask=omask)


@triton.jit
def _gemm_out_kernel(a_ptr, w_ptr, order_ptr, y_ptr, tile_end_ptr, counts_ptr, row_start_ptr,
                     H, I, E, K_CHUNK, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, BLOCK_E: tl.constexpr, EVEN_K: tl.constexpr,
                     INTERP: tl.constexpr, PREC: tl.constexpr):
    e, e_c, m0, m_end = expert_tile(tile_end_ptr, counts_ptr, row_start_ptr, E, BM, BLOCK_E)
    if e >= E:
        return
    rows = m0 + tl.arange(0, BM)
    rmask = rows < m_end
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    w_e = w_ptr + e_c.to(tl.int64) * H * I
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc = acc + chunk_acc(a_ptr, w_e, rows, offs_n, m_end, H, I, s * K_CHUNK, K_CHUNK, I, I,
                               BM, BN, BK, EVEN_K, INTERP, PREC)
    dst = tl.load(order_ptr + rows, mask=rmask, other=0)     # flat (token, rank) position
    out = y_ptr + dst[:, None].to(tl.int64) * H + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & (offs_n[None, :] < H))


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, H, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in tl.static_range(TOPK):  # rank order, from 0.0
        w = tl.load(w_ptr + t * TOPK + r)
        y = tl.load(y_ptr + (t * TOPK + r) * H + offs, mask=mask, other=0.0).to(tl.float32)
        acc = acc + w * y
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# (max average rows per expert, BM, BN_in, BN_out, BK, warps, stages): launch knobs only (tile
# shapes never change a row's bits: each expert row is one sequential K accumulation); the first
# row whose bound >= T*k/E is used. Tuning rule: the fastest variant per bucket of
# ``benchmarks/ops/moe_layer.py --variants`` at the target model's shapes, which also checks that
# every variant gives the same bits: small tiles for decode-size batches, large ones for prefill.
CONFIG_TABLE = [
    (2, 16, 64, 64, 64, 4, 4),
    (64, 64, 64, 128, 64, 4, 3),
    (1 << 62, 128, 128, 128, 64, 8, 3),
]


def config_for(rows, n_experts):
    avg = rows / max(n_experts, 1)
    for row in CONFIG_TABLE:
        if avg <= row[0]:
            return row[1:]
    return CONFIG_TABLE[-1][1:]


def _k_chunk(N, K, BK):
    split = split_for(N, K)
    k_chunk = K // split if split > 1 else triton.cdiv(K, BK) * BK
    return split, k_chunk, (K % BK == 0) and (k_chunk % BK == 0)


class Kept(NamedTuple):
    """What moe_experts(keep_h=True) keeps for the backward: the rounded pre-activations h
    [T*k, N_in] of the sorted rows, and the sort itself (order, tok, counts, row_start: none of
    them depends on a tile size), so the backward neither recomputes x W_in nor sorts again."""
    h: torch.Tensor
    order: torch.Tensor
    tok: torch.Tensor
    counts: torch.Tensor
    row_start: torch.Tensor


@triton.jit
def _layout_kernel(ids_ptr, order_ptr, tok_ptr, counts_ptr, row_start_ptr, tile_end_ptr, S, E, TOPK, BM,
                   BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, TOK: tl.constexpr):
    """One program: per expert the row count (integer sums: exact), the first sorted row
    (exclusive prefix sum) and the cumulative BM-row tiles; with TOK, tok = order // k."""
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int64)
    for s0 in range(0, S, BLOCK_S):
        offs = s0 + tl.arange(0, BLOCK_S)
        m = offs < S
        if TOK:
            tl.store(tok_ptr + offs, tl.load(order_ptr + offs, mask=m, other=0) // TOPK, mask=m)
        ids = tl.load(ids_ptr + offs, mask=m, other=-1)
        counts += tl.sum((ids[:, None] == offs_e[None, :]).to(tl.int64), 0)
    me = offs_e < E
    tl.store(counts_ptr + offs_e, counts, mask=me)
    tl.store(row_start_ptr + offs_e, tl.cumsum(counts, 0) - counts, mask=me)
    tl.store(tile_end_ptr + offs_e, tl.cumsum((counts + BM - 1) // BM, 0), mask=me)


@triton.jit
def _rank_kernel(ids_ptr, row_start_ptr, order_ptr, tok_ptr, S, TOPK, BI: tl.constexpr, BJ: tl.constexpr):
    """The stable sort by expert for this program's rows i: row i lands at its expert's first
    sorted row plus the count of rows j < i of the same expert (integer counts), which is the
    permutation torch.sort(stable=True) returns; tok = i // k beside it."""
    i = tl.program_id(0) * BI + tl.arange(0, BI)
    mi = i < S
    e = tl.load(ids_ptr + i, mask=mi, other=-1)
    cnt = tl.zeros((BI,), dtype=tl.int64)
    for j0 in range(0, tl.program_id(0) * BI + BI, BJ):
        j = j0 + tl.arange(0, BJ)
        ej = tl.load(ids_ptr + j, mask=j < S, other=-2)
        cnt += tl.sum(((ej[None, :] == e[:, None]) & (j[None, :] < i[:, None])).to(tl.int64), 1)
    pos = tl.load(row_start_ptr + e, mask=mi, other=0) + cnt
    tl.store(order_ptr + pos, i.to(tl.int64), mask=mi)
    tl.store(tok_ptr + pos, (i // TOPK).to(tl.int64), mask=mi)


# The rank launch's sort (expert_layout): O(S^2) comparisons over S / RANK_BI programs, for the few
# hundred rows of a decode step, where torch.sort's several radix passes cost more than one launch
# (both timed in benchmarks/families/deepseek_v4_decode_ops.py); above RANK_MAX_S rows torch.sort.
RANK_MAX_S = 2048
RANK_BI, RANK_BJ = 32, 128


def _grid_m(S, BM, E):
    """An upper bound of the row-tile count (no host sync): programs past the real count return."""
    return triton.cdiv(S, BM) + min(E, S)


def row_tiles(counts, BM, S):
    """tile_end (cumulative BM-row tiles per expert, read by expert_tile) and grid_m for the
    counts of an earlier layout (the backward's other tile size)."""
    tile_end = torch.cumsum(torch.div(counts + BM - 1, BM, rounding_mode="floor"), 0)
    return tile_end, _grid_m(S, BM, counts.shape[0])


def expert_layout(ids, E, BM):
    """The (token, rank) rows sorted by expert, on the device, no host sync: (order: sorted row ->
    flat t*k + r, tok: sorted row -> token, counts and row_start per expert, tile_end, grid_m).
    The sort is stable (so exact and unique): up to RANK_MAX_S rows (decode steps) one rank launch
    after the counts, more rows torch.sort; the counts are one launch (integer sums)."""
    flat = ids.reshape(-1)
    S = flat.numel()
    small = S <= RANK_MAX_S
    order = torch.empty_like(flat) if small else torch.sort(flat, stable=True).indices
    tok = torch.empty_like(order)
    counts, row_start, tile_end = (torch.empty(E, device=ids.device, dtype=torch.int64) for _ in range(3))
    block_e = triton.next_power_of_2(E)
    kw = {} if interpreting(ids) else dict(num_warps=4)
    _layout_kernel[(1,)](flat, order, tok, counts, row_start, tile_end, S, E, ids.shape[1], BM,
                         BLOCK_E=block_e, BLOCK_S=max(16, min(1024, 8192 // block_e)), TOK=not small, **kw)
    if small and S:
        _rank_kernel[(triton.cdiv(S, RANK_BI),)](flat, row_start, order, tok, S, ids.shape[1], BI=RANK_BI,
                                                 BJ=RANK_BJ, **kw)
    return order, tok, counts, row_start, tile_end, _grid_m(S, BM, E)


def moe_experts(x, ids, weights, w_in, w_out, activation, limit, config=None, keep_h=False):
    """x [T, H], ids int64 [T, k], weights fp32 [T, k], w_in [E, N_in, H], w_out [E, H, I]
    (all contiguous) -> [T, H] in x.dtype. ``config`` overrides the table (benchmarks).

    ``keep_h``: return (out, Kept) with Kept.h [T * k, N_in] the rounded pre-activations of the
    sorted rows (gate then up for swiglu, unclamped) and the sort, which the backward reads
    instead of recomputing x W_in and sorting again; the same kernel binary either way (a
    runtime flag), so out's bits do not change."""
    T, H = x.shape
    k = ids.shape[1]
    E, n_in, _ = w_in.shape
    I = w_out.shape[2]
    out = torch.empty((T, H), device=x.device, dtype=x.dtype)
    if T == 0:
        if not keep_h:
            return out
        none = ids.new_empty(0)
        return out, Kept(x.new_empty((0, n_in)), none, none, ids.new_zeros(E), ids.new_zeros(E))
    S = T * k
    BM, BN1, BN2, BK, warps, stages = config or config_for(S, E)
    interp = interpreting(x)
    if interp:  # as the linear's: the interpreter rounds each K block's dot, the GPU does not
        BK = INTERP_BK
    prec = "ieee" if (x.dtype == torch.float32 or interp) else "tf32"
    order, tok, counts, row_start, tile_end, grid_m = expert_layout(ids, E, BM)
    block_e = triton.next_power_of_2(E)
    kw = {} if interp else dict(num_warps=warps, num_stages=stages)
    a = torch.empty((S, I), device=x.device, dtype=x.dtype)
    h = torch.empty((S, n_in), device=x.device, dtype=x.dtype) if keep_h else a  # a: never written
    split1, kc1, even1 = _k_chunk(n_in, H, BK)              # linear(x_t, w_in[e]) is (N=n_in, K=H)
    _gemm_in_kernel[(grid_m, triton.cdiv(I, BN1))](
        x, w_in, tok, a, h, tile_end, counts, row_start, T, H, I, E, kc1,
        float(limit) if limit is not None else 0.0, int(keep_h), ACT=ACT_CODE[activation], HAS_LIMIT=limit is not None,
        SPLIT=split1, BM=BM, BN=BN1, BK=BK, BLOCK_E=block_e, EVEN_K=even1, INTERP=interp, PREC=prec, **kw)
    y = torch.empty((S, H), device=x.device, dtype=x.dtype)
    split2, kc2, even2 = _k_chunk(H, I, BK)
    _gemm_out_kernel[(grid_m, triton.cdiv(H, BN2))](
        a, w_out, order, y, tile_end, counts, row_start, H, I, E, kc2, SPLIT=split2, BM=BM, BN=BN2,
        BK=BK, BLOCK_E=block_e, EVEN_K=even2, INTERP=interp, PREC=prec, **kw)
    _launch_combine(y, weights, out, T, k, H, interp)
    return (out, Kept(h, order, tok, counts, row_start)) if keep_h else out


def _launch_combine(y, weights, out, T, k, H, interp):
    block = min(1024, triton.next_power_of_2(H))
    ckw = {} if interp else dict(num_warps=4, enable_fp_fusion=False)  # w * y rounded, then added
    _combine_kernel[(T, triton.cdiv(H, block))](y, weights, out, H, TOPK=k, BLOCK=block, **ckw)


def moe_combine(y, weights):
    """y [T, k, H] (contiguous), weights fp32 [T, k] -> [T, H] in y's dtype: the combine
    moe_experts ends with (rank order, each product rounded to fp32, then added, from 0.0)."""
    T, k, H = y.shape
    out = torch.empty((T, H), device=y.device, dtype=y.dtype)
    if T:
        _launch_combine(y, weights, out, T, k, H, interpreting(y))
    return out

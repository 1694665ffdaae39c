"""Triton MoE experts backward: grouped GEMMs over the (token, rank) rows sorted by expert (the
forward's layout, kernels/triton/moe.py expert_layout), no per-expert host loop, no host sync.

With g = dL/dout [T, H], rows sorted by expert e and G = g_t W_out[e] (unscaled by the weight):
- _act_bwd_kernel (row tiles of one expert x BN columns of I): G by a dot over K = H; gate/up
  read from the forward's rounded pre-activations h (moe_experts(keep_h=True): what autograd
  saves, with the forward's sort) or, without them, recomputed by two more dots; a at the forward's rounding points;
  dA = w[t, r] * G (fp32);
  the activation backward (swiglu with the optional DeepSeek-V4 clamps, relu2) gives dH, stored
  in the compute dtype; stores a * w[t, r] (for dW_out) and the partial <G, a> of its columns
  (d weights[t, r] = <g_t, y[t, r]> = <G, a>, summed over column tiles in a fixed order).
- _wgrad_kernel (one expert x one [BN, BK] tile of its gradient): dW[e] = P_e^T Q_e over the
  rows routed to e, accumulated in fp32 and written once into its slice of the [E, N, K]
  gradient; an expert with no rows writes zeros. dW_in = dH^T x[tok]; dW_out = g[tok]^T (w a).
- _dx_kernel (row tiles of one expert x BN columns of H): dx rows = dH W_in[e] in fp32, stored
  at the flat (token, rank) position; dx = the sum over ranks 0..k-1 (torch, fixed order).

Gradients need to be correct, not invariant: tiles are launch knobs (BWD_CONFIG), no atomics, so
a backward is deterministic run to run for a given launch shape. A recomputed h (no saved h) uses
a plain sequential K walk, not linear's SPLIT chunks: it can differ from the forward's h in the
last bit, which moves a gradient by one rounding, far inside the tolerance gradients are held to.
"""
import torch
import triton
import triton.language as tl

from . import interpreting
from ._jit import dot
from .moe import ACT_CODE, expert_layout, expert_tile, row_tiles

# (max average rows per expert, (BM, BN, BK, warps, stages) for _act_bwd_kernel and _dx_kernel (2 BN),
# (BN, BK, BM, warps, stages) for _wgrad_kernel): launch knobs, never part of any bits.
BWD_CONFIG = [
    (16, (16, 64, 64, 4, 3), (64, 64, 32, 4, 3)),
    (1 << 62, (64, 64, 64, 4, 3), (128, 128, 64, 8, 3)),
]


def bwd_config_for(rows, n_experts):
    avg = rows / max(n_experts, 1)
    for bound, rowcfg, wcfg in BWD_CONFIG:
        if avg <= bound:
            return rowcfg, wcfg
    return BWD_CONFIG[-1][1:]


@triton.jit
def _act_bwd_kernel(x_ptr, g_ptr, w_in_ptr, w_out_ptr, wflat_ptr, tok_ptr, order_ptr, aw_ptr, dh_ptr,
                    h_ptr, dwp_ptr, tile_end_ptr, counts_ptr, row_start_ptr, H, I, E, S, limit,
                    ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_H: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr, INTERP: tl.constexpr,
                    PREC: tl.constexpr):
    e, e_c, m0, m_end = expert_tile(tile_end_ptr, counts_ptr, row_start_ptr, E, BM, BLOCK_E)
    if e >= E:
        return
    rows = m0 + tl.arange(0, BM)
    rmask = rows < m_end
    tok = tl.load(tok_ptr + rows, mask=rmask, other=0).to(tl.int64)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = offs_n < I
    n_in = I * (2 - ACT)
    w_e = w_in_ptr + e_c.to(tl.int64) * n_in * H
    wo_e = w_out_ptr + e_c.to(tl.int64) * H * I
    gate = tl.zeros((BM, BN), dtype=tl.float32)
    up = tl.zeros((BM, BN), dtype=tl.float32)
    gw = tl.zeros((BM, BN), dtype=tl.float32)
    offs_k = tl.arange(0, BK)
    for k0 in range(0, H, BK):
        kk = k0 + offs_k
        am = rmask[:, None] & (kk[None, :] < H)
        bm = nmask[None, :] & (kk[:, None] < H)
        if not HAS_H:
            xt = tl.load(x_ptr + tok[:, None] * H + kk[None, :], mask=am, other=0.0)
            gate = dot(xt, tl.load(w_e + offs_n[None, :] * H + kk[:, None], mask=bm, other=0.0), gate,
                        INTERP, PREC)
            if ACT == 0:
                up = dot(xt, tl.load(w_e + (I + offs_n)[None, :] * H + kk[:, None], mask=bm, other=0.0),
                          up, INTERP, PREC)
        gt = tl.load(g_ptr + tok[:, None] * H + kk[None, :], mask=am, other=0.0)
        gw = dot(gt, tl.load(wo_e + kk[:, None] * I + offs_n[None, :], mask=bm, other=0.0), gw,
                  INTERP, PREC)
    dt = aw_ptr.dtype.element_ty
    flat = tl.load(order_ptr + rows, mask=rmask, other=0)
    wr = tl.load(wflat_ptr + flat, mask=rmask, other=0.0)[:, None]
    da = gw * wr
    out_mask = rmask[:, None] & nmask[None, :]
    dh_rows = dh_ptr + rows[:, None].to(tl.int64) * n_in + offs_n[None, :]
    if HAS_H:  # the forward's rounded values: exact in fp32, the roundings below leave them as they are
        h_rows = h_ptr + rows[:, None].to(tl.int64) * n_in + offs_n[None, :]
        gate = tl.load(h_rows, mask=out_mask, other=0.0).to(tl.float32)
        if ACT == 0:
            up = tl.load(h_rows + I, mask=out_mask, other=0.0).to(tl.float32)
    if ACT == 0:
        g = gate.to(dt).to(tl.float32)           # the forward's rounding points
        u = up.to(dt).to(tl.float32)
        if HAS_LIMIT:                            # torch.clamp's gradient passes on the closed range
            g_in = g <= limit
            u_in = (u >= -limit) & (u <= limit)
            g = tl.minimum(g, limit).to(dt).to(tl.float32)
            u = tl.minimum(tl.maximum(u, -limit), limit).to(dt).to(tl.float32)
        sg = 1.0 / (1.0 + tl.exp(-g))
        sl = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        a = (sl * u).to(dt).to(tl.float32)
        dg = da * u * sg * (1.0 + g * (1.0 - sg))
        du = da * sl
        if HAS_LIMIT:
            dg = tl.where(g_in, dg, 0.0)
            du = tl.where(u_in, du, 0.0)
        tl.store(dh_rows, dg.to(dt), mask=out_mask)
        tl.store(dh_rows + I, du.to(dt), mask=out_mask)
    else:
        h = tl.maximum(gate.to(dt).to(tl.float32), 0.0)
        a = (h * h).to(dt).to(tl.float32)
        tl.store(dh_rows, (2.0 * da * h).to(dt), mask=out_mask)
    tl.store(aw_ptr + rows[:, None].to(tl.int64) * I + offs_n[None, :], (a * wr).to(dt), mask=out_mask)
    # masked columns hold G = 0 and a = 0: they add exact zeros
    tl.store(dwp_ptr + tl.program_id(1).to(tl.int64) * S + rows, tl.sum(gw * a, 1), mask=rmask)


@triton.jit
def _wgrad_kernel(p_ptr, q_ptr, tok_ptr, dw_ptr, counts_ptr, row_start_ptr, N, K, tiles_k,
                  GATHER_P: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr,
                  INTERP: tl.constexpr, PREC: tl.constexpr):
    """dw[e] [N, K] = P_e^T Q_e, P [rows, N] and Q [rows, K] over expert e's sorted rows; one of
    them is indexed by token through tok (GATHER_P: P = g, else Q = x), the other by sorted row."""
    tile = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    offs_n = (tile // tiles_k) * BN + tl.arange(0, BN)
    offs_k = (tile % tiles_k) * BK + tl.arange(0, BK)
    nmask = offs_n < N
    kmask = offs_k < K
    start = tl.load(row_start_ptr + e)
    cnt = tl.load(counts_ptr + e)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    offs_m = tl.arange(0, BM)
    for m0 in range(0, cnt, BM):
        rmask = (m0 + offs_m) < cnt
        rows = start + m0 + offs_m
        t = tl.load(tok_ptr + rows, mask=rmask, other=0)
        if GATHER_P:
            pr = t
            qr = rows
        else:
            pr = rows
            qr = t
        p = tl.load(p_ptr + pr[None, :].to(tl.int64) * N + offs_n[:, None], mask=rmask[None, :] & nmask[:, None],
                    other=0.0)
        q = tl.load(q_ptr + qr[:, None].to(tl.int64) * K + offs_k[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0)
        acc = dot(p, q, acc, INTERP, PREC)
    out = dw_ptr + e * N * K + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=nmask[:, None] & kmask[None, :])


@triton.jit
def _dx_kernel(dh_ptr, w_in_ptr, order_ptr, dxr_ptr, tile_end_ptr, counts_ptr, row_start_ptr, H, N_IN, E,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr,
               INTERP: tl.constexpr, PREC: tl.constexpr):
    e, e_c, m0, m_end = expert_tile(tile_end_ptr, counts_ptr, row_start_ptr, E, BM, BLOCK_E)
    if e >= E:
        return
    rows = m0 + tl.arange(0, BM)
    rmask = rows < m_end
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = offs_n < H
    w_e = w_in_ptr + e_c.to(tl.int64) * N_IN * H
    offs_k = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, N_IN, BK):
        kk = k0 + offs_k
        a = tl.load(dh_ptr + rows[:, None].to(tl.int64) * N_IN + kk[None, :],
                    mask=rmask[:, None] & (kk[None, :] < N_IN), other=0.0)
        b = tl.load(w_e + kk[:, None] * H + offs_n[None, :], mask=(kk[:, None] < N_IN) & nmask[None, :], other=0.0)
        acc = dot(a, b, acc, INTERP, PREC)
    dst = tl.load(order_ptr + rows, mask=rmask, other=0)
    tl.store(dxr_ptr + dst[:, None].to(tl.int64) * H + offs_n[None, :], acc, mask=rmask[:, None] & nmask[None, :])


def moe_experts_backward(g, x, ids, weights, w_in, w_out, activation, limit, needs=(True,) * 4, config=None,
                         kept=None):
    """Gradients (dx, d weights, d w_in, d w_out) of moe_experts for dL/dout = g [T, H] (all
    contiguous; entries of ``needs`` False come back None). fp32 accumulation; dx, dw_in, dw_out
    in the parameters' dtype, d weights in fp32. ``config`` overrides bwd_config_for (benchmarks).
    ``kept``: what the forward kept (moe_experts(keep_h=True): the pre-activations and the sort);
    None: both recomputed.

    Invariance: none promised (a backward needs correct gradients); deterministic run to run.
    """
    T, H = x.shape
    k = ids.shape[1]
    E, n_in, _ = w_in.shape
    I = w_out.shape[2]
    S = T * k
    need_x, need_w, need_in, need_out = needs
    if S == 0:
        zero = (torch.zeros_like(x), torch.zeros_like(weights), torch.zeros_like(w_in), torch.zeros_like(w_out))
        return tuple(z if n else None for z, n in zip(zero, needs))
    (BM, BN, BK, warps, stages), (wBN, wBK, wBM, wwarps, wstages) = config or bwd_config_for(S, E)
    interp = interpreting(x)
    prec = "ieee" if (x.dtype == torch.float32 or interp) else "tf32"
    kw = {} if interp else dict(num_warps=warps, num_stages=stages)
    wkw = {} if interp else dict(num_warps=wwarps, num_stages=wstages)
    if kept is None:
        h = None
        order, tok, counts, row_start, tile_end, grid_m = expert_layout(ids, E, BM)
    else:
        h, order, tok, counts, row_start = kept
        tile_end, grid_m = row_tiles(counts, BM, S)
    block_e = triton.next_power_of_2(E)
    dev, dt = x.device, x.dtype
    aw = torch.empty((S, I), device=dev, dtype=dt)          # w[t, r] * a, sorted rows
    dh = torch.empty((S, n_in), device=dev, dtype=dt)       # dL/dh, sorted rows
    tiles_i = triton.cdiv(I, BN)
    dwp = torch.empty((tiles_i, S), device=dev, dtype=torch.float32)
    if h is not None and h.shape != (S, n_in):
        raise ValueError(f"moe_experts_backward: h must be [T*k={S}, N_in={n_in}], got {tuple(h.shape)}")
    _act_bwd_kernel[(grid_m, tiles_i)](
        x, g, w_in, w_out, weights, tok, order, aw, dh, dh if h is None else h, dwp, tile_end, counts, row_start,
        H, I, E, S, float(limit) if limit is not None else 0.0, ACT=ACT_CODE[activation],
        HAS_LIMIT=limit is not None, HAS_H=h is not None, BM=BM, BN=BN, BK=BK, BLOCK_E=block_e, INTERP=interp,
        PREC=prec, **kw)
    d_weights = None
    if need_w:  # column-tile partials summed in tile order, then back to (token, rank) order
        d_weights = torch.empty(S, device=dev, dtype=torch.float32).index_copy_(0, order, dwp.sum(0))
        d_weights = d_weights.view(T, k)

    def wgrad(p, q, N, Kd, gather_p, like):
        out = torch.empty_like(like)
        tiles_k = triton.cdiv(Kd, wBK)
        _wgrad_kernel[(triton.cdiv(N, wBN) * tiles_k, E)](
            p, q, tok, out, counts, row_start, N, Kd, tiles_k, GATHER_P=gather_p, BN=wBN, BK=wBK, BM=wBM,
            INTERP=interp, PREC=prec, **wkw)
        return out
    d_in = wgrad(dh, x, n_in, H, False, w_in) if need_in else None
    d_out = wgrad(g, aw, H, I, True, w_out) if need_out else None
    dx = None
    if need_x:
        dxr = torch.empty((S, H), device=dev, dtype=torch.float32)
        bn_x = 2 * BN
        _dx_kernel[(grid_m, triton.cdiv(H, bn_x))](
            dh, w_in, order, dxr, tile_end, counts, row_start, H, n_in, E, BM=BM, BN=bn_x, BK=BK,
            BLOCK_E=block_e, INTERP=interp, PREC=prec, **kw)
        dx = dxr.view(T, k, H).sum(1).to(dt)
    return dx, d_weights, d_in, d_out

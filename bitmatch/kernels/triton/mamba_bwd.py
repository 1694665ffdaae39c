"""Triton backward of the Mamba2 ops (kernels/mamba.py): the SSD scan, causal_conv1d and
gated_rms_norm, for the trainer (no cache: every sequence starts at position 0 from a zero state).

Gradients need to be correct, not invariant: tiles and warps are launch knobs, there are no
atomics (partial sums go to buffers and are summed by torch in a fixed order), so a backward is
deterministic run to run. The forward's dt rounding points are kept and differentiated as the
identity, as the torch backward did. A few launches per op whatever the length: the torch backward
this replaces re-ran a differentiable scan (several hundred ops per layer), which left a training
step waiting on the host.

Scan, per chunk (absolute positions, Q of them; a = the chunk's cumsum of dt * A, xdt = x * dt,
L[l, s] = exp(a_l - a_s) for s <= l, CB = C_l . B_s, S_in / S_out the state entering / leaving it,
dS = dL/dS_out, the gradient the next chunk passes back; y and S as in kernels/mamba.py):
- _states_kernel, one program per (sequence, head, direction, block of the state's P rows): S_in of
  every chunk walking forward (S_out = exp(a_last) S_in + sum_s exp(a_last - a_s) xdt_s B_s^T) and
  dS of every chunk walking backward (dS_in = exp(a_last) dS_out + sum_l exp(a_l) dy_l^T C_l), each
  [P, N] fp32 per chunk.
- _chunk_kernel, one program per (chunk, head), every chunk at once:
  dxdt_s = sum_{l >= s} L CB dy_l + exp(a_last - a_s) B_s dS^T;   dx = dxdt dt + D dy
  dB_s = sum_{l >= s} L (dy_l . xdt_s) C_l + exp(a_last - a_s) xdt_s dS   (per head; summed per group)
  dC_l = sum_{s <= l} L (dy_l . xdt_s) B_s + exp(a_l) dy_l S_in           (per head; summed per group)
  da: +L CB (dy_l . xdt_s) at l and - at s; exp(a_l) dy_l . (S_in C_l) at l; the state terms at s and
  at the chunk's last position; d(dt A) = the reverse cumsum of da over the chunk; then dt's chain
  through softplus (sigmoid below torch's threshold 20) and the dt_min clamp (passes where >= it).
Dot operands are x's dtype (bf16: as mamba_ssm's backward), fp32 accumulate; the interpreter takes
each dot in float64 (kernels/triton/_jit.py).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import interpreting
from ._jit import dot as _dot
from .mamba import token_seq
from .mamba_ssd import aligned, dt_value, rounded

# launch knobs of the scan backward (never part of any bits): token tile, warps
SCAN_BWD = dict(BT=32, num_warps=8, states_warps=4, states_BP=64)


@functools.lru_cache(maxsize=8)  # every Mamba layer of a step has the same layout: built once
def _chunk_table(seqs, Q, dev):
    """Every chunk of every sequence (sequence order): its first token and length [nc], each
    sequence's first chunk and chunk count [B]; built on the host, uploaded without a sync."""
    tok, ln, c0, nc = [], [], [], []
    for s, e in seqs:
        c0.append(len(tok))
        nc.append((e - s + Q - 1) // Q)
        for c in range(s, e, Q):
            tok.append(c)
            ln.append(min(Q, e - c))

    def put(v):
        return torch.tensor(v, dtype=torch.int32).to(dev, non_blocking=True)
    return put(tok), put(ln), put(c0), put(nc), len(tok)


@triton.jit
def _chunk_dt(dt_ptr, tok0, ln, h, bias, A, dt_lo, offs_q, H: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(raw dt, dt (0 past the chunk's end, as in the forward), cumsum of dt * A) of one chunk."""
    real = offs_q < ln
    raw = tl.load(dt_ptr + (tok0 + offs_q) * H + h, mask=real, other=0.0)
    dtc = tl.where(real, dt_value(raw, bias, dt_lo, HAS_BIAS), 0.0)
    return raw, dtc, tl.cumsum(dtc * A, axis=0)


@triton.jit
def _rows(ptr, tok0, rows, ln, stride, col0, cols):
    """[len(rows), len(cols)] of a chunk's token rows, zeros past its end."""
    return tl.load(ptr + (tok0 + rows)[:, None] * stride + col0 + cols[None, :], mask=(rows < ln)[:, None], other=0.0)


@triton.jit
def _states_kernel(x_ptr, dt_ptr, bias_ptr, A_ptr, B_ptr, C_ptr, dy_ptr, ctok_ptr, clen_ptr, c0_ptr, nc_ptr,
                   Sin_ptr, dS_ptr, dt_lo, H: tl.constexpr, P: tl.constexpr, G: tl.constexpr, N: tl.constexpr,
                   Q: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr, HAS_BIAS: tl.constexpr,
                   INTERP: tl.constexpr, PREC: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mode = tl.program_id(2) // (P // BP)  # 0: S_in walking forward, 1: dS walking backward
    pb = tl.program_id(2) % (P // BP)     # this program's BP rows of the state
    backward = mode == 1
    g = h // (H // G)
    c0 = tl.load(c0_ptr + b)
    ncs = tl.load(nc_ptr + b)
    offs_q = tl.arange(0, Q)
    offs_t = tl.arange(0, BT)
    offs_p = pb * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, N)
    A = tl.load(A_ptr + h)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + h).to(tl.float32)
    tile = offs_p[:, None] * N + offs_n[None, :]
    S = tl.zeros((BP, N), tl.float32)
    for i in range(0, ncs):
        k = tl.where(backward, c0 + ncs - 1 - i, c0 + i).to(tl.int64)
        st = (k * H + h) * (P * N)
        tl.store(Sin_ptr + st + tile, S, mask=(tile >= 0) & (mode == 0))
        tl.store(dS_ptr + st + tile, S, mask=(tile >= 0) & (mode == 1))
        tok0 = tl.load(ctok_ptr + k).to(tl.int64)
        ln = tl.load(clen_ptr + k)
        _, dtc, acum = _chunk_dt(dt_ptr, tok0, ln, h, bias, A, dt_lo, offs_q, H, HAS_BIAS)
        a_last = tl.sum(tl.where(offs_q == Q - 1, acum, 0.0), axis=0)
        S = S * tl.exp(a_last)
        for kb in range(0, Q // BT):
            rows = kb * BT + offs_t
            a_r = tl.gather(acum, rows, 0)
            if backward:  # sum_l exp(a_l) dy_l^T C_l
                v = _rows(dy_ptr, tok0, rows, ln, H * P, h * P, offs_p) * tl.exp(a_r)[:, None]
                m = _rows(C_ptr, tok0, rows, ln, G * N, g * N, offs_n)
            else:  # sum_s exp(a_last - a_s) xdt_s^T B_s
                xr = _rows(x_ptr, tok0, rows, ln, H * P, h * P, offs_p).to(tl.float32)
                v = xr * (tl.exp(a_last - a_r) * tl.gather(dtc, rows, 0))[:, None]
                m = _rows(B_ptr, tok0, rows, ln, G * N, g * N, offs_n)
            S = _dot(tl.trans(v.to(m.dtype)), m, S, INTERP, PREC)


@triton.jit
def _chunk_kernel(x_ptr, dt_ptr, bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dy_ptr, ctok_ptr, clen_ptr, Sin_ptr, dS_ptr,
                  dx_ptr, ddt_ptr, da_ptr, dB_ptr, dC_ptr, dA_ptr, dD_ptr, dt_lo,
                  H: tl.constexpr, P: tl.constexpr, G: tl.constexpr, N: tl.constexpr, Q: tl.constexpr,
                  BT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_D: tl.constexpr, INTERP: tl.constexpr,
                  PREC: tl.constexpr):
    k = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // (H // G)
    tok0 = tl.load(ctok_ptr + k).to(tl.int64)
    ln = tl.load(clen_ptr + k)
    offs_q = tl.arange(0, Q)
    offs_t = tl.arange(0, BT)
    offs_p = tl.arange(0, P)
    offs_n = tl.arange(0, N)
    A = tl.load(A_ptr + h)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(bias_ptr + h).to(tl.float32)
    Dh = 0.0
    if HAS_D:
        Dh = tl.load(D_ptr + h)
    raw, dtc, acum = _chunk_dt(dt_ptr, tok0, ln, h, bias, A, dt_lo, offs_q, H, HAS_BIAS)
    a_last = tl.sum(tl.where(offs_q == Q - 1, acum, 0.0), axis=0)
    st = (k * H + h) * (P * N)
    tile = offs_p[:, None] * N + offs_n[None, :]
    dt_ty = x_ptr.dtype.element_ty
    dS = tl.load(dS_ptr + st + tile).to(dt_ty)
    own = tl.sum(tl.zeros((BT,), tl.float32), axis=0)  # the state-out term's da: on the last position
    dDacc = tl.sum(tl.zeros((BT,), tl.float32), axis=0)
    NT: tl.constexpr = Q // BT
    # rows as s: dxdt, dB and the negative terms of da
    for si in range(0, NT):
        srows = si * BT + offs_t
        sm = srows < ln
        Bs = _rows(B_ptr, tok0, srows, ln, G * N, g * N, offs_n)
        xs = _rows(x_ptr, tok0, srows, ln, H * P, h * P, offs_p).to(tl.float32)
        dys = _rows(dy_ptr, tok0, srows, ln, H * P, h * P, offs_p)
        a_s = tl.gather(acum, srows, 0)
        dt_s = tl.gather(dtc, srows, 0)
        xdt = xs * dt_s[:, None]
        xdt_op = xdt.to(dt_ty)
        decay = tl.exp(a_last - a_s)
        BG = _dot(Bs, tl.trans(dS), tl.zeros((BT, P), tl.float32), INTERP, PREC)
        dxdt = decay[:, None] * BG
        dBacc = decay[:, None] * _dot(xdt_op, dS, tl.zeros((BT, N), tl.float32), INTERP, PREC)
        q = decay * tl.sum(xdt * BG, axis=1)
        own += tl.sum(q, axis=0)
        da = -q
        for li in range(si, NT):
            lrows = li * BT + offs_t
            Cl = _rows(C_ptr, tok0, lrows, ln, G * N, g * N, offs_n)
            dyl = _rows(dy_ptr, tok0, lrows, ln, H * P, h * P, offs_p).to(dt_ty)
            a_l = tl.gather(acum, lrows, 0)
            L = tl.where(lrows[None, :] >= srows[:, None], tl.exp(tl.minimum(a_l[None, :] - a_s[:, None], 0.0)), 0.0)
            M1 = L * _dot(Bs, tl.trans(Cl), tl.zeros((BT, BT), tl.float32), INTERP, PREC)      # [s, l]
            DX = _dot(xdt_op, tl.trans(dyl), tl.zeros((BT, BT), tl.float32), INTERP, PREC)      # [s, l]
            dxdt = _dot(M1.to(dt_ty), dyl, dxdt, INTERP, PREC)
            dBacc = _dot((L * DX).to(dt_ty), Cl, dBacc, INTERP, PREC)
            da -= tl.sum(M1 * DX, axis=1)
        tok = tok0 + srows
        dx = dxdt * dt_s[:, None]
        if HAS_D:
            dx += Dh * dys
            dDacc += tl.sum(tl.sum(dys * xs, axis=1), axis=0)
        tl.store(dx_ptr + tok[:, None] * (H * P) + h * P + offs_p[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=sm[:, None])
        tl.store(ddt_ptr + tok * H + h, tl.sum(dxdt * xs, axis=1), mask=sm)
        tl.store(da_ptr + tok * H + h, da, mask=sm)
        tl.store(dB_ptr + tok[:, None] * (H * N) + h * N + offs_n[None, :], dBacc, mask=sm[:, None])
    tl.debug_barrier()  # the da rows above are read back below, by other threads of this program
    Sin = tl.load(Sin_ptr + st + tile)
    extra = tl.exp(a_last) * tl.sum(tl.sum(tl.load(dS_ptr + st + tile) * Sin, axis=1), axis=0) + own
    Sin = Sin.to(dt_ty)
    # rows as l: dC and the positive terms of da
    for li in range(0, NT):
        lrows = li * BT + offs_t
        lm = lrows < ln
        Cl = _rows(C_ptr, tok0, lrows, ln, G * N, g * N, offs_n)
        dyl = _rows(dy_ptr, tok0, lrows, ln, H * P, h * P, offs_p).to(dt_ty)
        a_l = tl.gather(acum, lrows, 0)
        el = tl.exp(a_l)
        dyS = _dot(dyl, Sin, tl.zeros((BT, N), tl.float32), INTERP, PREC)
        dCacc = el[:, None] * dyS
        da = el * tl.sum(dyS * Cl.to(tl.float32), axis=1)
        for si in range(0, li + 1):
            srows = si * BT + offs_t
            Bs = _rows(B_ptr, tok0, srows, ln, G * N, g * N, offs_n)
            xs = _rows(x_ptr, tok0, srows, ln, H * P, h * P, offs_p).to(tl.float32)
            a_s = tl.gather(acum, srows, 0)
            xdt_op = (xs * tl.gather(dtc, srows, 0)[:, None]).to(dt_ty)
            L = tl.where(lrows[:, None] >= srows[None, :], tl.exp(tl.minimum(a_l[:, None] - a_s[None, :], 0.0)), 0.0)
            M = L * _dot(dyl, tl.trans(xdt_op), tl.zeros((BT, BT), tl.float32), INTERP, PREC)   # [l, s]
            dCacc = _dot(M.to(dt_ty), Bs, dCacc, INTERP, PREC)
            da += tl.sum(M * _dot(Cl, tl.trans(Bs), tl.zeros((BT, BT), tl.float32), INTERP, PREC), axis=1)
        tok = tok0 + lrows
        tl.store(dC_ptr + tok[:, None] * (H * N) + h * N + offs_n[None, :], dCacc, mask=lm[:, None])
        prev = tl.load(da_ptr + tok * H + h, mask=lm, other=0.0)
        tl.store(da_ptr + tok * H + h, prev + da, mask=lm)
    tl.debug_barrier()
    real = offs_q < ln
    rows = tok0 + offs_q
    da = tl.load(da_ptr + rows * H + h, mask=real, other=0.0) + tl.where(offs_q == Q - 1, extra, 0.0)
    ddA = tl.cumsum(da, axis=0, reverse=True)
    ddt = tl.load(ddt_ptr + rows * H + h, mask=real, other=0.0) + ddA * A
    tl.store(dA_ptr + k * H + h, tl.sum(tl.where(real, ddA * dtc, 0.0), axis=0))
    tl.store(dD_ptr + k * H + h, dDacc)
    # dt = clamp(softplus(raw + bias), min=dt_lo): sigmoid below the threshold, 1 above; the clamp
    # passes the gradient where the value is at or above its bound (torch's clamp)
    z = raw.to(tl.float32)
    if HAS_BIAS:
        z = (z + bias).to(raw.dtype).to(tl.float32)
    sp = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(z))).to(raw.dtype).to(tl.float32)
    dsp = tl.where(z > 20.0, 1.0, 1.0 / (1.0 + tl.exp(-z)))
    tl.store(ddt_ptr + rows * H + h, tl.where(sp >= dt_lo, ddt * dsp, 0.0), mask=real)


def scan_backward(g, x, dt_raw, A, B, C, D, dt_bias, Q, seqs, dt_min):
    """(dx, d dt_raw, dA, dB, dC, dD, d dt_bias) of kernels.mamba_chunk_scan without a cache, for
    upstream g [T, H, P]; ``seqs``: the (start, end) token bounds of each sequence, on the host."""
    T, H, P = x.shape
    G, N = B.shape[1:]
    dev = x.device
    ctok, clen, c0, ncs, nc = _chunk_table(tuple(seqs), Q, dev)
    f32 = dict(dtype=torch.float32, device=dev)
    dx = torch.empty_like(x)
    # every real token is in one chunk and every (chunk, head) has a program: each entry is written
    ddt = torch.empty(T, H, **f32)
    da = torch.empty(T, H, **f32)
    dBh = torch.empty(T, H, N, **f32)
    dCh = torch.empty(T, H, N, **f32)
    dAp = (torch.empty if nc else torch.zeros)(max(nc, 1), H, **f32)  # no chunk: the sums below are 0
    dDp = (torch.empty if nc else torch.zeros)(max(nc, 1), H, **f32)
    if nc:
        interp = interpreting(x)
        prec = "ieee" if (x.dtype == torch.float32 or interp) else "tf32"
        Sin = torch.empty(nc, H, P, N, **f32)
        dS = torch.empty(nc, H, P, N, **f32)
        BT, BP = min(SCAN_BWD["BT"], Q), min(SCAN_BWD["states_BP"], P)
        xa, dta, Aa, Ba, Ca, ga = (aligned(t) for t in (x, dt_raw, A.float(), B, C, g.float()))
        bias = aligned(dt_bias) if dt_bias is not None else Aa
        Dp = aligned(D.float()) if D is not None else Aa
        dt_lo = rounded(dt_min, dt_raw.dtype)
        common = dict(H=H, P=P, G=G, N=N, Q=Q, BT=BT, HAS_BIAS=dt_bias is not None, INTERP=interp, PREC=prec)
        _states_kernel[(len(seqs), H, 2 * (P // BP))](xa, dta, bias, Aa, Ba, Ca, ga, ctok, clen, c0, ncs, Sin, dS,
                                                      dt_lo, BP=BP, num_warps=SCAN_BWD["states_warps"], **common)
        _chunk_kernel[(nc, H)](xa, dta, bias, Aa, Ba, Ca, Dp, ga, ctok, clen, Sin, dS, dx, ddt, da, dBh, dCh, dAp,
                               dDp, dt_lo, HAS_D=D is not None, num_warps=SCAN_BWD["num_warps"], **common)
    rep = H // G
    dB = dBh.view(T, G, rep, N).sum(2).to(B.dtype)
    dC = dCh.view(T, G, rep, N).sum(2).to(C.dtype)
    ddt_bias = None if dt_bias is None else ddt.sum(0).to(dt_bias.dtype)
    dD = None if D is None else dDp.sum(0).to(D.dtype)
    return dx, ddt.to(dt_raw.dtype), dAp.sum(0).to(A.dtype), dB, dC, dD, ddt_bias


# ---------------------------------------------------------------- causal conv1d
@triton.jit
def _conv_pre(x_ptr, w_ptr, b_ptr, rows, first, rm, cols, cm, Cd, K: tl.constexpr, HAS_BIAS: tl.constexpr,
              BR: tl.constexpr, BC: tl.constexpr):
    """The conv's fp32 pre-activation of token rows (taps before each row's sequence start: 0;
    rows past the last token, rm false, read nothing)."""
    acc = tl.zeros((BR, BC), tl.float32)
    for j in range(K):
        src = rows - (K - 1) + j
        v = tl.load(x_ptr + src[:, None] * Cd + cols[None, :], mask=((src >= first) & rm)[:, None] & cm[None, :],
                    other=0.0)
        acc += tl.load(w_ptr + cols * K + j, mask=cm, other=0.0).to(tl.float32)[None, :] * v.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _conv_gpre_kernel(x_ptr, w_ptr, b_ptr, g_ptr, seq_ptr, cu_ptr, gp_ptr, dwp_ptr, dbp_ptr, T, Cd, K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """dL/d(pre-activation) of a [BR tokens, BC channels] tile, and its partial dw, db sums."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    rm = rows < T
    cm = cols < Cd
    m = rm[:, None] & cm[None, :]
    first = tl.load(cu_ptr + tl.load(seq_ptr + rows, mask=rm, other=0))  # each row's sequence start
    gp = tl.load(g_ptr + rows[:, None] * Cd + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if SILU:
        u = _conv_pre(x_ptr, w_ptr, b_ptr, rows, first, rm, cols, cm, Cd, K, HAS_BIAS, BR, BC)
        s = 1.0 / (1.0 + tl.exp(-u))
        gp = gp * s * (1.0 + u * (1.0 - s))
    gp = tl.where(m, gp, 0.0)
    tl.store(gp_ptr + rows[:, None] * Cd + cols[None, :], gp, mask=m)
    for j in range(K):
        src = rows - (K - 1) + j
        v = tl.load(x_ptr + src[:, None] * Cd + cols[None, :], mask=(src >= first)[:, None] & m, other=0.0)
        tl.store(dwp_ptr + (tl.program_id(0) * Cd + cols) * K + j, tl.sum(gp * v.to(tl.float32), axis=0), mask=cm)
    if HAS_BIAS:
        tl.store(dbp_ptr + tl.program_id(0) * Cd + cols, tl.sum(gp, axis=0), mask=cm)


@triton.jit
def _conv_dx_kernel(gp_ptr, w_ptr, seq_ptr, cu_ptr, dx_ptr, T, Cd, K: tl.constexpr, BR: tl.constexpr,
                    BC: tl.constexpr):
    """dx[t] = sum_j w[:, j] * gp[t + K-1-j] over the taps that stay in t's sequence."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    rm = rows < T
    cm = cols < Cd
    last = tl.load(cu_ptr + tl.load(seq_ptr + rows, mask=rm, other=0) + 1) - 1  # each row's sequence end
    acc = tl.zeros((BR, BC), tl.float32)
    for j in range(K):
        dst = rows + (K - 1) - j
        v = tl.load(gp_ptr + dst[:, None] * Cd + cols[None, :], mask=(rm & (dst <= last))[:, None] & cm[None, :],
                    other=0.0)
        acc += tl.load(w_ptr + cols * K + j, mask=cm, other=0.0).to(tl.float32)[None, :] * v
    tl.store(dx_ptr + rows[:, None] * Cd + cols[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=rm[:, None] & cm[None, :])


def conv_backward(g, x, weight, bias, cu_seqlens, activation):
    """(dx, dweight, dbias) of kernels.causal_conv1d without a state, for upstream g [T, C]."""
    T, Cd = x.shape
    K = weight.shape[1]
    dev = x.device
    BR, BC = 32, 128
    nr = triton.cdiv(T, BR)
    if not T:
        return torch.empty_like(x), torch.zeros_like(weight), None if bias is None else torch.zeros_like(bias)
    cu = cu_seqlens.to(torch.int64)
    seq = token_seq(cu, T)
    gp = torch.empty(T, Cd, dtype=torch.float32, device=dev)
    dwp = torch.empty(nr, Cd, K, dtype=torch.float32, device=dev)  # every entry written (no fill)
    dbp = torch.empty(nr, Cd, dtype=torch.float32, device=dev) if bias is not None else gp
    dx = torch.empty_like(x)
    grid = (nr, triton.cdiv(Cd, BC))
    wa = aligned(weight)
    _conv_gpre_kernel[grid](x, wa, bias if bias is not None else wa, g.contiguous(), seq, cu, gp, dwp, dbp, T, Cd,
                            K=K, HAS_BIAS=bias is not None, SILU=activation == "silu", BR=BR, BC=BC)
    _conv_dx_kernel[grid](gp, wa, seq, cu, dx, T, Cd, K=K, BR=BR, BC=BC)
    dw = dwp.sum(0).to(weight.dtype)
    db = None if bias is None else dbp.sum(0).to(bias.dtype)
    return dx, dw, db


# ---------------------------------------------------------------- gated RMSNorm
@triton.jit
def _gated_bwd_kernel(y_ptr, z_ptr, w_ptr, g_ptr, dy_ptr, dz_ptr, dwp_ptr, T, I, gs, eps, BR: tl.constexpr,
                      BLOCK: tl.constexpr):
    """A [BR rows, one group] tile: h = y silu(z), r = 1 / sqrt(mean(h^2) + eps), out = w h r;
    dh = r (w g - h r^2 mean(w g h)); dy = dh silu(z), dz = dh y silu'(z); partial dw = sum g h r."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * gs + tl.arange(0, BLOCK)
    cm = tl.arange(0, BLOCK) < gs
    m = (rows < T)[:, None] & cm[None, :]
    off = rows[:, None] * I + cols[None, :]
    y = tl.load(y_ptr + off, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + off, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + off, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-z))
    sz = z * s
    h = y * sz
    r = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / gs + eps)
    wg = w[None, :] * g
    dh = r[:, None] * (wg - h * (r * r * tl.sum(wg * h, axis=1) / gs)[:, None])
    tl.store(dy_ptr + off, (dh * sz).to(dy_ptr.dtype.element_ty), mask=m)
    tl.store(dz_ptr + off, (dh * y * s * (1.0 + z * (1.0 - s))).to(dz_ptr.dtype.element_ty), mask=m)
    tl.store(dwp_ptr + tl.program_id(0) * I + cols, tl.sum(g * h * r[:, None], axis=0), mask=cm)


def gated_backward(g, y, z, weight, group_size, eps):
    """(dy, dz, dweight) of kernels.gated_rms_norm for upstream g [T, I]."""
    T, I = y.shape
    BR = 16
    nr = max(triton.cdiv(T, BR), 1)
    dy, dz = torch.empty_like(y), torch.empty_like(z)
    dwp = (torch.empty if T else torch.zeros)(nr, I, dtype=torch.float32, device=y.device)  # T > 0: all written
    if T:
        _gated_bwd_kernel[(nr, I // group_size)](y, z, weight, g.contiguous(), dy, dz, dwp, T, I, group_size, eps,
                                                 BR=BR, BLOCK=triton.next_power_of_2(group_size))
    return dy, dz, dwp.sum(0).to(weight.dtype)

"""Triton Mamba2 ops on the canonical chunk schedule (see kernels/mamba.py for the contract): the SSD
scan, causal_conv1d (fp32 taps in order, state rows before the call) and gated_rms_norm (one
program per row and group).

The scan:

One program per (sequence, head) walks the call's tokens in order with the chunk's start state S_c
[P, N] in registers; every token runs THE SAME code whether the launch is a prefill, a chunked
prefill or a one-token decode, so its bits cannot depend on the schedule:
- dA_s = dt_s * A; within the chunk, positions are taken in sub-blocks of SB aligned to the chunk
  start; Acum_s = carry_k + cumsum(dA of sub-block k)[s], carry_{k+1} = carry_k + (its last cumsum);
  positions after the token are exact zeros (masked), so Acum_s depends on dA_0..dA_s only.
- y[p] = tl.sum_n(C_t * S_c[p]) * exp(Acum_l)
         + sum over sub-blocks k = 0.. (in order) of tl.sum_s(w_s * x_s[p] * dt_s),
           w_s = tl.sum_n(C_t * B_s) * exp(Acum_l - Acum_s) for s <= l, exact 0 after
         + D * x_t, in fp32.
- at a chunk's last position: S_{c+1} = exp(Acum_{Q-1}) * S_c + sum over sub-blocks (in order) of
  tl.dot((w_s * x_s * dt_s)^T, B_s) (fp32 "ieee" dot), w_s = exp(Acum_{Q-1} - Acum_s).
Positions of the open chunk before the call come from the per-sequence buffers (x, B, dt), the
call's own positions from its inputs (the same values, so the same bits); after the kernel, the
tokens of each sequence's last chunk are copied into its buffer for the next call (the kernel never
writes a buffer: programs of one group share B rows). These are the GPU's bits; the CPU reference has its own
(float64) order: the two backends agree to rounding, each with itself bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_chunk(in_ptr, in_row, in_col, buf_ptr, buf_row, base_q, offs, pos, p0, t0, offs_i,
                Q: tl.constexpr, HAS_CACHE: tl.constexpr):
    """[SB, len(offs_i)] fp32 values of chunk positions base_q + offs (exact 0 after ``pos``): from the
    call's input rows, or, before the call's first position p0, from the sequence's buffer."""
    q = base_q + offs
    valid = q <= pos
    in_call = q >= p0
    tok = t0 + (q - p0)
    v = tl.load(in_ptr + tok[:, None] * in_row + in_col + offs_i[None, :], mask=(valid & in_call)[:, None],
                other=0.0).to(tl.float32)
    if HAS_CACHE:
        vb = tl.load(buf_ptr + (q % Q)[:, None] * buf_row + offs_i[None, :], mask=(valid & (q < p0))[:, None],
                     other=0.0).to(tl.float32)
        v = tl.where(in_call[:, None], v, vb)
    return v


@triton.jit
def _last(v, offs, SB: tl.constexpr):
    return tl.sum(tl.where(offs == SB - 1, v, 0.0), axis=0)  # one value plus exact zeros


@triton.jit
def _ssd_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, y_ptr, cu_ptr, start_ptr, slot_ptr,
                S_ptr, xb_ptr, bb_ptr, db_ptr,
                H: tl.constexpr, P: tl.constexpr, G: tl.constexpr, N: tl.constexpr, Q: tl.constexpr,
                SB: tl.constexpr, HAS_CACHE: tl.constexpr, HAS_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = h // (H // G)
    t0 = tl.load(cu_ptr + b)
    t1 = tl.load(cu_ptr + b + 1)
    offs_p = tl.arange(0, P)
    offs_n = tl.arange(0, N)
    offs_s = tl.arange(0, SB)
    one = tl.arange(0, 1)
    A = tl.load(A_ptr + h)
    Dh = 0.0
    if HAS_D:
        Dh = tl.load(D_ptr + h)
    if HAS_CACHE:
        p0 = tl.load(start_ptr + b)
        slot = tl.load(slot_ptr + b)
        s_base = S_ptr + slot * (H * P * N) + h * (P * N)
        S = tl.load(s_base + offs_p[:, None] * N + offs_n[None, :])
        xb = xb_ptr + slot * (Q * H * P) + h * P
        bb = bb_ptr + slot * (Q * G * N) + g * N
        db = db_ptr + slot * (Q * H) + h
    else:
        p0 = t0 * 0
        s_base = S_ptr
        S = tl.zeros([P, N], dtype=tl.float32)
        xb = x_ptr
        bb = B_ptr
        db = dt_ptr
    for t in range(t0, t1):
        pos = p0 + (t - t0)
        l = pos % Q
        cq = pos - l
        nblk = l // SB + 1
        c_t = tl.load(C_ptr + t * (G * N) + g * N + offs_n).to(tl.float32)
        x_t = tl.load(x_ptr + t * (H * P) + h * P + offs_p).to(tl.float32)
        # pass 1: Acum_l
        carry = 0.0
        acum_l = 0.0
        for k in range(0, nblk):
            dts = tl.sum(_load_chunk(dt_ptr, H, h, db, H, cq + k * SB, offs_s, pos, p0, t0, one, Q, HAS_CACHE), axis=1)
            cs = tl.cumsum(dts * A, axis=0)
            hit = tl.sum(tl.where(offs_s == l - k * SB, carry + cs, 0.0), axis=0)
            acum_l = tl.where(k == nblk - 1, hit, acum_l)
            carry = carry + _last(cs, offs_s, SB)
        # pass 2: the intra-chunk sum, then the state's contribution
        carry = 0.0
        ydiag = tl.zeros([P], dtype=tl.float32)
        for k in range(0, nblk):
            base = cq + k * SB
            dts = tl.sum(_load_chunk(dt_ptr, H, h, db, H, base, offs_s, pos, p0, t0, one, Q, HAS_CACHE), axis=1)
            bs = _load_chunk(B_ptr, G * N, g * N, bb, G * N, base, offs_s, pos, p0, t0, offs_n, Q, HAS_CACHE)
            xs = _load_chunk(x_ptr, H * P, h * P, xb, H * P, base, offs_s, pos, p0, t0, offs_p, Q, HAS_CACHE)
            cs = tl.cumsum(dts * A, axis=0)
            valid = (base + offs_s) <= pos
            w = tl.where(valid, tl.sum(c_t[None, :] * bs, axis=1) * tl.exp(acum_l - (carry + cs)), 0.0)
            ydiag += tl.sum((w * dts)[:, None] * xs, axis=0)
            carry = carry + _last(cs, offs_s, SB)
        yoff = tl.sum(c_t[None, :] * S, axis=1) * tl.exp(acum_l)
        y = (yoff + ydiag) + Dh * x_t
        tl.store(y_ptr + t * (H * P) + h * P + offs_p, y)
        if l == Q - 1:  # the chunk closes: S_{c+1}
            carry = 0.0
            acc = tl.zeros([P, N], dtype=tl.float32)
            for kc in range(0, Q // SB):
                base = cq + kc * SB
                dts = tl.sum(_load_chunk(dt_ptr, H, h, db, H, base, offs_s, pos, p0, t0, one, Q, HAS_CACHE), axis=1)
                bs = _load_chunk(B_ptr, G * N, g * N, bb, G * N, base, offs_s, pos, p0, t0, offs_n, Q, HAS_CACHE)
                xs = _load_chunk(x_ptr, H * P, h * P, xb, H * P, base, offs_s, pos, p0, t0, offs_p, Q, HAS_CACHE)
                cs = tl.cumsum(dts * A, axis=0)
                wd = tl.exp(acum_l - (carry + cs)) * dts
                acc = tl.dot(tl.trans(wd[:, None] * xs), bs, acc, input_precision="ieee")
                carry = carry + _last(cs, offs_s, SB)
            S = tl.exp(acum_l) * S + acc
    if HAS_CACHE:
        tl.store(s_base + offs_p[:, None] * N + offs_n[None, :], S)


@triton.jit
def _dt_kernel(dt_ptr, bias_ptr, out_ptr, n, dt_min, H: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """dt = clamp(round(softplus(round(dt + dt_bias))), min=dt_min) as fp32, rounding to dt's dtype (HF's
    points); elementwise, so an element's bits do not depend on how many share the launch."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    raw = tl.load(dt_ptr + offs, mask=m, other=0.0)
    z = raw.to(tl.float32)
    if HAS_BIAS:
        z = (z + tl.load(bias_ptr + offs % H, mask=m, other=0.0).to(tl.float32)).to(raw.dtype).to(tl.float32)
    sp = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(z))).to(raw.dtype).to(tl.float32)
    lo = tl.full([BLOCK], dt_min, tl.float32).to(raw.dtype).to(tl.float32)
    tl.store(out_ptr + offs, tl.where(sp < lo, lo, sp), mask=m)


def process_dt(dt, dt_bias, dt_min):
    out = torch.empty(dt.shape, dtype=torch.float32, device=dt.device)
    n = dt.numel()
    if n:
        bias = dt_bias.contiguous() if dt_bias is not None else out
        _dt_kernel[(triton.cdiv(n, 1024),)](dt.contiguous(), bias, out, n, dt_min, H=dt.shape[1],
                                            HAS_BIAS=dt_bias is not None, BLOCK=1024)
    return out


def mamba_chunk_scan(x, dt, A, B, C, D, dt_bias, chunk_size, cu_seqlens, dt_min, seq_start, cache, state_slots):
    T, H, P = x.shape
    G, N = B.shape[1:]
    Q = chunk_size
    for name, v in (("head_dim", P), ("state", N), ("chunk_size", Q)):
        if v & (v - 1) or v < 16:
            raise NotImplementedError(f"mamba_chunk_scan (Triton): {name}={v} must be a power of two >= 16")
    SB = min(32, Q)
    y = torch.empty(T, H, P, dtype=torch.float32, device=x.device)
    nb = cu_seqlens.shape[0] - 1
    if nb == 0 or T == 0:
        return y
    dtp = process_dt(dt, dt_bias, dt_min)
    cu = cu_seqlens.to(torch.int64).contiguous()
    has_cache = cache is not None
    if has_cache:
        S, xb, bb, db = cache
        start, slots = seq_start.to(torch.int64).contiguous(), state_slots.to(torch.int64).contiguous()
    else:
        S = xb = bb = db = y
        start = slots = cu
    Dp = D if D is not None else A
    _ssd_kernel[(nb, H)](x.contiguous(), dtp, A.float().contiguous(), B.contiguous(), C.contiguous(),
                         Dp.float().contiguous(), y, cu, start, slots, S, xb, bb, db,
                         H=H, P=P, G=G, N=N, Q=Q, SB=SB, HAS_CACHE=has_cache, HAS_D=D is not None,
                         num_warps=4)
    if has_cache:  # the open chunk of each sequence, after the kernel (its reads of older entries are done)
        _write_open_chunk(x, B, dtp, cu, start, slots, xb, bb, db, Q)
    return y


def _write_open_chunk(x, B, dtp, cu, start, slots, xb, bb, db, Q):
    """Store x, B, dt of every token in its sequence's last (open) chunk at buffer row pos % Q (one
    writer per row: plain copies, deterministic)."""
    T = x.shape[0]
    lens = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=x.device), lens, output_size=T)
    pos = start[seq] + (torch.arange(T, device=x.device) - cu[:-1][seq])
    last = torch.div(start + lens - 1, Q, rounding_mode="floor") * Q
    idx = (pos >= last[seq]).nonzero().squeeze(1)
    s, r = slots[seq[idx]], pos[idx] % Q
    xb[s, r] = x[idx].to(xb.dtype)
    bb[s, r] = B[idx].to(bb.dtype)
    db[s, r] = dtp[idx]


# ---------------------------------------------------------------- causal conv1d
@triton.jit
def _conv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, state_ptr, tok_seq_ptr, cu_ptr, slot_ptr, Cd,
                 K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, SILU: tl.constexpr,
                 BLOCK: tl.constexpr):
    """out[t, c] = act(round(sum_j w[c, j] * x[t-K+1+j, c] (j ascending, fp32, from 0) + bias[c]));
    inputs before the call's first token come from the sequence's state rows (zeros without one)."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < Cd
    b = tl.load(tok_seq_ptr + t)
    t0 = tl.load(cu_ptr + b)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(K):
        src = t - (K - 1) + j  # a token of this call when src >= t0, else state row K-1-(t0-src)
        v = tl.load(x_ptr + src * Cd + offs, mask=m & (src >= t0), other=0.0).to(tl.float32)
        if HAS_STATE:
            slot = tl.load(slot_ptr + b)
            row = (K - 1) - (t0 - src)
            vs = tl.load(state_ptr + slot * ((K - 1) * Cd) + row * Cd + offs, mask=m & (src < t0) & (row >= 0),
                         other=0.0).to(tl.float32)
            v = tl.where(src >= t0, v, vs)
        acc = acc + tl.load(w_ptr + offs * K + j, mask=m, other=0.0).to(tl.float32) * v
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
    o = acc.to(out_ptr.dtype.element_ty)
    if SILU:
        of = o.to(tl.float32)
        o = (of / (1.0 + tl.exp(-of))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * Cd + offs, o, mask=m)


def causal_conv1d(x, weight, bias, cu_seqlens, conv_state, state_slots, activation):
    T, Cd = x.shape
    K = weight.shape[1]
    out = torch.empty_like(x)
    if T == 0:
        return out
    cu = cu_seqlens.to(torch.int64).contiguous()
    lens = cu[1:] - cu[:-1]
    nb = lens.shape[0]
    tok_seq = torch.repeat_interleave(torch.arange(nb, device=x.device), lens, output_size=T)
    has_state = conv_state is not None
    slots = state_slots.to(torch.int64).contiguous() if has_state else cu
    BLOCK = 256
    _conv_kernel[(T, triton.cdiv(Cd, BLOCK))](x, weight.contiguous(), bias if bias is not None else x, out,
                                             conv_state if has_state else x, tok_seq, cu, slots, Cd, K=K,
                                             HAS_BIAS=bias is not None, HAS_STATE=has_state,
                                             SILU=activation == "silu", BLOCK=BLOCK)
    if has_state and K > 1:  # the last K-1 inputs of each sequence (after the kernel read the old rows)
        r = torch.arange(K - 1, device=x.device)
        i = lens[:, None] - (K - 1) + r[None, :]           # index into the call's tokens, < 0: old state
        old = conv_state[slots][torch.arange(nb, device=x.device)[:, None], (i + (K - 1)).clamp(0, K - 2)]
        new = x[(cu[:-1, None] + i).clamp(0, T - 1)]
        conv_state[slots] = torch.where((i >= 0)[..., None], new, old)
    return out


# ---------------------------------------------------------------- gated RMSNorm
@triton.jit
def _gated_kernel(y_ptr, z_ptr, w_ptr, out_ptr, I, gs, eps, BLOCK: tl.constexpr):
    """One program per (row, group): h = y * silu(z) in fp32; out = w * (h / sqrt(tl.sum(h^2) / gs + eps))."""
    row = tl.program_id(0)
    grp = tl.program_id(1)
    offs = grp * gs + tl.arange(0, BLOCK)
    m = tl.arange(0, BLOCK) < gs
    y = tl.load(y_ptr + row * I + offs, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * I + offs, mask=m, other=0.0).to(tl.float32)
    h = y * (z / (1.0 + tl.exp(-z)))
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / gs + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * I + offs, w * (h * inv), mask=m)


def gated_rms_norm(y, z, weight, group_size, eps):
    T, I = y.shape
    out = torch.empty(T, I, dtype=torch.float32, device=y.device)
    if T:
        _gated_kernel[(T, I // group_size)](y, z, weight, out, I, group_size, eps,
                                            BLOCK=triton.next_power_of_2(group_size))
    return out

"""Triton Mamba2 ops on the canonical chunk schedule (see kernels/mamba.py for the contract): the SSD
scan (kernels/triton/mamba_ssd.py: a chunked scan on tensor cores, its canonical order documented
there), causal_conv1d (fp32 taps in order, state rows before the call) and gated_rms_norm (one
program per row and group).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mamba_ssd import mamba_chunk_scan

__all__ = ["causal_conv1d", "gated_rms_norm", "mamba_chunk_scan"]


# ---------------------------------------------------------------- causal conv1d
def token_seq(cu: torch.Tensor, T: int) -> torch.Tensor:
    """The packed sequence of each of the T tokens (int64, on the device; empty sequences skipped):
    the count of sequence ends at or before it. Two launches, no host read."""
    return torch.searchsorted(cu[1:], torch.arange(T, device=cu.device), right=True)


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
    tok_seq = token_seq(cu, T)
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

"""token_logprobs / full_logprobs: log_softmax(logits.float() / T) over the full vocabulary.

One program per row; z = logits_fp32 / T with IEEE division (div_rn, as torch's `/`); the
row's max and sum of exp are kept per lane of a fixed-width block (BLOCK = 4096, 8 warps for
every V) walked from column 0, then combined by one tl.max / tl.sum: the order depends on V
only, never on the number of rows.
"""
import torch
import triton
import triton.language as tl

from . import interpreting

BLOCK_V = 4096
_NEG = -1.0e30


@triton.jit
def _lse_row(x_ptr, row, V, t, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m_vec = tl.full((BLOCK,), -1.0e30, tl.float32)
    s_vec = tl.zeros((BLOCK,), tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + offs
        x = tl.load(x_ptr + row * V + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        z = tl.math.div_rn(x, t)
        m_new = tl.maximum(m_vec, z)
        s_vec = s_vec * tl.exp(m_vec - m_new) + tl.exp(z - m_new)
        m_vec = m_new
    m = tl.max(m_vec, axis=0)
    s = tl.sum(s_vec * tl.exp(m_vec - m), axis=0)
    return m + tl.log(s)


@triton.jit
def _token_logprobs_kernel(x_ptr, tok_ptr, t_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(t_ptr + row)
    lse = _lse_row(x_ptr, row, V, t, BLOCK)
    tok = tl.load(tok_ptr + row).to(tl.int64)
    zt = tl.math.div_rn(tl.load(x_ptr + row * V + tok).to(tl.float32), t)
    tl.store(out_ptr + row, zt - lse)


@triton.jit
def _full_logprobs_kernel(x_ptr, t_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(t_ptr + row)
    lse = _lse_row(x_ptr, row, V, t, BLOCK)
    offs = tl.arange(0, BLOCK)
    for v0 in range(0, V, BLOCK):
        cols = v0 + offs
        x = tl.load(x_ptr + row * V + cols, mask=cols < V, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * V + cols, tl.math.div_rn(x, t) - lse, mask=cols < V)


def _kw(interp):
    return {} if interp else dict(num_warps=8)


def token_logprobs(logits, token_ids, temperature):
    N, V = logits.shape
    out = torch.empty((N,), device=logits.device, dtype=torch.float32)
    if N == 0:
        return out
    interp = interpreting(logits)
    t = temperature.to(device=logits.device, dtype=torch.float32).contiguous()
    _token_logprobs_kernel[(N,)](logits, token_ids.contiguous(), t, out, V, BLOCK=BLOCK_V,
                                 **_kw(interp))
    return out


def full_logprobs(logits, temperature):
    N, V = logits.shape
    out = torch.empty((N, V), device=logits.device, dtype=torch.float32)
    if N == 0:
        return out
    interp = interpreting(logits)
    t = temperature.to(device=logits.device, dtype=torch.float32).contiguous()
    _full_logprobs_kernel[(N,)](logits, t, out, V, BLOCK=BLOCK_V, **_kw(interp))
    return out

"""token_logprobs / full_logprobs: log_softmax(logits.float() / T) over the full vocabulary.

One program per row; z = logits_fp32 / T with IEEE division (div_rn, as torch's `/`); the
row's max and sum of exp are kept per lane of a fixed-width block (the canonical order's
logprobs_block_v = 4096 lanes on logprobs_warps = 8 warps for every V, kernels/order.py, read at
launch) walked from column 0, then combined by one tl.max / tl.sum: the order depends on V
only, never on the number of rows.
"""
import torch
import triton
import triton.language as tl

from .. import order
from . import interpreting

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
def _token_logprobs_kernel(x_ptr, tok_ptr, t_ptr, out_ptr, lse_ptr, V, STORE_LSE: tl.constexpr,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(t_ptr + row)
    lse = _lse_row(x_ptr, row, V, t, BLOCK)
    tok = tl.load(tok_ptr + row).to(tl.int64)
    zt = tl.math.div_rn(tl.load(x_ptr + row * V + tok).to(tl.float32), t)
    tl.store(out_ptr + row, zt - lse)
    if STORE_LSE:  # for the backward; the logprob's bits are the same either way
        tl.store(lse_ptr + row, lse)


@triton.jit
def _token_logprobs_bwd_kernel(x_ptr, tok_ptr, t_ptr, lse_ptr, g_ptr, dx_ptr, V,
                               BLOCK: tl.constexpr):
    # d lp_i / d x_ij = (onehot(tok_i)_j - softmax(x_i / T_i)_j) / T_i; columns split over
    # programs (the row's lse is known), so a few rows still fill the GPU
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    t = tl.load(t_ptr + row)
    lse = tl.load(lse_ptr + row)
    scale = tl.load(g_ptr + row) / t
    tok = tl.load(tok_ptr + row).to(tl.int64)
    x = tl.load(x_ptr + row * V + cols, mask=mask, other=0.0).to(tl.float32)
    p = tl.exp(tl.math.div_rn(x, t) - lse)
    d = scale * (tl.where(cols == tok, 1.0, 0.0) - p)
    tl.store(dx_ptr + row * V + cols, d.to(dx_ptr.dtype.element_ty), mask=mask)


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


def _kw(interp, o):
    return {} if interp else dict(num_warps=o.logprobs_warps)


def token_logprobs(logits, token_ids, temperature, return_lse=False):
    """fp32 [N] logprobs; with ``return_lse``, also the fp32 [N] log-sum-exp of logits / T (what
    the backward needs), at no change to the logprobs' bits."""
    N, V = logits.shape
    out = torch.empty((N,), device=logits.device, dtype=torch.float32)
    lse = torch.empty((N,), device=logits.device, dtype=torch.float32) if return_lse else out
    if N:
        interp = interpreting(logits)
        t = temperature.to(device=logits.device, dtype=torch.float32).contiguous()
        o = order.current()
        _token_logprobs_kernel[(N,)](logits, token_ids.contiguous(), t, out, lse, V,
                                     STORE_LSE=return_lse, BLOCK=o.logprobs_block_v, **_kw(interp, o))
    return (out, lse) if return_lse else out


def token_logprobs_backward(logits, token_ids, temperature, lse, g):
    """d(sum_i g_i * lp_i)/d logits, [N, V] in logits' dtype, from the forward's lse."""
    N, V = logits.shape
    dx = torch.empty_like(logits)
    if N == 0:
        return dx
    interp = interpreting(logits)
    t = temperature.to(device=logits.device, dtype=torch.float32).contiguous()
    block = order.current().logprobs_block_v  # any width gives correct gradients; the forward's
    _token_logprobs_bwd_kernel[(N, triton.cdiv(V, block))](
        logits, token_ids.contiguous(), t, lse, g.to(torch.float32).contiguous(), dx, V,
        BLOCK=block, **({} if interp else dict(num_warps=4)))
    return dx


def full_logprobs(logits, temperature):
    N, V = logits.shape
    out = torch.empty((N, V), device=logits.device, dtype=torch.float32)
    if N == 0:
        return out
    interp = interpreting(logits)
    t = temperature.to(device=logits.device, dtype=torch.float32).contiguous()
    o = order.current()
    _full_logprobs_kernel[(N,)](logits, t, out, V, BLOCK=o.logprobs_block_v, **_kw(interp, o))
    return out

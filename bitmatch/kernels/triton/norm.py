"""RMSNorm and fused add + RMSNorm, one program per row (batch invariant by construction).

Rounding points as HF: y = w * round_dtype(x * rsqrt(mean(x^2) + eps)), the product rounded to
the dtype. The row sum of squares is one tl.sum over a block of fixed width BLOCK =
next_pow2(H) with warps fixed by H (the canonical order's ``norm_warps``, kernels/order.py: the
warps fix tl.sum's tree on the GPU), so its reduction tree depends on H only.
"""
import torch
import triton
import triton.language as tl

from .. import order
from . import interpreting, sm_count


def _block_and_warps(H: int):
    block = triton.next_power_of_2(H)
    return block, order.current().norm_warps_for(block)


@triton.jit
def _rms_kernel(x_ptr, r_ptr, w_ptr, out_ptr, res_out_ptr, H, eps,
                FUSED_ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * H + offs, mask=mask, other=0.0)
    if FUSED_ADD:
        r = tl.load(r_ptr + row * H + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * H + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    rstd = tl.math.rsqrt(var + eps)
    h = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + offs, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def _run(x, res, weight, eps):
    M, H = x.shape
    interp = interpreting(x)
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if res is not None else out
    if M == 0:
        return out, res_out
    block, warps = _block_and_warps(H)
    kw = {} if interp else dict(num_warps=warps)
    _rms_kernel[(M,)](x, res if res is not None else x, weight, out, res_out, H, float(eps),
                      FUSED_ADD=res is not None, BLOCK=block, **kw)
    return out, res_out


def rms_norm(x, weight, eps):
    return _run(x, None, weight, eps)[0]


def fused_add_rms_norm(x, residual, weight, eps):
    return _run(x, residual, weight, eps)


# ---------------------------------------------------------------- backward
# Gradients need to be correct, not invariant: one fp32 pass per row tile, rstd recomputed from
# x (cheaper than saving it), dx rounded once to x's dtype, the weight gradient summed per
# program in fp32 and the [programs, H] partials summed by torch (no atomics).
@triton.jit
def _rms_bwd_kernel(x_ptr, w_ptr, g_ptr, gr_ptr, dx_ptr, dwp_ptr, M, H, eps, ROWS_PER_PROG,
                    HAS_GRES: tl.constexpr, HAS_DW: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    cmask = offs < H
    w = tl.load(w_ptr + offs, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_R, BLOCK), tl.float32)
    r0 = pid.to(tl.int64) * ROWS_PER_PROG
    for i in range(0, ROWS_PER_PROG, BLOCK_R):
        rows = r0 + i + tl.arange(0, BLOCK_R)
        m = (rows < M)[:, None] & cmask[None, :]
        ptrs = rows[:, None] * H + offs[None, :]
        x = tl.load(x_ptr + ptrs, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + ptrs, mask=m, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / H + eps)
        xhat = x * rstd[:, None]
        if HAS_DW:  # d(w * round(xhat))/dw = the rounded xhat the forward multiplied by
            dw_acc += g * xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
        gh = g * w[None, :]
        c = tl.sum(gh * xhat, axis=1) / H
        dx = rstd[:, None] * (gh - xhat * c[:, None])
        if HAS_GRES:
            dx += tl.load(gr_ptr + ptrs, mask=m, other=0.0).to(tl.float32)
        tl.store(dx_ptr + ptrs, dx.to(dx_ptr.dtype.element_ty), mask=m)
    if HAS_DW:
        tl.store(dwp_ptr + pid.to(tl.int64) * H + offs, tl.sum(dw_acc, axis=0), mask=cmask)


def _bwd_tiles(M: int, H: int, device):
    block = triton.next_power_of_2(H)
    block_r = max(1, min(64, 4096 // block))
    warps = 4 if block_r * block <= 2048 else (8 if block_r * block <= 8192 else 16)
    progs = max(1, min(triton.cdiv(M, block_r), 4 * sm_count(device)))
    rows_per_prog = triton.cdiv(triton.cdiv(M, progs), block_r) * block_r
    return block, block_r, warps, triton.cdiv(M, rows_per_prog), rows_per_prog


def rms_norm_backward(x, weight, g, eps, g_res=None, need_dw=True):
    """(dx, dw) of y = rms_norm(x) for upstream g [M, H]; ``g_res`` (the residual output's
    gradient of fused_add_rms_norm, or None) is added to dx. dx in x's dtype, dw in weight's."""
    M, H = x.shape
    interp = interpreting(x)
    dx = torch.empty_like(x)
    if M == 0:
        return dx, (torch.zeros_like(weight) if need_dw else None)
    block, block_r, warps, progs, rpp = _bwd_tiles(M, H, x.device)
    dwp = torch.empty((progs, H), device=x.device, dtype=torch.float32) if need_dw else dx
    kw = {} if interp else dict(num_warps=warps)
    _rms_bwd_kernel[(progs,)](x, weight, g, g_res if g_res is not None else g, dx, dwp, M, H,
                              float(eps), rpp, HAS_GRES=g_res is not None, HAS_DW=need_dw,
                              BLOCK_R=block_r, BLOCK=block, **kw)
    return dx, (dwp.sum(0).to(weight.dtype) if need_dw else None)

"""silu_and_mul: x [M, 2I] = cat(gate, up) -> round(round(silu(gate)) * up), as HF (elementwise)."""
import torch
import triton
import triton.language as tl

from . import interpreting


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(x_ptr + row * 2 * I + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * I + I + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * I + offs, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x):
    M, I2 = x.shape
    I = I2 // 2
    out = torch.empty((M, I), device=x.device, dtype=x.dtype)
    if M == 0 or I == 0:
        return out
    interp = interpreting(x)
    BLOCK = min(1024, triton.next_power_of_2(I))
    kw = {} if interp else dict(num_warps=4)
    _silu_mul_kernel[(M, triton.cdiv(I, BLOCK))](x, out, I, BLOCK=BLOCK, **kw)
    return out


@triton.jit
def _silu_mul_bwd_kernel(x_ptr, g_ptr, dx_ptr, I, BLOCK: tl.constexpr):
    # out = round(round(silu(gate)) * up): d/dup = the rounded silu, d/dgate = g * up * silu'
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    gate = tl.load(x_ptr + row * 2 * I + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * I + I + offs, mask=mask, other=0.0).to(tl.float32)
    go = tl.load(g_ptr + row * I + offs, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    silu = (gate * sig).to(x_ptr.dtype.element_ty).to(tl.float32)
    dgate = go * up * (sig * (1.0 + gate * (1.0 - sig)))
    tl.store(dx_ptr + row * 2 * I + offs, dgate.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + row * 2 * I + I + offs, (go * silu).to(dx_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_backward(x, g):
    """dx [M, 2I] (x's dtype) of silu_and_mul for upstream g [M, I]; one fp32 pass, one rounding."""
    M, I2 = x.shape
    I = I2 // 2
    dx = torch.empty_like(x)
    if M == 0 or I == 0:
        return dx
    interp = interpreting(x)
    BLOCK = min(1024, triton.next_power_of_2(I))
    kw = {} if interp else dict(num_warps=4)
    _silu_mul_bwd_kernel[(M, triton.cdiv(I, BLOCK))](x, g, dx, I, BLOCK=BLOCK, **kw)
    return dx

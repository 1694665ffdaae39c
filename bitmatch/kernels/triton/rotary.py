"""apply_rotary (neox / rotate_half style, HF Llama/Qwen rounding): elementwise per token.

With c, s = cos, sin cast to x.dtype (as HF does), x = [x1, x2] halves:
  out1 = round(round(x1 * c) - round(x2 * s)); out2 = round(round(x2 * c) + round(x1 * s)).
One program per (token, head block); bits depend on the token's own inputs only.
"""
import torch
import triton
import triton.language as tl

from . import interpreting


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, HALF,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mh = offs_h < H
    md = offs_d < HALF
    dt = x_ptr.dtype.element_ty
    c = tl.load(cos_ptr + t * HALF + offs_d, mask=md, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + t * HALF + offs_d, mask=md, other=0.0).to(dt).to(tl.float32)
    base = x_ptr + t * H * 2 * HALF + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    m = mh[:, None] & md[None, :]
    x1 = tl.load(base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    obase = out_ptr + t * H * 2 * HALF + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    if BACKWARD:
        # the transpose of the rotation (x = upstream gradient): rotate by -angle in fp32,
        # one rounding (gradients need not follow the forward's rounding points)
        tl.store(obase, (x1 * c[None, :] + x2 * s[None, :]).to(dt), mask=m)
        tl.store(obase + HALF, (x2 * c[None, :] - x1 * s[None, :]).to(dt), mask=m)
    else:
        a = (x1 * c[None, :]).to(dt).to(tl.float32)
        b = (x2 * s[None, :]).to(dt).to(tl.float32)
        e = (x2 * c[None, :]).to(dt).to(tl.float32)
        f = (x1 * s[None, :]).to(dt).to(tl.float32)
        tl.store(obase, (a - b).to(dt), mask=m)
        tl.store(obase + HALF, (e + f).to(dt), mask=m)


def _apply(x, cos, sin, backward=False):
    T, H, D = x.shape
    out = torch.empty_like(x)
    if T == 0 or H == 0:
        return out
    interp = interpreting(x)
    half = D // 2
    BLOCK_D = triton.next_power_of_2(half)
    BLOCK_H = min(triton.next_power_of_2(H), max(1, 4096 // BLOCK_D))
    kw = {} if interp else dict(num_warps=4)
    _rotary_kernel[(T, triton.cdiv(H, BLOCK_H))](x, cos, sin, out, H, half,
                                                 BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, BACKWARD=backward, **kw)
    return out


def apply_rotary(q, k, cos, sin):
    return _apply(q, cos, sin), _apply(k, cos, sin)


def apply_rotary_backward(gq, gk, cos, sin):
    """(dq, dk) for upstream (gq, gk) (either may be None): the inverse rotation, with cos/sin
    rounded to the gradient's dtype as the forward rounds them."""
    return (None if gq is None else _apply(gq, cos, sin, True),
            None if gk is None else _apply(gk, cos, sin, True))

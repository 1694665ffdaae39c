"""apply_rotary_interleaved (DeepSeek-V4's partial RoPE on interleaved pairs) in one launch.

The reference (kernels/rotary_interleaved.py) is a dozen torch ops, each a kernel of its own on
the GPU (about 16 launches per call, 29 calls per V4 decode step at 6 layers); this is one
program per (token, head block) with the same rounding points, so the bits are the reference's:
c, s = cos, sin rounded to x.dtype; per pair (e, o): out_e = e * c + (-o) * s and
out_o = o * c + e * s in fp32, each product rounded before the add (fused multiply-add is off),
one rounding to x.dtype (``round_to``: the interpreter, too, gets the GPU's bits); ``INVERSE``
negates s (exact). The leading nope channels are copied.
"""
import torch
import triton
import triton.language as tl

from . import interpreting
from ._jit import round_to


@triton.jit
def _rotary_interleaved_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, D, HALF,
                               BLOCK_H: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_R: tl.constexpr,
                               INVERSE: tl.constexpr, BF16: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mh = offs_h < H
    dt = x_ptr.dtype.element_ty
    nope = D - 2 * HALF
    row = t * H * D + offs_h[:, None] * D
    if BLOCK_NOPE > 0:
        offs_n = tl.arange(0, BLOCK_NOPE)
        mn = mh[:, None] & (offs_n[None, :] < nope)
        tl.store(out_ptr + row + offs_n[None, :], tl.load(x_ptr + row + offs_n[None, :], mask=mn), mask=mn)
    offs_r = tl.arange(0, BLOCK_R)
    mr = offs_r < HALF
    c = round_to(tl.load(cos_ptr + t * HALF + offs_r, mask=mr, other=0.0).to(tl.float32), dt, BF16, INTERP)[None, :]
    s = round_to(tl.load(sin_ptr + t * HALF + offs_r, mask=mr, other=0.0).to(tl.float32), dt, BF16, INTERP)[None, :]
    if INVERSE:
        s = -s
    m = mh[:, None] & mr[None, :]
    ev = row + nope + 2 * offs_r[None, :]
    xe = tl.load(x_ptr + ev, mask=m, other=0.0).to(tl.float32)
    xo = tl.load(x_ptr + ev + 1, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + ev, round_to(xe * c + (-xo) * s, dt, BF16, INTERP).to(dt), mask=m)
    tl.store(out_ptr + ev + 1, round_to(xo * c + xe * s, dt, BF16, INTERP).to(dt), mask=m)


def apply_rotary_interleaved(x, cos, sin, inverse):
    """x [T, H, D] contiguous, cos/sin [T, R/2] contiguous -> x rotated (a new tensor)."""
    T, H, D = x.shape
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    half = cos.shape[-1]
    block_r = triton.next_power_of_2(half)
    nope = D - 2 * half
    block_nope = triton.next_power_of_2(nope) if nope else 0
    block_h = min(triton.next_power_of_2(H), max(1, 4096 // max(block_r, block_nope)))
    interp = interpreting(x)
    kw = {} if interp else dict(num_warps=4, enable_fp_fusion=False)
    _rotary_interleaved_kernel[(T, triton.cdiv(H, block_h))](
        x, cos, sin, out, H, D, half, BLOCK_H=block_h, BLOCK_NOPE=block_nope, BLOCK_R=block_r,
        INVERSE=bool(inverse), BF16=x.dtype == torch.bfloat16, INTERP=interp, **kw)
    return out

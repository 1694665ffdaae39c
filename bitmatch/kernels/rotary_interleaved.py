"""apply_rotary_interleaved: DeepSeek-V4's partial RoPE on interleaved channel pairs.

The last ``2 * cos.shape[-1]`` channels of each head are rotated, pairs (2i, 2i+1) by angle i
(HF ``apply_rotary_pos_emb`` of ``modeling_deepseek_v4``: ``x * cos + rotate_half(x) * sin``
with ``rotate_half`` pairing neighbours); the leading "nope" channels pass through untouched.
``inverse=True`` rotates by the negative angle: V4 de-rotates the RoPE slice of the attention
output, because K = V carried the key's rotation into the values.

Rounding points (HF's): cos/sin rounded to x.dtype, then each product and the sum in fp32,
one rounding to x.dtype. These are elementwise IEEE operations (correctly rounded, never
fused), so each element's bits depend on its own inputs alone: the reference backend writes
them as plain torch ops, the Triton backend (kernels/triton/rotary_interleaved.py) as one
launch with fused multiply-add off, the same bits. The gradient is the opposite rotation of the
output's gradient, computed by the same rotation (one autograd node, not a dozen).
"""
from __future__ import annotations

import torch

from ._backend import backend_for, check_float, check_same_device, triton_impl


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                             inverse: bool = False) -> torch.Tensor:
    """x [T, H, D] (or [T, D]); cos/sin [T, R/2] from ``rotary_cos_sin(positions, R, ...)``:
    rotate the trailing R channels of every head by interleaved pairs; returns x's dtype.

    Invariance: elementwise per token; each token's bits depend on its own x and position.
    """
    op = "apply_rotary_interleaved"
    for n, t in (("x", x), ("cos", cos), ("sin", sin)):
        check_float(n, t, op)
    squeeze = x.dim() == 2
    if squeeze:
        x = x.unsqueeze(1)
    if x.dim() != 3:
        raise ValueError(f"{op}: x must be [T, H, D] or [T, D], got shape {tuple(x.shape)}")
    t_, _, d = x.shape
    half = cos.shape[-1] if cos.dim() == 2 else -1
    if cos.shape != (t_, half) or sin.shape != cos.shape or not 0 < 2 * half <= d:
        raise ValueError(f"{op}: cos/sin must be [T={t_}, R/2] with R <= D={d}, got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    check_same_device(op, x=x, cos=cos, sin=sin)
    if x.requires_grad and torch.is_grad_enabled() and not (cos.requires_grad or sin.requires_grad):
        out = _RotaryInterleavedFunction.apply(x, cos, sin, inverse)
    else:
        out = _rotate(x, cos, sin, inverse)
    return out.squeeze(1) if squeeze else out


class _RotaryInterleavedFunction(torch.autograd.Function):
    """The rotation's gradient is the opposite rotation of the output gradient (an orthogonal map
    per pair; the nope channels pass through): one call of the same ops instead of autograd
    recording and walking back a dozen (cos / sin are table rows: no gradient)."""

    @staticmethod
    def forward(ctx, x, cos, sin, inverse):
        ctx.save_for_backward(cos, sin)
        ctx.inverse = inverse
        return _rotate(x, cos, sin, inverse)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _rotate(g.contiguous(), cos, sin, not ctx.inverse), None, None, None


def _rotate(x, cos, sin, inverse):
    """x [T, H, D] rotated (HF's rounding points, see the module docstring)."""
    if backend_for(x) == "triton":
        return triton_impl("rotary_interleaved", "apply_rotary_interleaved")(
            x.contiguous(), cos.contiguous(), sin.contiguous(), inverse)
    return _rotate_reference(x, cos, sin, inverse)


def _rotate_reference(x, cos, sin, inverse):
    d = x.shape[-1]
    half = cos.shape[-1]
    dt = x.dtype
    c = cos.to(dt).float().unsqueeze(1)
    s = sin.to(dt).float().unsqueeze(1)
    if inverse:
        s = -s  # exact: a sign flip
    nope, rope = x[..., : d - 2 * half], x[..., d - 2 * half:]
    xe, xo = rope[..., 0::2].float(), rope[..., 1::2].float()
    # rotate_half(x) = (-x_odd, x_even) per pair; two products and one sum in fp32, as HF
    oe = xe * c + (-xo) * s
    oo = xo * c + xe * s
    rot = torch.stack([oe, oo], dim=-1).flatten(-2).to(dt)
    return torch.cat([nope, rot], dim=-1)

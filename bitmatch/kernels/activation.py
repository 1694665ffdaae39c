"""silu_and_mul: silu(gate) * up with HF's rounding points (silu rounded, then the product).

Reference: exp from elementwise IEEE ops in float64, so each element depends on itself only.
"""
from __future__ import annotations

import torch

from . import _exact
from ._backend import backend_for, check_float, needs_autograd, recompute_grads, triton_impl

F64 = torch.float64


def silu_and_mul_reference(x2d):
    i = x2d.shape[-1] // 2
    g, u = x2d[..., :i].to(F64), x2d[..., i:].to(F64)
    silu = (g / (1.0 + _exact.exp64(-g))).to(x2d.dtype)
    return (silu.to(F64) * u).to(x2d.dtype)


def _plain(x2d):
    i = x2d.shape[-1] // 2
    x = x2d.float()
    return torch.nn.functional.silu(x[..., :i]) * x[..., i:]


def _forward(x2d):
    if backend_for(x2d) == "reference":
        return silu_and_mul_reference(x2d)
    return triton_impl("activation", "silu_and_mul")(x2d)


class SiluAndMulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d):
        ctx.save_for_backward(x2d)
        ctx.backend = backend_for(x2d)
        return _forward(x2d)

    @staticmethod
    def backward(ctx, g):
        (x2d,) = ctx.saved_tensors
        if ctx.backend == "triton":  # one fp32 pass, dx in x's dtype
            return triton_impl("activation", "silu_and_mul_backward")(x2d, g.contiguous())
        return tuple(recompute_grads(_plain, (x2d,), ctx.needs_input_grad, (g,)))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = cat(gate, up) -> silu(gate) * up, [..., I], in x's dtype.

    Invariance: elementwise; each output element depends on its gate and up element only.
    """
    check_float("x", x, "silu_and_mul")
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: x's last dim must be even (gate, up), got {x.shape[-1]}")
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    fn = SiluAndMulFunction.apply if needs_autograd(x) else _forward
    return fn(x2d).reshape(*x.shape[:-1], x.shape[-1] // 2)

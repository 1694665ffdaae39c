"""rms_norm and fused_add_rms_norm, row-invariant.

Rounding points follow HF's RMSNorm: normalized = round_dtype(x * rsqrt(mean(x^2) + eps)),
out = round_dtype(weight * normalized); the fused variant first rounds the residual sum,
residual_out = round_dtype(x + residual), exactly where HF's decoder layer rounds it.
Reference: squares in float64 (exact for bf16 and fp32) summed by a fixed tree.
"""
from __future__ import annotations

import torch

from . import _exact
from ._backend import backend_for, check_float, check_same_device, needs_autograd, recompute_grads, triton_impl

F64 = torch.float64


def rms_norm_reference(x2d, weight, eps):
    x64 = x2d.to(F64)
    mean = _exact.tree_sum(x64 * x64, -1) / x2d.shape[-1]
    inv = 1.0 / torch.sqrt(mean + eps)
    normed = (x64 * inv.unsqueeze(-1)).to(x2d.dtype)
    return (weight.to(F64) * normed.to(F64)).to(x2d.dtype)


def _rms_plain(x2d, weight, eps):
    x = x2d.float()
    return weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _check(op, x, weight, residual=None):
    check_float("x", x, op)
    check_float("weight", weight, op)
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"{op}: weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if residual is not None:
        check_float("residual", residual, op)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"{op}: residual must match x in shape and dtype, got "
                             f"{tuple(residual.shape)} {residual.dtype} vs {tuple(x.shape)} {x.dtype}")
    check_same_device(op, x=x, weight=weight, residual=residual)


def _rms_backward(ctx, x2d, weight, g, g_res, need_x, need_w):
    """(dx + g_res, dw) of rms_norm(x2d) for upstream g: the Triton backward on CUDA, the plain
    fp32 recompute on the reference backend."""
    if g is None:
        return g_res, None
    if ctx.backend == "triton":
        return triton_impl("norm", "rms_norm_backward")(x2d, weight, g.contiguous(), ctx.eps,
                                                         g_res, need_dw=need_w)
    gx, gw = recompute_grads(lambda a, b: _rms_plain(a, b, ctx.eps), (x2d, weight),
                             (need_x, need_w), (g,))
    return (gx if g_res is None or gx is None else (gx.float() + g_res.float()).to(gx.dtype)), gw


def _rms_forward(x2d, weight, eps):
    if backend_for(x2d) == "reference":
        return rms_norm_reference(x2d, weight, eps)
    return triton_impl("norm", "rms_norm")(x2d, weight, eps)


def _fused_forward(x2d, r2d, weight, eps):
    """(out, res): the fused Triton kernel, or the exact add then the reference norm."""
    if backend_for(x2d) == "reference":
        res = _add_round(x2d, r2d)
        return rms_norm_reference(res, weight, eps), res
    return triton_impl("norm", "fused_add_rms_norm")(x2d, r2d, weight, eps)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, eps):
        ctx.save_for_backward(x2d, weight)
        ctx.eps = eps
        ctx.backend = backend_for(x2d)
        return _rms_forward(x2d, weight, eps)

    @staticmethod
    def backward(ctx, g):
        x2d, weight = ctx.saved_tensors
        gx, gw = _rms_backward(ctx, x2d, weight, g, None, *ctx.needs_input_grad[:2])
        return gx, gw, None


class FusedAddRMSNormFunction(torch.autograd.Function):
    """(rms_norm(res), res) with res = round(x + residual); one gradient for x and residual."""

    @staticmethod
    def forward(ctx, x2d, r2d, weight, eps):
        ctx.set_materialize_grads(False)
        ctx.eps = eps
        ctx.backend = backend_for(x2d)
        out, res = _fused_forward(x2d, r2d, weight, eps)
        ctx.save_for_backward(res, weight)
        return out, res

    @staticmethod
    def backward(ctx, g, g_res):
        res, weight = ctx.saved_tensors
        nx, nr, nw, _ = ctx.needs_input_grad
        gsum, gw = _rms_backward(ctx, res, weight, g, g_res, nx or nr, nw)
        # d res / d x = d res / d residual = 1: the same gradient (autograd's own add does this)
        return gsum, gsum, gw, None


def _add_round(x, residual):
    # the sum in float is exact-rounded elementwise, the same bits as the fused kernel's
    return (x.float() + residual.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, HF rounding points, output in x's dtype.

    Invariance: each row's bits depend only on that row and the weight.
    """
    _check("rms_norm", x, weight)
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    fn = RMSNormFunction.apply if needs_autograd(x, weight) else _rms_forward
    return fn(x2d, weight.contiguous(), float(eps)).reshape(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(round(x + residual)), round(x + residual)).

    Invariance: elementwise add then a row-invariant norm; each row depends on its own inputs.
    """
    _check("fused_add_rms_norm", x, weight, residual)
    H = x.shape[-1]
    fn = FusedAddRMSNormFunction.apply if needs_autograd(x, residual, weight) else _fused_forward
    out, res = fn(x.reshape(-1, H).contiguous(), residual.reshape(-1, H).contiguous(), weight.contiguous(),
                  float(eps))
    return out.reshape(x.shape), res.reshape(x.shape)

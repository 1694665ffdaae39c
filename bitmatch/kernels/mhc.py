"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): hc_pre, hc_post, hc_head.

The residual is N = hc_mult streams per token, x [T, N, D]. Canonical order (HF's formulas
and rounding points, with the reductions fixed):

hc_pre (before an attention / MLP block):
    f      = fp32(x).view(T, N*D);  r = fp32(1 / sqrt(tree_sum(f^2) / (N*D) + norm_eps));  f = f * r
    mix    = linear(f, fn)                          fp32, ``kernels.linear`` (exact K order)
    pre    = sigmoid(mix[:N] * scale0 + base[:N]) + eps            (exp64, fp32 roundings)
    post   = 2 * sigmoid(mix[N:2N] * scale1 + base[N:2N])
    comb   = softmax_row(mix[2N:] * scale2 + base[2N:]) + eps      [N, N]
    comb  /= colsum + eps; then (iters - 1) x { comb /= rowsum + eps; comb /= colsum + eps }
             (every sum over N streams added in stream order 0..N-1, in fp32)
    block input = round_dtype(sum_n pre[n] * fp32(x[n]))  (stream order, fp32)
hc_post (after the block, output y [T, D]):
    x'[k]  = round(round(post[k] * y) + round(sum_j comb[j, k] * x[j]))   (dtype, stream order)
hc_head (after the last layer): pre of its own fn/base/scale, then the collapse.

Every reduction is a fixed-order fold over one token's own values: a token's bits depend on
that token alone. Sinkhorn runs in a fixed iteration order (column first, as HF).

Reference backend (CPU): the order above, exactly (exp64, the K order of ``kernels.linear``'s
reference, an exact tree for the sum of squares). Backward: a plain fp32 torch recompute
(gradients are held to float64 within tolerance, not to bits); hc_pre's on the Triton backend runs
the gates and Sinkhorn steps of every token in one launch (kernels/triton/mhc.py hc_pre_backward).

Triton backend (CUDA; kernels/triton/mhc.py): hc_pre / hc_head in two launches, hc_post in one,
one token's values per fold. Its canonical order differs from the reference's where a fused
kernel wants it (DeepSeek's own factoring, ``linear(x, fn) * rsqrt``):
    K = N*D split into chunks of ``hc_k_chunk`` (the active ``kernels.order``), chunk s covering
      k in [s*chunk, (s+1)*chunk); in each chunk
      dot_s[j] = fp32 fused multiply-add chain over k in order, from 0.0, of fp32(x[k]) * fn[j, k]
      sq_s     = lanes l = 0..hc_block_k-1, lane l the fp32 sum (k order, from 0.0) of x[k]^2
                 over the chunk's k = l (mod hc_block_k); then the lanes added in lane order
    dot[j] = dot_0[j] + dot_1[j] + ...;  ssq = sq_0 + sq_1 + ...           (chunk order)
    r      = 1 / sqrt_rn(ssq / K + norm_eps)                                (IEEE / and sqrt)
    mix[j] = dot[j] * r
    gates, softmax, Sinkhorn and collapse as above, in fp32 with tl.exp (sigmoid = 1 / (1 +
    exp(-z))), every sum over N streams a stream-order fold, no fused multiply-add outside the dot
hc_post: the reference's formula and rounding points (no exp, no reduction but the stream-order
fold: the reference's bits). No Triton kernel reads a value back to the host (graph-capturable).
"""
from __future__ import annotations

import torch

from . import _exact
from ._backend import backend_for, check_float, check_same_device, needs_autograd, recompute_grads, triton_impl
from .linear import linear

F64 = torch.float64


def _sigmoid64(z):
    return (1.0 / (1.0 + _exact.exp64(-z.to(F64)))).float()


def _ordered_sum(t, dim):
    """fp32 sum over a small axis in index order (elementwise adds)."""
    t = t.movedim(dim, 0)
    acc = t[0]
    for i in range(1, t.shape[0]):
        acc = acc + t[i]
    return acc


def _mix_reference(x, fn, base, scale, norm_eps):
    T, n, d = x.shape
    f = x.reshape(T, n * d).float()
    ms = _exact.tree_sum(f.to(F64) * f.to(F64), -1) / (n * d)
    r = (1.0 / torch.sqrt(ms + norm_eps)).float()
    f = f * r.unsqueeze(-1)
    return linear(f, fn.float())  # row-invariant fp32 linear (the reference backend here)


def _collapse(x, pre):
    """round_dtype(sum_n pre[:, n] * fp32(x[:, n])), stream order."""
    acc = pre[:, 0:1] * x[:, 0].float()
    for i in range(1, x.shape[1]):
        acc = acc + pre[:, i:i + 1] * x[:, i].float()
    return acc.to(x.dtype)


def hc_pre_reference(x, fn, base, scale, iters, eps, norm_eps):
    T, n, _ = x.shape
    mix = _mix_reference(x, fn, base, scale, norm_eps)
    b = base.float()
    s = scale.float()
    pre = _sigmoid64(mix[:, :n] * s[0] + b[:n]) + eps
    post = 2 * _sigmoid64(mix[:, n:2 * n] * s[1] + b[n:2 * n])
    z = (mix[:, 2 * n:] * s[2] + b[2 * n:]).view(T, n, n).to(F64)
    e = _exact.exp64(z - z.amax(-1, keepdim=True))
    comb = (e / _ordered_sum(e, -1).unsqueeze(-1)).float() + eps
    comb = comb / (_ordered_sum(comb, -2).unsqueeze(-2) + eps)
    for _ in range(iters - 1):
        comb = comb / (_ordered_sum(comb, -1).unsqueeze(-1) + eps)
        comb = comb / (_ordered_sum(comb, -2).unsqueeze(-2) + eps)
    return post, comb, _collapse(x, pre)


def _hc_pre_plain(x, fn, base, scale, iters, eps, norm_eps):
    T, n, d = x.shape
    f = x.reshape(T, n * d).float()
    f = f * torch.rsqrt(f.square().mean(-1, keepdim=True) + norm_eps)
    mix = f @ fn.float().t()
    pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = torch.softmax((mix[:, 2 * n:] * scale[2] + base[2 * n:]).view(T, n, n), -1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return post, comb, (pre.unsqueeze(-1) * x.float()).sum(1)


class HcPreFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, base, scale, iters, eps, norm_eps):
        ctx.save_for_backward(x, fn, base, scale)
        ctx.args = (iters, eps, norm_eps)
        ctx.backend = backend_for(x)  # the backward thread does not see use_backend
        out = _pre_forward(x, fn, base, scale, iters, eps, norm_eps)
        return out

    @staticmethod
    def backward(ctx, gpost, gcomb, gcol):
        x, fn, base, scale = ctx.saved_tensors
        if ctx.backend != "reference":  # one launch for the gates and Sinkhorn steps of every token
            grads = triton_impl("mhc", "hc_pre_backward")(x, fn, base, scale, *ctx.args, gpost, gcomb, gcol)
            grads = [g if need else None for g, need in zip(grads, ctx.needs_input_grad[:4])]
        else:
            grads = recompute_grads(lambda a, b, c, d: _hc_pre_plain(a, b, c, d, *ctx.args), (x, fn, base, scale),
                                    ctx.needs_input_grad[:4], (gpost, gcomb, gcol))
        return (*grads, None, None, None)


def _pre_forward(x, fn, base, scale, iters, eps, norm_eps):
    if backend_for(x) == "reference":
        return hc_pre_reference(x, fn, base, scale, iters, eps, norm_eps)
    return triton_impl("mhc", "hc_pre")(x, fn, base, scale, iters, eps, norm_eps)


def _check(op, x, fn, base, scale, n_out, n_scale):
    for name, t in (("x", x), ("fn", fn), ("base", base), ("scale", scale)):
        check_float(name, t, op)
    if x.dim() != 3:
        raise ValueError(f"{op}: x must be [T, N, D] (hc_mult streams), got {tuple(x.shape)}")
    n, d = x.shape[1:]
    if fn.shape != (n_out, n * d) or base.shape != (n_out,) or scale.shape != (n_scale,):
        raise ValueError(f"{op}: fn must be [{n_out}, N*D={n * d}], base [{n_out}], scale [{n_scale}]; got "
                         f"{tuple(fn.shape)}, {tuple(base.shape)}, {tuple(scale.shape)}")
    check_same_device(op, x=x, fn=fn, base=base, scale=scale)


def hc_pre(x, fn, base, scale, *, iters: int, eps: float, norm_eps: float):
    """x [T, N, D] streams; fn [(2+N)*N, N*D], base [(2+N)*N], scale [3] (fp32) ->
    (post [T, N] fp32, comb [T, N, N] fp32 doubly stochastic, block input [T, D] x.dtype).

    Invariance: each token's outputs depend only on its own streams (fixed-order reductions).
    """
    n = x.shape[1] if x.dim() == 3 else 0
    _check("hc_pre", x, fn, base, scale, (2 + n) * n, 3)
    if not isinstance(iters, int) or iters < 1:
        raise ValueError(f"hc_pre: iters (hc_sinkhorn_iters) must be an int >= 1, got {iters!r}")
    args = (x.contiguous(), fn.contiguous(), base.contiguous(), scale.contiguous(), iters, float(eps), float(norm_eps))
    if needs_autograd(x, fn, base, scale):
        return HcPreFunction.apply(*args)
    return _pre_forward(*args)


def hc_post_reference(x, y, post, comb):
    dt = x.dtype
    p = post.to(dt).float()
    c = comb.to(dt).float()
    outs = []
    for k in range(x.shape[1]):
        mixed = c[:, 0, k:k + 1] * x[:, 0].float()
        for j in range(1, x.shape[1]):
            mixed = mixed + c[:, j, k:k + 1] * x[:, j].float()
        expanded = (p[:, k:k + 1] * y.float()).to(dt)
        outs.append((expanded.float() + mixed.to(dt).float()).to(dt))
    return torch.stack(outs, 1)


def _post_forward(x, y, post, comb):
    if backend_for(x) == "reference":
        return hc_post_reference(x, y, post, comb)
    return triton_impl("mhc", "hc_post")(x, y, post, comb)


class HcPostFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, post, comb):
        ctx.save_for_backward(x, y, post, comb)
        return _post_forward(x, y, post, comb)

    @staticmethod
    def backward(ctx, g):
        # the fp32 gradients of out[k] = post[k] y + sum_j comb[j, k] x[j] in closed form: four
        # products, not autograd through a recompute
        x, y, post, comb = ctx.saved_tensors
        g = g.float()
        need = ctx.needs_input_grad
        gx = torch.bmm(comb.float(), g).to(x.dtype) if need[0] else None
        gy = torch.bmm(post.float().unsqueeze(1), g).squeeze(1).to(y.dtype) if need[1] else None
        gpost = torch.bmm(g, y.float().unsqueeze(2)).squeeze(2).to(post.dtype) if need[2] else None
        gcomb = torch.bmm(x.float(), g.transpose(1, 2)).to(comb.dtype) if need[3] else None
        return gx, gy, gpost, gcomb


def hc_post(x, y, post, comb):
    """x [T, N, D] streams, y [T, D] block output, post [T, N], comb [T, N, N] -> new streams
    [T, N, D] in x.dtype: post[k] * y + sum_j comb[j, k] * x[j] (HF's roundings, stream order).

    Invariance: elementwise per token with a fixed stream fold (no reduction library call).
    """
    op = "hc_post"
    for name, t in (("x", x), ("y", y), ("post", post), ("comb", comb)):
        check_float(name, t, op)
    if x.dim() != 3:
        raise ValueError(f"{op}: x must be [T, N, D] (hc_mult streams), got {tuple(x.shape)}")
    T, n, d = x.shape
    if y.shape != (T, d) or post.shape != (T, n) or comb.shape != (T, n, n):
        raise ValueError(f"{op}: y [T, D], post [T, N], comb [T, N, N] for x {tuple(x.shape)}; got "
                         f"{tuple(y.shape)}, {tuple(post.shape)}, {tuple(comb.shape)}")
    check_same_device(op, x=x, y=y, post=post, comb=comb)
    args = (x.contiguous(), y.contiguous(), post.contiguous(), comb.contiguous())
    if needs_autograd(*args):
        return HcPostFunction.apply(*args)
    return _post_forward(*args)


def _head_reference(x, fn, base, scale, eps, norm_eps):
    mix = _mix_reference(x, fn, base, scale, norm_eps)
    pre = _sigmoid64(mix * scale.float()[0] + base.float()) + eps
    return _collapse(x, pre)


def _head_plain(x, fn, base, scale, eps, norm_eps):
    T, n, d = x.shape
    f = x.reshape(T, n * d).float()
    f = f * torch.rsqrt(f.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid((f @ fn.float().t()) * scale[0] + base) + eps
    return (pre.unsqueeze(-1) * x.float()).sum(1)


def _head_forward(x, fn, base, scale, eps, norm_eps):
    if backend_for(x) == "reference":
        return _head_reference(x, fn, base, scale, eps, norm_eps)
    return triton_impl("mhc", "hc_head")(x, fn, base, scale, eps, norm_eps)


class HcHeadFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, base, scale, eps, norm_eps):
        ctx.save_for_backward(x, fn, base, scale)
        ctx.args = (eps, norm_eps)
        return _head_forward(x, fn, base, scale, eps, norm_eps)

    @staticmethod
    def backward(ctx, g):
        x, fn, base, scale = ctx.saved_tensors
        grads = recompute_grads(lambda a, b, c, d: _head_plain(a, b, c, d, *ctx.args), (x, fn, base, scale),
                                ctx.needs_input_grad[:4], (g,))
        return (*grads, None, None)


def hc_head(x, fn, base, scale, *, eps: float, norm_eps: float):
    """x [T, N, D] -> [T, D] in x.dtype: the final collapse of the streams (fn [N, N*D], base [N],
    scale [1], fp32).

    Invariance: each token's output depends only on its own streams.
    """
    n = x.shape[1] if x.dim() == 3 else 0
    _check("hc_head", x, fn, base, scale, n, 1)
    args = (x.contiguous(), fn.contiguous(), base.contiguous(), scale.contiguous(), float(eps), float(norm_eps))
    if needs_autograd(x, fn, base, scale):
        return HcHeadFunction.apply(*args)
    return _head_forward(*args)

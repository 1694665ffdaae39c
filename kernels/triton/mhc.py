"""hc_pre / hc_head on the Triton backend: the reference's structure in fp32 with ``torch.exp``
and the invariant Triton ``linear`` for the mixes (kernels/mhc.py states the order). The norm's
sum of squares is a fixed fold (``_exact.tree_sum``), the Sinkhorn sums and the collapse are
stream-order loops of elementwise adds: every token's bits depend on that token alone.
"""
import torch

from .._exact import tree_sum
from ..linear import linear
from ..mhc import _collapse, _ordered_sum


def _mix(x, fn, norm_eps):
    T, n, d = x.shape
    f = x.reshape(T, n * d).float()
    r = 1.0 / torch.sqrt(tree_sum(f * f, -1) / (n * d) + norm_eps)
    return linear(f * r.unsqueeze(-1), fn.float())


def hc_pre(x, fn, base, scale, iters, eps, norm_eps):
    T, n, _ = x.shape
    mix = _mix(x, fn, norm_eps)
    b, s = base.float(), scale.float()
    pre = torch.sigmoid(mix[:, :n] * s[0] + b[:n]) + eps
    post = 2 * torch.sigmoid(mix[:, n:2 * n] * s[1] + b[n:2 * n])
    z = (mix[:, 2 * n:] * s[2] + b[2 * n:]).view(T, n, n)
    e = torch.exp(z - z.amax(-1, keepdim=True))
    comb = e / _ordered_sum(e, -1).unsqueeze(-1) + eps
    comb = comb / (_ordered_sum(comb, -2).unsqueeze(-2) + eps)
    for _ in range(iters - 1):
        comb = comb / (_ordered_sum(comb, -1).unsqueeze(-1) + eps)
        comb = comb / (_ordered_sum(comb, -2).unsqueeze(-2) + eps)
    return post, comb, _collapse(x, pre)


def hc_head(x, fn, base, scale, eps, norm_eps):
    pre = torch.sigmoid(_mix(x, fn, norm_eps) * scale.float()[0] + base.float()) + eps
    return _collapse(x, pre)

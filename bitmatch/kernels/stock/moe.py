"""Stock MoE, HF's routing and expert loop: fp32 scores, ``torch.topk``, ``index_add_`` in expert order."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_scores(logits, scoring):
    """fp32 router scores as HF computes them: softmax, sigmoid or sqrt(softplus) (DeepSeek-V4)."""
    z = logits.float()
    if scoring == "softmax":
        return torch.softmax(z, -1)
    if scoring == "sigmoid":
        return torch.sigmoid(z)
    return F.softplus(z).sqrt()


def moe_route(router_logits, top_k, *, scoring="softmax", renormalize=False, correction_bias=None, scaling=1.0):
    p = moe_scores(router_logits, scoring)
    _, ids = torch.topk(p if correction_bias is None else p + correction_bias.float(), top_k, dim=-1)
    w = p.gather(1, ids)
    return (w / w.sum(-1, keepdim=True) if renormalize else w) * scaling, ids


def moe_experts(x, ids, weights, w_in, w_out, *, activation="swiglu", swiglu_limit=None):
    """HF's loop: each hit expert's rows, ``index_add_`` in expert order (in x.dtype)."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, r = torch.where(ids == e)
        h = F.linear(x[tok], w_in[e])
        if activation == "swiglu":
            g, u = h.chunk(2, -1)
            if swiglu_limit is not None:
                g, u = g.clamp(max=swiglu_limit), u.clamp(-swiglu_limit, swiglu_limit)
            a = F.silu(g) * u
        else:
            a = torch.relu(h).square()
        out.index_add_(0, tok, (F.linear(a, w_out[e]) * weights[tok, r, None].to(x.dtype)).to(x.dtype))
    return out


def moe_combine(y, weights):
    """The weighted sum of each token's expert rows in torch's own reduction order (in y's dtype)."""
    return (y * weights.unsqueeze(-1).to(y.dtype)).sum(1)

"""``stock_ops()``: the bitmatch engine on stock ops (cuBLAS F.linear, torch norms / activation /
rotary as HF writes them, SDPA attention over K/V gathered from the paged cache, fp32
log_softmax(logits / T)), for benchmarks/gpu_e2e.py's "same engine with stock ops" baseline:
every bitmatch module's reference to a bitmatch.kernels op is swapped inside the block."""
import contextlib
import sys

import torch
import torch.nn.functional as F


def _rms(x, w, eps):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _fused(x, r, w, eps):
    s = x + r
    return _rms(s, w, eps), s


def _rotary(q, k, cos, sin):
    c, s = torch.cat([cos, cos], -1).to(q.dtype)[:, None], torch.cat([sin, sin], -1).to(q.dtype)[:, None]

    def rot(x):
        h = x.shape[-1] // 2
        return x * c + torch.cat([-x[..., h:], x[..., :h]], -1) * s
    return rot(q), rot(k)


def _sdpa(q, k, v, scale, causal, mask=None):  # q [B, Tq, Hq, D], k/v [B, L, Hkv, D]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                       is_causal=causal, scale=scale, enable_gqa=True)
    return o.transpose(1, 2)


def _prefill(q, k, v, cu, scale, causal=True, sliding_window=None):
    if sliding_window is not None:
        raise NotImplementedError("stock_ops: sliding windows")
    c = cu.tolist()
    return torch.cat([_sdpa(q[None, a:b], k[None, a:b], v[None, a:b], scale, causal)[0]
                      for a, b in zip(c[:-1], c[1:])])


def _paged(q, kc, vc, bt, qsl, lens, scale, sliding_window=None):
    """A stock paged attention: K/V gathered from the cache, then SDPA. All rows decode (one query
    each) or equal fresh prefills: one batched SDPA call; otherwise one call per sequence."""
    if sliding_window is not None:
        raise NotImplementedError("stock_ops: sliding windows")
    B, bs = lens.shape[0], kc.shape[1]
    ql, sl = (qsl[1:] - qsl[:-1]).tolist(), lens.tolist()
    L = max(sl)
    nblk = -(-L // bs)

    def gather(cache):
        return cache[bt[:, :nblk].long()].reshape(B, nblk * bs, *cache.shape[2:])[:, :L]
    if all(x == 1 for x in ql):
        mask = (torch.arange(L, device=q.device)[None] < lens[:, None])[:, None, None]
        return _sdpa(q[:, None], gather(kc), gather(vc), scale, False, mask)[:, 0]
    if all(x == L for x in ql) and all(x == L for x in sl):
        return _sdpa(q.view(B, L, *q.shape[1:]), gather(kc), gather(vc), scale, True).reshape(q.shape)
    kf, vf = kc.reshape(-1, *kc.shape[2:]), vc.reshape(-1, *vc.shape[2:])
    out, s = [], 0
    for b in range(B):
        pos = torch.arange(sl[b], device=q.device)
        slots = bt[b, pos // bs].long() * bs + pos % bs
        qb = q[None, s:s + ql[b]]
        mask = (pos[None] <= pos[sl[b] - ql[b]:, None])[None, None]
        out.append(_sdpa(qb, kf[slots][None], vf[slots][None], scale, False, mask)[0])
        s += ql[b]
    return torch.cat(out)


def _temps(logits, t):
    t = t if isinstance(t, torch.Tensor) else torch.tensor(float(t), device=logits.device)
    return t.to(logits.device, torch.float32).reshape(-1, 1)


def _token_lp(logits, tok, t=1.0):
    return torch.log_softmax(logits.float() / _temps(logits, t), -1).gather(1, tok.long()[:, None])[:, 0]


class _StockTokenLogprobs:
    @staticmethod
    def apply(logits, tok, t):
        return _token_lp(logits, tok, t)


STOCK = {"linear": lambda x, w, b=None: F.linear(x, w, b), "rms_norm": _rms, "fused_add_rms_norm": _fused,
         "silu_and_mul": lambda x: F.silu(x[..., :x.shape[-1] // 2]) * x[..., x.shape[-1] // 2:],
         "apply_rotary": _rotary, "attention_prefill": _prefill, "attention_paged": _paged,
         "token_logprobs": _token_lp,
         "full_logprobs": lambda lg, t=1.0: torch.log_softmax(lg.float() / _temps(lg, t), -1)}


@contextlib.contextmanager
def stock_ops():
    """Every bitmatch module's reference to a bitmatch.kernels op (and the sampler's
    TokenLogprobsFunction) swapped for the stock torch equivalent inside the block."""
    import bitmatch.kernels as K
    import bitmatch.kernels.logprobs as KL
    orig = {n: getattr(K, n) for n in STOCK}
    swaps = [(KL, "TokenLogprobsFunction", KL.TokenLogprobsFunction, _StockTokenLogprobs)]
    for mod in [m for n, m in list(sys.modules.items()) if n.startswith("bitmatch") and m is not None]:
        for n, f in orig.items():
            for attr, val in list(vars(mod).items()):
                if val is f:
                    swaps.append((mod, attr, f, STOCK[n]))
    for mod, attr, _, new in swaps:
        setattr(mod, attr, new)
    try:
        yield len(swaps)
    finally:
        for mod, attr, old, _ in swaps:
            setattr(mod, attr, old)

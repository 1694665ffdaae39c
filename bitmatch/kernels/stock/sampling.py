"""Stock logprobs and sampling, vLLM's sampler: fp32 ``log_softmax(logits / T)``, the sorted top-k / top-p
mask, an inverse-CDF draw over an fp32 cumsum, a torch generator per seeded request."""
from __future__ import annotations

import torch

from ._common import F32


def _temps(logits, temperature):
    """[N, 1] fp32 temperatures (a float, a 1-element or an [N] tensor), as vLLM's sampler holds them."""
    t = temperature if isinstance(temperature, torch.Tensor) else torch.tensor(float(temperature))
    return t.to(logits.device, F32).reshape(-1, 1)


def full_logprobs(logits, temperature=1.0):
    """fp32 ``log_softmax(logits / T)`` with T a per-row tensor (a true division)."""
    return torch.log_softmax(logits.float() / _temps(logits, temperature), -1)


def token_logprobs(logits, token_ids, temperature=1.0):
    return full_logprobs(logits, temperature).gather(1, token_ids.long().reshape(-1, 1))[:, 0]


def top_k_top_p_mask(logits, temperature=1.0, top_k=None, top_p=None):
    """vLLM's torch top-k / top-p: an ascending sort, the k-th value as a threshold, top-p on an
    fp32 cumsum of the sorted probabilities (its sum order is the library's)."""
    n, vocab = logits.shape
    if top_k is None and top_p is None:
        return torch.ones((n, vocab), dtype=torch.bool, device=logits.device)
    z = logits.float() / _temps(logits, temperature)
    vals, idx = z.sort(-1)
    drop = torch.zeros_like(vals, dtype=torch.bool)
    if top_k is not None:
        k = torch.as_tensor(top_k, device=z.device).long().expand(n)
        k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
        drop |= vals < vals.gather(1, (vocab - k).unsqueeze(1))
    if top_p is not None:
        p = torch.as_tensor(top_p, device=z.device, dtype=F32).expand(n).unsqueeze(1)
        cum = vals.masked_fill(drop, float("-inf")).softmax(-1).cumsum(-1)
        tail = cum <= 1 - p
        tail[:, -1] = False  # at least one token
        drop |= tail
    return torch.empty_like(drop).scatter_(1, idx, ~drop)


def apply_top_k_top_p(logits, temperature=1.0, top_k=None, top_p=None):
    if top_k is None and top_p is None:
        return logits
    return logits.masked_fill(~top_k_top_p_mask(logits, temperature, top_k, top_p), float("-inf"))


def categorical_sample(logits, temperature, uniforms, greedy=None):
    """Inverse CDF over an fp32 cumsum of ``softmax(logits / T)``; ``greedy`` rows take the argmax."""
    probs = (logits.float() / _temps(logits, temperature)).softmax(-1)
    cdf = probs.cumsum(-1)
    u = uniforms.to(cdf.device, F32).unsqueeze(1) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max(logits.shape[1] - 1)
    if greedy is not None:
        tokens = torch.where(greedy.to(tokens.device, torch.bool), logits.float().argmax(-1), tokens)
    return tokens


def uniform_noise(seeds, index):
    """A torch generator per seeded request (how a stock engine keeps one): draw ``index`` of the
    stream seeded by ``seed``, float64."""
    out = [torch.rand(i + 1, generator=torch.Generator().manual_seed(s), dtype=torch.float64)[-1]
           for s, i in zip(seeds.tolist(), index.tolist())]
    return (torch.stack(out) if out else torch.empty(0, dtype=torch.float64)).to(seeds.device)

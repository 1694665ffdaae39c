"""Trainer-side logprobs: the same forward, logits and log_softmax as the engine's."""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from bitmatch.models import compute_logits, forward_hidden, pack, unwrap_causal_lm
from bitmatch.models.dense import default_compute_dtype

DEFAULT_LOGIT_ELEMENTS = 1 << 25  # fp32 logits elements per chunk (128 MiB)


def _chunk_logprobs(lm, dtype, temperature, hidden, targets, entropy=False):
    import bitmatch.kernels as K

    logits = compute_logits(lm, hidden, compute_dtype=dtype)
    lp = K.token_logprobs(logits, targets, temperature)
    if not entropy:
        return lp
    # entropy of the same distribution (a metric / bonus: exact bits not required)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return lp, -(logp.exp() * logp).sum(-1)


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   temperature: float = 1.0, chunk_rows: int | None = None,
                   compute_dtype: torch.dtype | None = None, return_entropy: bool = False):
    """fp32 [B, L-1]: logprob of ``input_ids[:, 1:]`` given its prefix (0 where the token is padding
    or the first real token of its row), full-vocabulary ``log_softmax(logits.float() / T)``.

    Left or right padding. The real tokens are packed (positions from 0 at the first real
    token) and run through ``bitmatch.models.forward_hidden``; logits are computed over row
    chunks of ``chunk_rows`` (default: about 2**25 logits per chunk) and, with autograd on,
    recomputed in backward (checkpointed), so the whole [B, L, V] never exists. The bits do
    not depend on ``chunk_rows``. ``return_entropy``: also return the fp32 [B, L-1] entropy of
    ``softmax(logits.float() / T)`` at the same positions (with gradients): ``(logprobs, entropy)``.
    """
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() != 1:
            raise ValueError("token_logprobs: temperature must be a float")
        temperature = float(temperature)
    temperature = float(temperature)
    if not temperature > 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"token_logprobs: chunk_rows must be >= 1, got {chunk_rows}")
    lm = unwrap_causal_lm(model)
    dtype = compute_dtype if compute_dtype is not None else default_compute_dtype(lm)
    dev = lm.lm_head.weight.device
    input_ids = input_ids.to(dev)
    if attention_mask is not None:
        attention_mask = attention_mask.to(dev)
    B, L = input_ids.shape
    p = pack(input_ids, attention_mask)
    out = torch.zeros((B, max(L - 1, 0)), dtype=torch.float32, device=dev)
    empty = (out, torch.zeros_like(out)) if return_entropy else out
    if p.input_ids.numel() == 0:
        return empty
    hidden = forward_hidden(lm, p.input_ids, p.context(), compute_dtype=dtype)
    src = (~p.seq_end).nonzero(as_tuple=True)[0]   # token predicting the next one
    if src.numel() == 0:
        return empty
    tgt = src + 1
    targets = p.input_ids[tgt]
    h = hidden[src]
    V = lm.lm_head.weight.shape[0]
    rows = chunk_rows or max(1, DEFAULT_LOGIT_ELEMENTS // V)
    pieces = []
    for a in range(0, h.shape[0], rows):
        hc, tc = h[a:a + rows], targets[a:a + rows]
        if torch.is_grad_enabled() and hc.requires_grad:
            pieces.append(checkpoint(_chunk_logprobs, lm, dtype, temperature, hc, tc, return_entropy,
                                     use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(lm, dtype, temperature, hc, tc, return_entropy))
    at = (p.rows[tgt], p.cols[tgt] - 1)
    if not return_entropy:
        lp = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        return out.index_put(at, lp.to(torch.float32))
    lp = torch.cat([x[0] for x in pieces])
    ent = torch.cat([x[1] for x in pieces])
    return out.index_put(at, lp.to(torch.float32)), torch.zeros_like(out).index_put(at, ent.to(torch.float32))

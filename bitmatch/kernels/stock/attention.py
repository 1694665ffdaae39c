"""Stock attention, torch SDPA: per sequence of a packed prefill or over keys gathered from the paged cache;
an all-decode step as one batched SDPA call, as stock engines run it; the KV write as an indexed assignment."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import spans


def _sdpa(q, k, v, scale, offset, window, causal=True, engine_style=False):
    """One sequence's rows: q [n, Hq, D] at positions offset.., k/v [L, Hkv, D]."""
    rep = q.shape[1] // k.shape[1]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
    if engine_style and window is None and (offset == 0 or q.shape[0] == 1):
        # as a stock engine calls it: is_causal for a prefill (the flash backend on CUDA), no
        # mask for a one-token decode, which sees every key (flash-decoding's split-KV order)
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal and offset == 0 and q.shape[0] > 1,
                                              scale=scale)[0].transpose(0, 1)
    i = torch.arange(q.shape[0], device=q.device).unsqueeze(1) + offset
    j = torch.arange(k.shape[0], device=q.device).unsqueeze(0)
    mask = j <= i if causal else torch.ones_like(j <= i)
    if window is not None:
        mask &= j > i - window
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)[0].transpose(0, 1)


def sdpa_prefill(q, k, v, cu, scale, window=None, engine_style=False, causal=True):
    """torch SDPA per sequence of a packed prefill. ``engine_style``: causal masks by ``is_causal``
    (flash on CUDA) instead of a boolean mask."""
    outs = [_sdpa(q[s:e], k[s:e], v[s:e], scale, 0, window, causal, engine_style) for s, e in spans(cu)]
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


def sdpa_paged(q, kc, vc, bt, qsl, lens, scale, window=None, engine_style=False):
    """torch SDPA per sequence over keys gathered from the paged cache. ``engine_style``: one-token
    decode rows without a mask (flash-decoding on CUDA)."""
    bs = kc.shape[1]
    kf, vf = kc.reshape(-1, *kc.shape[2:]), vc.reshape(-1, *vc.shape[2:])
    outs = []
    for b, (s, e) in enumerate(spans(qsl)):
        n = int(lens[b])
        pos = torch.arange(n, device=q.device)
        slots = bt[b, pos // bs].long() * bs + pos % bs
        outs.append(_sdpa(q[s:e], kf[slots], vf[slots], scale, n - (e - s), window, engine_style=engine_style))
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


def attention_prefill(q, k, v, cu_seqlens, scale, causal=True, sliding_window=None, *, max_seqlen=None):
    return sdpa_prefill(q, k, v, cu_seqlens, scale, sliding_window, engine_style=True, causal=causal)


def attention_paged(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, sliding_window=None, *,
                    max_query_len=None, max_seq_len=None):
    """An all-decode step without a window: K/V gathered for the whole batch, one SDPA call with a
    length mask (what makes a stock decode step fast, and its bits depend on the batch's longest
    sequence); any other step: one SDPA call per sequence."""
    B, bs = seq_lens.shape[0], k_cache.shape[1]
    if sliding_window is not None or q.shape[0] != B or B == 0:
        return sdpa_paged(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, sliding_window,
                          engine_style=True)
    L = int(seq_lens.max())
    nblk = -(-L // bs)

    def gather(cache):
        return cache[block_table[:, :nblk].long()].reshape(B, nblk * bs, *cache.shape[2:])[:, :L]
    mask = (torch.arange(L, device=q.device)[None] < seq_lens[:, None])[:, None, None]
    qh, kh, vh = q[:, None].transpose(1, 2), gather(k_cache).transpose(1, 2), gather(v_cache).transpose(1, 2)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(1, 2)[:, 0]


def attention_decode(q, k_cache, v_cache, block_table, seq_lens, scale, sliding_window=None, *, max_seq_len=None):
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return attention_paged(q, k_cache, v_cache, block_table, qsl, seq_lens, scale, sliding_window)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    """An indexed assignment into the flattened caches (vLLM's reshape_and_cache, in torch)."""
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping.long()] = k.detach()
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping.long()] = v.detach()

"""Stock DeepSeek-V4 ops, HF's fp32 formulas: sink attention (dense and per row through ``KeyRows``), the
compressor's windowed pooling, the indexer's top-k and the hyper-connection mixes."""
from __future__ import annotations

import torch


def sink_attention(q, qpos, kv, entries, entry_mask, sinks, *, scale, window):
    """One fp32 softmax over the window's keys, the visible entries and the sink (a logit without a value)."""
    keys = torch.cat([kv, entries], 0).float()
    j = torch.arange(kv.shape[0], device=q.device)
    valid = (j[None] <= qpos[:, None]) & (j[None] > qpos[:, None] - window)
    valid = torch.cat([valid, entry_mask], 1).unsqueeze(0)
    sc = ((q.float().transpose(0, 1) @ keys.t()) * scale).masked_fill(~valid, float("-inf"))
    sk = sinks.float().view(-1, 1, 1).expand(-1, sc.shape[1], 1)
    p = torch.cat([sc, sk], -1).softmax(-1)[..., :-1]
    return (p @ keys).transpose(0, 1).to(q.dtype)


def row_keys(q, qpos, kv, entries, selected, rows, window, rate):
    """(keys [T, W + E, D], valid [T, W + E]): each row's window of K = V rows, then its entries,
    gathered through ``rows`` (a ``KeyRows``: packed or paged addressing)."""
    t = qpos.long().view(-1, 1)
    j = t - window + 1 + torch.arange(window, device=q.device).view(1, -1)
    ok = j >= 0
    keys = kv[rows.slots(j.clamp(min=0)).clamp(0, kv.shape[0] - 1)]
    if entries is None:
        return keys, ok
    if selected is None:  # HCA: every complete window
        c = torch.arange(max(1, rows.max_len // rate), device=q.device).view(1, -1).expand(t.shape[0], -1)
        c_ok = c < torch.div(t + 1, rate, rounding_mode="floor")
    else:
        c, c_ok = selected.long(), selected >= 0
    addr = rows.slots(((c.clamp(min=0) + 1) * rate - 1).clamp(max=rows.max_len - 1)).clamp(0, entries.shape[0] - 1)
    return torch.cat([keys, entries[addr]], 1), torch.cat([ok, c_ok], 1)


def sink_attention_rows_fp32(q, kv, entries, sinks, qpos, selected, rows, scale, window, rate):
    """fp32 [T, H, D]: each row's keys and entries, one torch softmax with the sink (no value)."""
    keys, valid = row_keys(q, qpos, kv, entries, selected, rows, window, rate)
    keys = keys.float()
    sc = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    sc = sc.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sk = sinks.float().view(1, -1, 1).expand(sc.shape[0], -1, 1)
    p = torch.cat([sc, sk], -1).softmax(-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", p, keys)


def sink_attention_rows(q, qpos, kv, sinks, rows, *, scale, window, entries=None, rate=0, selected=None):
    """Every row of a step through its ``KeyRows``: the fp32 softmax above, rounded to q's dtype."""
    return sink_attention_rows_fp32(q, kv, entries, sinks, qpos, selected, rows, scale, window, rate).to(q.dtype)


def indexer_select(q, qpos, keys, weights, rows, *, rate, top_k, softmax_scale):
    """Each row's top ``top_k`` complete index keys of its own sequence by fp32 einsum scores
    (torch.topk's tie order), ascending, -1 padded: int32 [T, top_k]."""
    n = max(1, rows.max_len // rate)
    c = torch.arange(n, device=q.device).view(1, -1).expand(q.shape[0], -1)
    addr = rows.slots(((c + 1) * rate - 1).clamp(max=rows.max_len - 1)).clamp(0, keys.shape[0] - 1)
    dots = torch.einsum("thd,tcd->thc", q.float(), keys[addr].float())
    scores = (torch.relu(dots) * softmax_scale * weights.float().unsqueeze(-1)).sum(1)
    scores = scores.masked_fill(c >= torch.div(qpos.long().view(-1, 1) + 1, rate, rounding_mode="floor"),
                                float("-inf"))
    k = min(int(top_k), n)
    val, idx = scores.topk(k, dim=-1)
    sel = torch.where(torch.isfinite(val), idx, n).sort(1).values
    if k < top_k:
        sel = torch.cat([sel, torch.full((q.shape[0], top_k - k), n, dtype=sel.dtype, device=sel.device)], 1)
    return torch.where(sel >= n, -1, sel).to(torch.int32)


def compress_windows(kv, gate, position_bias, *, prev_kv=None, prev_gate=None, has_prev=None):
    """Each window pooled by an fp32 softmax of gate + bias over its slots (CSA: the previous
    window's first half channels too, masked where there is none), summed by torch."""
    z = gate.float() + position_bias.float()
    if prev_kv is not None:
        d, m = prev_kv.shape[-1], kv.shape[1]
        kv = torch.cat([prev_kv, kv[..., d:]], 1)
        z = torch.cat([prev_gate.float() + position_bias[:, :d].float(), z[..., d:]], 1)
        valid = torch.cat([has_prev.view(-1, 1).expand(-1, m), torch.ones_like(has_prev).view(-1, 1).expand(-1, m)], 1)
        z = z.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    return (kv.float() * z.softmax(1).to(kv.dtype).float()).sum(1).to(kv.dtype)


def compress_rows(raw_kv, raw_gate, position_bias, positions, rows, *, rate, overlap):
    """Every row's window gathered from the store by torch indexing, then the stock pooling."""
    idx, prev, has = rows.window_slots(positions, rate, overlap)
    if not overlap:
        return compress_windows(raw_kv[idx], raw_gate[idx], position_bias)
    d = raw_kv.shape[-1] // 2
    return compress_windows(raw_kv[idx], raw_gate[idx], position_bias, prev_kv=raw_kv[prev][..., :d],
                            prev_gate=raw_gate[prev][..., :d], has_prev=has)


def indexer_topk(q, qpos, keys, weights, *, rate, top_k, softmax_scale):
    """fp32 scores relu(q k) * scale * w summed over heads by torch, then ``torch.topk`` (ties: any)."""
    scores = (torch.relu(torch.einsum("thd,cd->thc", q.float(), keys.float())) * softmax_scale
              * weights.float().unsqueeze(-1)).sum(1)
    c = keys.shape[0]
    visible = torch.arange(c, device=q.device)[None] < torch.div(qpos[:, None] + 1, rate, rounding_mode="floor")
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=q.device)
    k = min(int(top_k), c)
    if k:
        mask.scatter_(1, scores.masked_fill(~visible, float("-inf")).topk(k, -1).indices, True)
    return mask & visible


def _hc_mix(x, fn, norm_eps):
    f = x.reshape(x.shape[0], -1).float()
    return (f * torch.rsqrt(f.square().mean(-1, keepdim=True) + norm_eps)) @ fn.float().t()


def hc_pre(x, fn, base, scale, *, iters, eps, norm_eps):
    n = x.shape[1]
    mix = _hc_mix(x, fn, norm_eps)
    pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = torch.softmax((mix[:, 2 * n:] * scale[2] + base[2 * n:]).view(-1, n, n), -1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return post, comb, (pre.unsqueeze(-1) * x.float()).sum(1).to(x.dtype)


def hc_post(x, y, post, comb):
    mixed = torch.einsum("tjk,tjd->tkd", comb.float(), x.float())
    return (post.float().unsqueeze(-1) * y.float().unsqueeze(1) + mixed).to(x.dtype)


def hc_head(x, fn, base, scale, *, eps, norm_eps):
    pre = torch.sigmoid(_hc_mix(x, fn, norm_eps) * scale[0] + base) + eps
    return (pre.unsqueeze(-1) * x.float()).sum(1).to(x.dtype)

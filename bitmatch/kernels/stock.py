"""The stock counterpart of every public op: the same signature, computed as HF, vLLM or plain torch
compute it (cuBLAS / BLAS matmuls, torch reductions, SDPA, fp32 softmax, float cumsums). One
definition per op, declared beside it in ``kernels/table.py``; faults (``locate --inject kernel:OP``),
the stock controls, the benchmarks' "same engine on stock ops" baseline and the testing helpers all
read these, through ``kernels.override`` or directly.

A stock op agrees with the bitmatch op to rounding, not to the bit: that is the point of a
control. None of them promises batch or schedule invariance; where the stock engines choose a
kernel by batch shape (one batched SDPA for an all-decode step), so does ``attention_paged`` here.
Every op's stock formula sits in this one file on purpose (a little over 400 lines): a copy of one
elsewhere is what the op table replaced.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

F32 = torch.float32


def _spans(cu):
    c = cu.tolist()
    return list(zip(c[:-1], c[1:]))


def _temps(logits, temperature):
    """[N, 1] fp32 temperatures (a float, a 1-element or an [N] tensor), as vLLM's sampler holds them."""
    t = temperature if isinstance(temperature, torch.Tensor) else torch.tensor(float(temperature))
    return t.to(logits.device, F32).reshape(-1, 1)


# ---------------------------------------------------------------- dense layers (HF's formulas)
def linear(x, weight, bias=None, *, segments=None):
    """F.linear (cuBLAS / BLAS: the reduction order depends on M); ``segments``: the same GEMM."""
    return F.linear(x, weight, bias)


def rms_norm(x, weight, eps):
    """HF's RMSNorm: fp32 mean of squares, rsqrt, back to x.dtype, times the weight."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def fused_add_rms_norm(x, residual, weight, eps):
    s = x + residual
    return rms_norm(s, weight, eps), s


def silu_and_mul(x):
    i = x.shape[-1] // 2
    return F.silu(x[..., :i]) * x[..., i:]


def _rope_inv_freq(head_dim, base, scaling, max_pos):
    """HF's rope init functions in fp32: (inv_freq, attention factor) for default / linear / llama3 / yarn."""
    sc = scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    inv = 1.0 / (float(base) ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "linear":
        return inv / float(sc["factor"]), 1.0
    if kind == "llama3":
        f, lo, hi, old = (float(sc[k]) for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                   "original_max_position_embeddings"))
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > old / lo, inv / f, inv)
        smooth = (old / wl - lo) / (hi - lo)
        medium = ~(wl < old / hi) & ~(wl > old / lo)
        return torch.where(medium, (1 - smooth) * scaled / f + smooth * scaled, scaled), 1.0
    if kind == "yarn":
        f, old = float(sc["factor"]), sc.get("original_max_position_embeddings") or max_pos

        def mscale(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0
        attn = sc.get("attention_factor") or (mscale(f, sc["mscale"]) / mscale(f, sc["mscale_all_dim"])
                                              if sc.get("mscale") and sc.get("mscale_all_dim") else mscale(f))

        def corr(rot):
            return head_dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))
        lo, hi = corr(sc.get("beta_fast") or 32), corr(sc.get("beta_slow") or 1)
        if sc.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        hi = hi + 0.001 if lo == hi else hi
        extrap = 1 - ((torch.arange(head_dim // 2, dtype=F32) - lo) / (hi - lo)).clamp(0, 1)
        return (inv / f) * (1 - extrap) + inv * extrap, float(attn)
    if kind != "default":
        raise NotImplementedError(f"stock rotary_cos_sin: scaling rope_type {kind!r} has no stock version; "
                                  "use default, linear, llama3 or yarn")
    return inv, 1.0


def rotary_cos_sin(positions, head_dim, base, scaling=None, dtype=F32, max_position_embeddings=None, max_seq_len=None):
    """HF's rotary embedding: fp32 frequencies, fp32 angles, torch cos / sin times the attention factor
    (``max_seq_len``, the kernel's host bound, changes nothing here)."""
    inv, attn = _rope_inv_freq(head_dim, base, scaling, max_position_embeddings)
    ang = positions.reshape(-1, 1).float() * inv.to(positions.device)[None]
    return (ang.cos() * attn).to(dtype), (ang.sin() * attn).to(dtype)


def _rotate(x, cos, sin):
    c, s = torch.cat([cos, cos], -1).to(x.dtype)[:, None], torch.cat([sin, sin], -1).to(x.dtype)[:, None]
    h = x.shape[-1] // 2
    return x * c + torch.cat([-x[..., h:], x[..., :h]], -1) * s


def apply_rotary(q, k, cos, sin):
    """HF's ``q * cos + rotate_half(q) * sin`` in q's dtype."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def apply_rotary_interleaved(x, cos, sin, *, inverse=False):
    """The trailing 2 * cos.shape[-1] channels rotated by interleaved pairs as complex products in fp32."""
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(1) if squeeze else x
    r = 2 * cos.shape[-1]
    rope = torch.view_as_complex(x3[..., -r:].float().reshape(*x3.shape[:-1], r // 2, 2).contiguous())
    rot = torch.complex(cos.float(), sin.float())[:, None]
    rope = rope * (rot.conj() if inverse else rot)
    out = torch.cat([x3[..., :-r], torch.view_as_real(rope).flatten(-2).to(x.dtype)], -1)
    return out.squeeze(1) if squeeze else out


# ---------------------------------------------------------------- block FP8 (vLLM's torch formulas)
def quantize_fp8_groups(x, group=128, scale_fmt="float"):
    """vLLM's per_token_group_quant_fp8 in torch: amax per token and 128-group clamped to 1e-10, scale
    amax / 448 (ue8m0: exp2(ceil(log2))), (x / scale) clamped to +-448 and cast by torch (the last
    group zero-padded)."""
    K = x.shape[-1]
    G = -(-K // group)
    xg = F.pad(x.float(), (0, G * group - K)).unflatten(-1, (G, group))
    s = xg.abs().amax(-1).clamp(min=1e-10) / 448.0
    if scale_fmt == "ue8m0":
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (xg / s.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.flatten(-2)[..., :K], s


def _fp8_dequant(q, scale, dtype):
    n, k = q.shape
    return (q.float() * scale.float().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).to(dtype)


def fp8_linear(x, weight_q, weight_scale, bias=None, *, scale_fmt="float"):
    """The weight dequantized to x's dtype and F.linear, activations unquantized: what a stock engine
    runs for an FP8 checkpoint without an FP8 GEMM (cuBLAS / BLAS: the reduction order depends on M)."""
    return F.linear(x, _fp8_dequant(weight_q, weight_scale, x.dtype), bias)


def fp8_linear_master(x, weight, bias=None, *, scale_fmt="float"):
    """The master weight through a torch 128 x 128 block quantize / dequantize round trip, then F.linear."""
    n, k = weight.shape
    wb = F.pad(weight.float(), (0, -k % 128, 0, -n % 128)).unflatten(1, (-1, 128)).unflatten(0, (-1, 128))
    s = wb.abs().amax(dim=(1, 3)).clamp(min=1e-10) / 448.0
    if scale_fmt == "ue8m0":
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (wb / s[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).flatten(2).flatten(0, 1)[:n, :k]
    return fp8_linear(x, q, s, bias)


# ---------------------------------------------------------------- attention (torch SDPA)
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
    outs = [_sdpa(q[s:e], k[s:e], v[s:e], scale, 0, window, causal, engine_style) for s, e in _spans(cu)]
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


def sdpa_paged(q, kc, vc, bt, qsl, lens, scale, window=None, engine_style=False):
    """torch SDPA per sequence over keys gathered from the paged cache. ``engine_style``: one-token
    decode rows without a mask (flash-decoding on CUDA)."""
    bs = kc.shape[1]
    kf, vf = kc.reshape(-1, *kc.shape[2:]), vc.reshape(-1, *vc.shape[2:])
    outs = []
    for b, (s, e) in enumerate(_spans(qsl)):
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


# ---------------------------------------------------------------- logprobs and sampling (vLLM's sampler)
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


# ---------------------------------------------------------------- MoE (HF's routing and expert loop)
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


# ---------------------------------------------------------------- DeepSeek-V4 (HF's fp32 formulas)
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


# ---------------------------------------------------------------- Mamba2 (HF's torch path)
def causal_conv1d(x, weight, bias, cu_seqlens, *, activation="silu", conv_state=None, state_slots=None):
    """F.conv1d per sequence on [its slot's K-1 inputs (zeros when new), its tokens], in x.dtype."""
    K = weight.shape[1]
    out = torch.empty_like(x)
    w, b_ = weight.to(x.dtype).unsqueeze(1), None if bias is None else bias.to(x.dtype)
    for b, (s, e) in enumerate(_spans(cu_seqlens)):
        slot = None if conv_state is None else int(state_slots[b])
        prev = x.new_zeros(K - 1, x.shape[1]) if slot is None else conv_state[slot].to(x.dtype)
        full = torch.cat([prev, x[s:e]])
        o = F.conv1d(full.t().unsqueeze(0), w, b_, groups=x.shape[1])[0].t()
        out[s:e] = F.silu(o) if activation == "silu" else o
        if slot is not None and K > 1:
            conv_state[slot] = full[-(K - 1):].to(conv_state.dtype)
    return out


def mamba_chunk_scan(x, dt, A, B, C, chunk_size, cu_seqlens, *, D=None, dt_bias=None, dt_min=0.0,
                     seq_start=None, cache=None, state_slots=None):
    """HF's chunked SSD in fp32 (cumsum, exp of segment sums, einsums), on the same absolute chunks
    and the same ``cache`` layout as the op (state at the open chunk's start, its earlier x / B / dt)."""
    H, P = x.shape[1:]
    rep, Q = H // B.shape[1], chunk_size
    dtp = F.softplus(dt.float() + (0.0 if dt_bias is None else dt_bias.float())).clamp(min=dt_min)
    y = torch.empty(x.shape, dtype=F32, device=x.device)
    for b, (s, e) in enumerate(_spans(cu_seqlens)):
        l0, slot = 0, None
        S = x.new_zeros(H, P, B.shape[2], dtype=F32)
        px, pdt, pB = x[:0], dtp[:0], B[:0]
        if cache is not None:
            slot, l0 = int(state_slots[b]), int(seq_start[b]) % Q
            S = cache[0][slot].float()
            px, pB, pdt = cache[1][slot, :l0].to(x.dtype), cache[2][slot, :l0].to(B.dtype), cache[3][slot, :l0].float()
        i = s
        while i < e:
            take = min(Q - l0, e - i)
            xs, dts = torch.cat([px, x[i:i + take]]).float(), torch.cat([pdt, dtp[i:i + take]])
            Bs = torch.cat([pB, B[i:i + take]]).float().repeat_interleave(rep, 1)
            Cs = C[i:i + take].float().repeat_interleave(rep, 1)
            acum = torch.cumsum(dts * A.float(), 0)                                   # [n, H]
            rows = torch.arange(l0, l0 + take, device=x.device)
            causal = (rows[:, None] >= torch.arange(len(acum), device=x.device)[None]).unsqueeze(-1)
            L = torch.exp((acum[l0:].unsqueeze(1) - acum.unsqueeze(0)).masked_fill(~causal, float("-inf")))
            xdt = xs * dts.unsqueeze(-1)
            yd = torch.einsum("lsh,shp->lhp", torch.einsum("lhn,shn->lsh", Cs, Bs) * L, xdt)
            yo = torch.einsum("lhn,hpn->lhp", Cs, S) * torch.exp(acum[l0:]).unsqueeze(-1)
            y[i:i + take] = yd + yo + (0.0 if D is None else D.float().view(1, -1, 1) * xs[l0:])
            if l0 + take == Q:
                w = torch.exp(acum[-1:] - acum)
                S = torch.exp(acum[-1]).view(-1, 1, 1) * S + torch.einsum("sh,shp,shn->hpn", w, xdt, Bs)
            elif slot is not None:
                cache[1][slot, l0:l0 + take] = x[i:i + take].to(cache[1].dtype)
                cache[2][slot, l0:l0 + take] = B[i:i + take].to(cache[2].dtype)
                cache[3][slot, l0:l0 + take] = dtp[i:i + take]
            i, l0, px, pdt, pB = i + take, 0, x[:0], dtp[:0], B[:0]
        if slot is not None:
            cache[0][slot] = S
    return y


def gated_rms_norm(y, z, weight, group_size, eps):
    h = y.float() * F.silu(z.float())
    hg = h.view(h.shape[0], -1, group_size)
    return weight.float() * (hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + eps)).view_as(h)


__all__ = ["linear", "quantize_fp8_groups", "fp8_linear", "fp8_linear_master",
           "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_cos_sin", "apply_rotary",
           "apply_rotary_interleaved", "sdpa_prefill", "sdpa_paged", "attention_prefill", "attention_paged",
           "attention_decode", "write_kv_cache", "full_logprobs", "token_logprobs", "top_k_top_p_mask",
           "apply_top_k_top_p", "categorical_sample", "uniform_noise", "moe_scores", "moe_route", "moe_experts",
           "moe_combine", "sink_attention", "sink_attention_rows", "compress_windows", "compress_rows", "indexer_topk",
           "indexer_select", "hc_pre",
           "hc_post", "hc_head", "causal_conv1d", "row_keys", "sink_attention_rows_fp32",
           "mamba_chunk_scan", "gated_rms_norm"]

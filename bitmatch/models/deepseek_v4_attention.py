"""DeepSeek-V4 attention on bitmatch.kernels: one path for the trainer (packed prefill) and the
engine (paged caches). See ``deepseek_v4`` for the layer and the family.

Op order of one attention block (x = input_layernorm of the collapsed streams, [T, hidden]):
    q_res = rms_norm(linear(x, Wqa), q_a_norm);  q = rms_norm_unweighted(linear(q_res, Wqb) [T, H, D])
    kv    = rms_norm(linear(x, Wkv), kv_norm)    [T, D]   (the single K = V head)
    q, kv = apply_rotary_interleaved(., cos, sin)         (last rope_dim channels; sliding layers the
                                                            "main" rope, compressed layers "compress")
    compressor (CSA / HCA): raw projections C = linear(x, Wc), Z = linear(x, Wz) per token; entry w
        = rope(rms_norm(compress_windows(window w [, w-1])), position w*m), computed ONCE, when its
        window's last token is computed (engine: stored at that token's slot of the paged cache)
    CSA: indexer entries likewise at index_head_dim; mask = indexer_topk(q_idx, positions, entries,
        w = linear(x, Ww) * H_i^-0.5); HCA: mask = entry c complete at t ((c+1)*m <= t+1)
    o = sink_attention(q, positions, kv[0..L), entries, mask, sinks)    per sequence
    o = apply_rotary_interleaved(o, cos, sin, inverse=True)             (de-rotate: K = V)
    o = linear(cat_g linear(o_g, Woa_g), Wob)                           (grouped output projection)

Engine caches (cache groups of kind "paged", per token, at the token's slot): "swa" (kv),
"hca" (kv, C, Z, entry), "csa" (kv, C, Z, entry, C_idx, Z_idx, entry_idx). A token's state depends
only on the tokens up to it, so prefix caching stays correct; an entry is read back only for
complete windows, so the slot's content before completion is never used.
"""
from __future__ import annotations

import torch

from bitmatch.models.dense import linear, rms_norm
from bitmatch.precision import cast_param

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
GROUP_OF = {SLIDING: "swa", CSA: "csa", HCA: "hca"}
CACHE_NAMES = {"swa": ("kv",), "hca": ("kv", "ckv", "cgate", "entry"),
               "csa": ("kv", "ckv", "cgate", "entry", "ikv", "igate", "ientry")}


def _kernels():
    import bitmatch.kernels as K

    return K


def cache_tensors(spec, group: str, dtype) -> tuple:
    """((shape, dtype), ...) per token for ``group`` (see CACHE_NAMES)."""
    d, di = spec.head_dim, spec.index_head_dim
    shapes = {"kv": d, "ckv": 2 * d if group == "csa" else d, "cgate": 2 * d if group == "csa" else d,
              "entry": d, "ikv": 2 * di, "igate": 2 * di, "ientry": di}
    return tuple(((shapes[n],), dtype) for n in CACHE_NAMES[group])


def sequences(ctx, positions):
    """[(start, end, qpos, L, slots)]: this step's rows of each sequence, their positions, the
    sequence's visible length and (engine) the cache slot of every position 0..L-1."""
    out = []
    if ctx.paged:
        qsl, lens = ctx.query_start_loc.tolist(), ctx.seq_lens.tolist()
        bs = None
        for group in ctx.caches.values():
            for entry in group.values():
                bs = entry[0].shape[1]
                break
            break
        for b, n in enumerate(lens):
            s, e = qsl[b], qsl[b + 1]
            p = torch.arange(n, device=positions.device)
            slots = ctx.block_table[b, p // bs].long() * bs + p % bs
            out.append((s, e, positions[s:e], n, slots))
        return out
    if ctx.cu_seqlens is None:
        raise ValueError("bitmatch: ForwardContext needs cu_seqlens (packed prefill) or slot_mapping (paged)")
    cu = ctx.cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        pos = positions[s:e]
        # compressed windows sit at absolute positions from the sequence start: a packed row must
        # be a whole sequence from position 0 (a prefill continuing a cache runs through the engine)
        if e > s and not torch.equal(pos, torch.arange(e - s, device=pos.device, dtype=pos.dtype)):
            raise ValueError("bitmatch deepseek_v4: packed sequences must have positions 0..n-1 "
                             "(compressed windows start at position 0)")
        out.append((s, e, pos, e - s, None))
    return out


def _flat(t):
    return t.view(-1, *t.shape[2:])


def window_entries(mod, raw_kv, raw_gate, ws, rate, overlap, dtype, rope_at):
    """Entries of windows ``ws`` [W] from the per-position raw projections [L, C] of one sequence:
    pooled, RMS-normed, rotated at position w * rate (HF's compressor / indexer compressor)."""
    K = _kernels()
    m = rate
    idx = ws.view(-1, 1) * m + torch.arange(m, device=ws.device).view(1, -1)
    kw = dict()
    if overlap:
        d = raw_kv.shape[-1] // 2
        prev = (ws - 1).clamp(min=0).view(-1, 1) * m + torch.arange(m, device=ws.device).view(1, -1)
        kw = dict(prev_kv=raw_kv[prev][..., :d], prev_gate=raw_gate[prev][..., :d], has_prev=ws > 0)
    pooled = K.compress_windows(raw_kv[idx], raw_gate[idx], cast_param(mod.position_bias, torch.float32), **kw)
    normed = rms_norm(mod.kv_norm, pooled, dtype)
    cos, sin = rope_at(ws * m, "compress")
    return K.apply_rotary_interleaved(normed, cos, sin)


def _entries_for(mod, names, step, cache, seq, rate, overlap, dtype, rope_at, s_rows):
    """All complete entries of a sequence, [L // rate, D]: the trainer computes them all; the
    engine computes those whose window closes in this step, stores them, and reads every one."""
    s, e, qpos, n, slots = seq
    kv_name, gate_name, entry_name = names
    n_win = n // rate
    dev = qpos.device
    if slots is None:
        return window_entries(mod, step[kv_name][s_rows], step[gate_name][s_rows],
                              torch.arange(n_win, device=dev), rate, overlap, dtype, rope_at)
    raw_kv, raw_gate, ent = (_flat(cache[x]) for x in names)
    closing = qpos[(qpos + 1) % rate == 0]
    if closing.numel():
        ws = torch.div(closing + 1, rate, rounding_mode="floor") - 1
        new = window_entries(mod, raw_kv[slots], raw_gate[slots], ws, rate, overlap, dtype, rope_at)
        ent.index_copy_(0, slots[closing], new.detach())
    return ent[slots[(torch.arange(n_win, device=dev) + 1) * rate - 1]]


def attention(attn, x, input_pos, rope, rope_at, ctx, spec, layer_idx, dtype, seqs, rec=None, prefix="self_attn"):
    """One DeepSeek-V4 attention block on rows x [T, hidden] -> [T, hidden]."""
    K = _kernels()
    lt = spec.layer_types[layer_idx]
    cos, sin = rope["main" if lt == SLIDING else "compress"]
    T = x.shape[0]
    H, D = spec.num_heads, spec.head_dim
    q_res = rms_norm(attn.q_a_norm, linear(attn.q_a_proj, x, dtype), dtype)
    q = linear(attn.q_b_proj, q_res, dtype).view(T, H, D)
    q = K.rms_norm(q, torch.ones(D, dtype=dtype, device=x.device), spec.rms_eps)  # HF's unweighted q_b_norm
    q = K.apply_rotary_interleaved(q, cos, sin)
    kv = K.apply_rotary_interleaved(rms_norm(attn.kv_norm, linear(attn.kv_proj, x, dtype), dtype), cos, sin)
    if rec is not None:
        rec(f"{prefix}.q", q)
        rec(f"{prefix}.kv", kv)
    step = {"kv": kv}
    comp = attn.compressor
    if comp is not None:
        step["ckv"], step["cgate"] = linear(comp.kv_proj, x, dtype), linear(comp.gate_proj, x, dtype)
    if lt == CSA:
        idx = comp.indexer
        step["ikv"], step["igate"] = linear(idx.kv_proj, x, dtype), linear(idx.gate_proj, x, dtype)
        iq = linear(idx.q_b_proj, q_res, dtype).view(T, spec.index_n_heads, spec.index_head_dim)
        iq = K.apply_rotary_interleaved(iq, cos, sin)
        iw = linear(idx.scorer.weights_proj, x, dtype).float() * (spec.index_n_heads ** -0.5)
    cache = None
    if ctx.paged:
        group = GROUP_OF[lt]
        cache = dict(zip(CACHE_NAMES[group], ctx.cache(group, layer_idx)))
        for name, val in step.items():
            _flat(cache[name]).index_copy_(0, ctx.slot_mapping, val.detach())
    sinks = cast_param(attn.sinks, torch.float32)
    outs, selected = [], []
    for seq in seqs:
        s, e, qpos, n, slots = seq
        rows = slice(s, e)
        full_kv = kv[rows] if slots is None else _flat(cache["kv"])[slots]
        entries = kv.new_zeros((0, D))
        mask = torch.zeros(e - s, 0, dtype=torch.bool, device=x.device)
        if comp is not None:
            m = spec.compress_rates[lt]
            entries = _entries_for(comp, ("ckv", "cgate", "entry"), step, cache, seq, m, lt == CSA, dtype,
                                   rope_at, rows)
            if lt == HCA:
                c = torch.arange(entries.shape[0], device=x.device).view(1, -1)
                mask = c < torch.div(qpos.view(-1, 1) + 1, m, rounding_mode="floor")
            elif entries.shape[0]:
                ient = _entries_for(comp.indexer, ("ikv", "igate", "ientry"), step, cache, seq, m, True, dtype,
                                    rope_at, rows)
                mask = K.indexer_topk(iq[rows], qpos, ient, iw[rows], rate=m, top_k=spec.index_topk,
                                      softmax_scale=spec.index_head_dim ** -0.5)
        if rec is not None and lt == CSA:
            # per query token: the selected entry indices in index order, -1 padded to index_topk
            k = spec.index_topk
            idx = torch.where(mask, torch.arange(mask.shape[1], device=x.device).view(1, -1), mask.shape[1] + k)
            idx = torch.cat([idx, torch.full((idx.shape[0], k), mask.shape[1] + k, device=x.device)], 1)
            idx = idx.sort(1).values[:, :k]
            selected.append(torch.where(idx >= mask.shape[1], -1, idx))
        outs.append(K.sink_attention(q[rows], qpos, full_kv, entries, mask, sinks, scale=spec.scale,
                                     window=spec.sliding_window))
    o = torch.cat(outs, 0) if outs else q.new_zeros(q.shape)
    if selected:
        rec(f"{prefix}.indexer", torch.cat(selected, 0))
    o = K.apply_rotary_interleaved(o, cos, sin, inverse=True)
    if rec is not None:
        rec(f"{prefix}.attn", o)
    g = spec.o_groups
    w_a = cast_param(attn.o_a_proj.weight, dtype).view(g, -1, H * D // g)
    og = o.reshape(T, g, H * D // g)
    grouped = torch.cat([K.linear(og[:, i], w_a[i]) for i in range(g)], dim=-1)
    out = linear(attn.o_b_proj, grouped, dtype)
    if rec is not None:
        rec(f"{prefix}.o_proj", out)
    return out

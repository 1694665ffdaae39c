"""sink_attention: DeepSeek-V4's attention for one sequence: MQA over the sliding window of
its own K = V entries, plus compressed entries (CSA: the indexer's selection, HCA: every
complete window), plus a per-head sink logit, in ONE softmax.

For the query at absolute position t, head h (keys: local positions j with t - W < j <= t,
compressed entries c with entry_mask[t, c]):

    s_j  = f64(exact_matmul(q, k_j)) * scale                     (exact for bf16)
    M    = max(max_j s_j, max_c s_c, sink_h)
    den  = (tree_sum_j exp64(s_j - M) + tree_sum_c exp64(s_c - M)) + exp64(sink_h - M)
    out  = (sum_j p_j v_j + sum_c p_c v_c) / den                 (the sink has no value)

Canonical order: the local terms sit at their absolute positions 0..L-1 and the compressed
ones at their entry index 0..C-1, each in its own fixed tree (excluded keys are exact zeros),
the two partial sums then the sink added in that order; the weighted value sums are exact
integer products (``_exact``) over fixed 4096-key chunks from position 0 / entry 0. So a
query's bits do not depend on how many later tokens or entries exist, nor on the batch:
full prefill, chunked prefill and decode agree. The sink is folded into the same max and the
same normalizer as the keys (never a second softmax).
Reference: CPU. Backward: a plain fp32 recompute (both backends). Triton backend (CUDA):
kernels/triton/compressed_attention.py (scores and value sums from the invariant Triton linear,
the same folds and fold order; no fused flash kernel yet).
"""
from __future__ import annotations

import torch

from . import _exact
from ._backend import (backend_for, check_float, check_int, check_on_device, check_same_device, host_readable,
                       recompute_grads, triton_impl)

F64 = torch.float64
_SCRATCH = 1 << 22  # float64 score elements per query chunk: bounds memory, not bits


def _int_matmul(qw, qv_t):
    """sum over slices of exact integer products, smallest weight first (``_attend``'s order)."""
    acc = None
    terms = sorted(((a + b, a, b) for a in range(len(qw)) for b in range(len(qv_t))), reverse=True)
    for order, a, b in terms:
        t = _exact._matmul_exact_ints(qw[a], qv_t[b]) * float(2.0 ** (-_exact._GRID_BITS * order))
        acc = t if acc is None else acc + t
    return acc


def sink_attention_reference(q, qpos, kv, entries, entry_mask, sinks, scale, window):
    tq, h, d = q.shape
    n_loc, n_ent = kv.shape[0], entries.shape[0]
    keys = torch.cat([kv, entries], 0)  # scores are per (query row, key row): position-free
    qk, ek = _exact.quantize_rows(keys, _exact.slices_for(keys.dtype))  # values = keys (K = V)
    key_scale = _exact.two_pow(ek - _exact._GRID_BITS).view(1, 1, -1)   # [1, 1, L + C]
    qk_t = [t.transpose(0, 1) for t in qk]                                # [D, L + C]
    j = torch.arange(n_loc, device=q.device)
    sink = sinks.to(F64).view(-1, 1)                                      # [H, 1]
    out = []
    step = max(1, _SCRATCH // max(1, h * (n_loc + n_ent)))
    for s in range(0, tq, step):
        qc, pc = q[s:s + step].transpose(0, 1), qpos[s:s + step]          # [H, tq', D]
        sc = _exact.exact_matmul(qc, keys, _exact.slices_for(q.dtype), _exact.slices_for(keys.dtype)) * scale
        valid = (j.view(1, -1) <= pc.view(-1, 1)) & (j.view(1, -1) > pc.view(-1, 1) - window)
        valid = torch.cat([valid, entry_mask[s:s + step]], 1).unsqueeze(0)  # [1, tq', L + C]
        sc = torch.where(valid, sc, -torch.inf)
        mx = torch.maximum(sc.amax(-1), sink)                             # [H, tq']
        p = torch.where(valid, _exact.exp64(sc - mx.unsqueeze(-1)), 0.0)
        den = (_exact.tree_sum(p[..., :n_loc], -1) + _exact.tree_sum(p[..., n_loc:], -1)) + _exact.exp64(sink - mx)
        qw, ew = _exact.quantize_rows(p * key_scale, 2)                   # one grid per query row
        num = _int_matmul([w[..., :n_loc] for w in qw], [v[..., :n_loc] for v in qk_t])
        if n_ent:  # the entries' own exact sum, added after the local one: a fixed order
            num = num + _int_matmul([w[..., n_loc:] for w in qw], [v[..., n_loc:] for v in qk_t])
        o = num * _exact.two_pow(ew - _exact._GRID_BITS) / den.unsqueeze(-1)
        out.append((o + 0.0).to(q.dtype).transpose(0, 1))
    return torch.cat(out, 0) if out else q.new_zeros(q.shape)


def _sink_plain(q, kv, entries, sinks, qpos, entry_mask, scale, window):
    keys = torch.cat([kv, entries], 0).float()
    n_loc = kv.shape[0]
    j = torch.arange(n_loc, device=q.device)
    valid = (j.view(1, -1) <= qpos.view(-1, 1)) & (j.view(1, -1) > qpos.view(-1, 1) - window)
    valid = torch.cat([valid, entry_mask], 1).unsqueeze(0)
    sc = (q.float().transpose(0, 1) @ keys.t()) * scale
    sc = sc.masked_fill(~valid, float("-inf"))
    sk = sinks.float().view(-1, 1, 1).expand(-1, sc.shape[1], 1)
    p = torch.cat([sc, sk], -1).softmax(-1)[..., :-1]
    return (p @ keys).transpose(0, 1)


def _forward(q, qpos, kv, entries, entry_mask, sinks, scale, window):
    if backend_for(q) == "reference":
        return sink_attention_reference(q, qpos, kv, entries, entry_mask, sinks, scale, window)
    return triton_impl("compressed_attention", "sink_attention")(q, qpos, kv, entries, entry_mask, sinks,
                                                                 scale, window)


class SinkAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, entries, sinks, qpos, entry_mask, scale, window):
        ctx.save_for_backward(q, kv, entries, sinks, qpos, entry_mask)
        ctx.args = (scale, window)
        return _forward(q, qpos, kv, entries, entry_mask, sinks, scale, window)

    @staticmethod
    def backward(ctx, g):
        q, kv, entries, sinks, qpos, entry_mask = ctx.saved_tensors
        fn = lambda a, b, c, d: _sink_plain(a, b, c, d, qpos, entry_mask, *ctx.args)  # noqa: E731
        grads = recompute_grads(fn, (q, kv, entries, sinks), ctx.needs_input_grad[:4], (g,))
        return (*grads, None, None, None, None)


def sink_attention(q, qpos, kv, entries, entry_mask, sinks, *, scale: float, window: int):
    """One sequence: q [Tq, H, D] at absolute positions qpos [Tq]; kv [L, D] the single K = V
    head of positions 0..L-1 (L > max(qpos)); entries [C, D] compressed K = V entries (C may be
    0); entry_mask bool [Tq, C] (which entries each query sees); sinks [H] fp32 -> [Tq, H, D].

    Local keys: t - window < j <= t. Invariance: a query's bits depend only on its own q, the
    keys it sees (by position / entry index) and the sink: never on L, C, Tq or the batch.
    """
    op = "sink_attention"
    for n, t in (("q", q), ("kv", kv), ("entries", entries), ("sinks", sinks)):
        check_float(n, t, op)
    check_int("qpos", qpos, op)
    if q.dim() != 3 or kv.dim() != 2 or entries.dim() != 2:
        raise ValueError(f"{op}: q [Tq, H, D], kv [L, D], entries [C, D]; got {tuple(q.shape)}, "
                         f"{tuple(kv.shape)}, {tuple(entries.shape)}")
    tq, h, d = q.shape
    if kv.shape[1] != d or entries.shape[1] != d or kv.dtype != q.dtype or entries.dtype != q.dtype:
        raise ValueError(f"{op}: kv/entries must be [*, D={d}] in q's dtype {q.dtype}")
    if qpos.shape != (tq,) or entry_mask.shape != (tq, entries.shape[0]) or entry_mask.dtype != torch.bool:
        raise ValueError(f"{op}: qpos must be [Tq] and entry_mask bool [Tq, C]; got {tuple(qpos.shape)}, "
                         f"{tuple(entry_mask.shape)} {entry_mask.dtype}")
    if sinks.shape != (h,):
        raise ValueError(f"{op}: sinks must be [H={h}], got {tuple(sinks.shape)}")
    if tq and host_readable(qpos):
        if int(qpos.max()) >= kv.shape[0]:
            raise ValueError(f"{op}: a query position {int(qpos.max())} has no key row (L={kv.shape[0]})")
    elif tq:  # on the device: a read per layer would stall every later launch
        check_on_device(qpos.max() < kv.shape[0], f"{op}: a query position has no key row (L={kv.shape[0]})")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"{op}: window must be a positive int, got {window!r}")
    check_same_device(op, q=q, qpos=qpos, kv=kv, entries=entries, entry_mask=entry_mask, sinks=sinks)
    args = (q.contiguous(), kv.contiguous(), entries.contiguous(), sinks.contiguous(), qpos, entry_mask,
            float(scale), window)
    if torch.is_grad_enabled() and any(t.requires_grad for t in args[:4]):
        return SinkAttentionFunction.apply(*args)
    a = args
    return _forward(a[0], a[4], a[1], a[2], a[5], a[3], a[6], a[7])

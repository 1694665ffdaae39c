"""Attention: packed-varlen prefill, paged (chunked prefill / decode), and the cache write.

One canonical definition for the query at absolute position t: scores against keys
0..t (or the sliding window) in float64 from ``exact_matmul`` (exact for bf16 up to the row
grid), max-subtracted softmax with ``exp64``, the normalizer by ``tree_sum`` over key
positions, and the weighted sum of values as an exact integer product over fixed 4096-key
chunks of absolute positions. Keys past t are exact zeros in every sum, so full prefill,
any chunked prefill and one-token decode at any block size give the same bits.
"""
from __future__ import annotations

import torch

from . import _exact
from ._backend import backend_for, check_float, check_int, check_same_device, recompute_grads, triton_impl

F64 = torch.float64
_SCRATCH = 1 << 22  # float64 score elements per query chunk: bounds memory, not bits


def _attend(q, qpos, k, v, scale, causal, window):
    """q [Tq, Hq, D] at absolute positions qpos [Tq]; k, v [L, Hkv, D] for positions 0..L-1."""
    tq, hq, d = q.shape
    n_keys, hkv = k.shape[0], k.shape[1]
    kh = k.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, L, D], exact copies
    vh = v.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    qv, ev = _exact.quantize_rows(vh, _exact.slices_for(v.dtype))  # per key row: causal-safe
    key_scale = _exact.two_pow(ev - _exact.grid_bits()).transpose(-1, -2)  # [Hq, 1, L]
    qv_t = [t.transpose(-1, -2) for t in qv]  # [Hq, D, L]
    j = torch.arange(n_keys, device=q.device)
    out = []
    step = max(1, _SCRATCH // max(1, hq * n_keys))
    for s in range(0, tq, step):
        qc, pc = q[s:s + step].transpose(0, 1), qpos[s:s + step]
        scores = _exact.exact_matmul(qc, kh, _exact.slices_for(q.dtype), _exact.slices_for(k.dtype)) * scale
        valid = torch.ones(pc.shape[0], n_keys, dtype=torch.bool, device=q.device)
        if causal:
            valid &= j.unsqueeze(0) <= pc.unsqueeze(1)
        if window is not None:
            valid &= j.unsqueeze(0) > (pc.unsqueeze(1) - window)
        scores = torch.where(valid, scores, -torch.inf)
        m = scores.amax(-1, keepdim=True)
        p = torch.where(valid, _exact.exp64(scores - m), 0.0)
        denom = _exact.tree_sum(p, -1)  # [Hq, tq]
        qw, ew = _exact.quantize_rows(p * key_scale, 2)  # per query row: depends on its prefix
        acc = None
        terms = sorted(((a + b, a, b) for a in range(len(qw)) for b in range(len(qv_t))), reverse=True)
        for order, a, b in terms:
            t = _exact.matmul_exact_ints(qw[a], qv_t[b]) * float(2.0 ** (-_exact.grid_bits() * order))
            acc = t if acc is None else acc + t
        o = acc * _exact.two_pow(ew - _exact.grid_bits()) / denom.unsqueeze(-1)
        out.append((o + 0.0).to(q.dtype).transpose(0, 1))
    return torch.cat(out, 0)


def _check_qkv(op, q, k, v):
    for n, t in (("q", q), ("k", k), ("v", v)):
        check_float(n, t, op)
        if t.dim() != 3:
            raise ValueError(f"{op}: {n} must be 3-D, got shape {tuple(t.shape)}")
    if q.shape[-1] != k.shape[-1] or k.shape != v.shape or q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"{op}: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, "
                         f"v {tuple(v.shape)} {v.dtype} do not agree")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{op}: q heads {q.shape[1]} must be a multiple of kv heads {k.shape[1]}")


def attention_prefill_reference(q, k, v, cu_seqlens, scale, causal, sliding_window):
    out = torch.empty_like(q)
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        if e > s:
            pos = torch.arange(e - s, device=q.device)
            out[s:e] = _attend(q[s:e], pos, k[s:e], v[s:e], scale, causal, sliding_window)
    return out


def _prefill_plain(q, k, v, cu_seqlens, scale, causal, window):
    outs = []
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        n = e - s
        qb = q[s:e].float().transpose(0, 1)
        rep = q.shape[1] // k.shape[1]
        kb = k[s:e].float().repeat_interleave(rep, 1).transpose(0, 1)
        vb = v[s:e].float().repeat_interleave(rep, 1).transpose(0, 1)
        sc = (qb @ kb.transpose(-1, -2)) * scale
        i, j = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
        valid = torch.ones(n, n, dtype=torch.bool)
        if causal:
            valid &= j <= i
        if window is not None:
            valid &= j > i - window
        sc = sc.masked_fill(~valid.to(sc.device), float("-inf"))
        outs.append((sc.softmax(-1) @ vb).transpose(0, 1))
    return torch.cat(outs, 0)


class AttentionPrefillFunction(torch.autograd.Function):
    """The reference forward; its backward re-runs a plain fp32 version (the Triton backend has its
    own Function with the flash backward: kernels/triton/attention.py AttentionPrefillTriton)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale, causal, window):
        ctx.args = (scale, causal, window)
        ctx.save_for_backward(q, k, v, cu_seqlens)
        return attention_prefill_reference(q, k, v, cu_seqlens, scale, causal, window)

    @staticmethod
    def backward(ctx, g):
        q, k, v, cu = ctx.saved_tensors
        fn = lambda a, b, c: _prefill_plain(a, b, c, cu, *ctx.args)  # noqa: E731
        gq, gk, gv = recompute_grads(fn, (q, k, v), ctx.needs_input_grad[:3], (g,))
        return gq, gk, gv, None, None, None, None


def attention_prefill(q, k, v, cu_seqlens, scale: float, causal: bool = True, sliding_window: int | None = None,
                      *, max_seqlen: int | None = None):
    """Attention over packed sequences: q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens [B+1].

    ``max_seqlen``: the longest sequence, known on the host (the engine's step metadata); given,
    cu_seqlens' values are not read back (no host sync: the caller built both from the same
    host data), only its shape is checked.
    Invariance: the row of the token at position t depends only on its sequence's q_t and
    k/v at positions <= t (within the window); equal bits to attention_paged/decode.
    """
    op = "attention_prefill"
    _check_qkv(op, q, k, v)
    check_int("cu_seqlens", cu_seqlens, op)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"{op}: q and k must have the same number of tokens")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"{op}: cu_seqlens must be [B+1] from 0 to T={q.shape[0]}")
    if max_seqlen is None:
        # no host metadata: the bounds and the longest sequence (the Triton grid's size) in one
        # read; callers that know it (the trainer's pack_rows, the engine) pass max_seqlen: none
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        longest = lens.max() if lens.numel() else torch.zeros_like(cu_seqlens[0])
        first, last, max_seqlen = torch.stack([cu_seqlens[0], cu_seqlens[-1], longest]).tolist()
        if first != 0 or last != q.shape[0]:
            raise ValueError(f"{op}: cu_seqlens must be [B+1] from 0 to T={q.shape[0]}")
    elif not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or not 0 <= max_seqlen <= q.shape[0]:
        raise ValueError(f"{op}: max_seqlen must be an int in [0, T={q.shape[0]}], got {max_seqlen!r}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{op}: sliding_window must be >= 1 or None")
    check_same_device(op, q=q, k=k, v=v)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if backend_for(q) == "triton":
        # the output and its logsumexp kept for the flash backward (same output bits)
        return triton_impl("attention", "attention_prefill_autograd")(q, k, v, cu_seqlens, float(scale),
                                                                      bool(causal), sliding_window,
                                                                      max_seqlen=max_seqlen)
    return AttentionPrefillFunction.apply(q, k, v, cu_seqlens, float(scale), bool(causal), sliding_window)


def attention_paged_reference(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, sliding_window):
    nb, bs, hkv, d = k_cache.shape
    kf, vf = k_cache.reshape(nb * bs, hkv, d), v_cache.reshape(nb * bs, hkv, d)
    out = torch.empty_like(q)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b in range(len(lens)):
        s, e, n = qsl[b], qsl[b + 1], lens[b]
        if e == s:
            continue
        pos = torch.arange(n, device=q.device)
        slots = block_table[b, pos // bs].long() * bs + pos % bs
        out[s:e] = _attend(q[s:e], pos[n - (e - s):], kf[slots], vf[slots], scale, True, sliding_window)
    return out


def _check_paged(op, q, k_cache, v_cache, block_table, seq_lens, max_seq_len=None):
    check_float("q", q, op)
    check_float("k_cache", k_cache, op)
    check_float("v_cache", v_cache, op)
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{op}: k_cache/v_cache must be [num_blocks, block_size, Hkv, D], equal shapes")
    if q.dim() != 3 or q.shape[-1] != k_cache.shape[-1] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{op}: q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{op}: q and caches must share a dtype")
    check_int("block_table", block_table, op)
    check_int("seq_lens", seq_lens, op)
    if block_table.dim() != 2 or block_table.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"{op}: block_table must be [B, max_blocks] with B = len(seq_lens)")
    longest = max_seq_len if max_seq_len is not None else (int(seq_lens.max()) if seq_lens.numel() else 0)
    if longest > block_table.shape[1] * k_cache.shape[1]:
        raise ValueError(f"{op}: a seq_len exceeds the blocks of its block_table row")
    check_same_device(op, q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table)


def _host_bound(op, name, value, hi):
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= hi:
        raise ValueError(f"{op}: {name} must be an int in [0, {hi}], got {value!r}")
    return value


def attention_paged(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale: float,
                    sliding_window: int | None = None, *, max_query_len: int | None = None,
                    max_seq_len: int | None = None):
    """Queries of B sequences against a paged cache; sequence b's queries are the last
    positions of its seq_lens[b] tokens (chunked prefill or decode).

    ``max_query_len`` / ``max_seq_len``: the step's longest query chunk and context, known on the
    host (the engine computes them once per step in ``ModelRunner.prepare``). Given both, the
    per-call value checks that would read device tensors back (a host sync per layer, and none
    allowed inside a CUDA graph) are replaced by checks of these ints; the caller vouches that
    they bound ``query_start_loc`` / ``seq_lens``. Direct callers that omit them get every check.
    Invariance: same bits as attention_prefill for the same token, for any block size,
    block table, chunk split or batch composition.
    """
    op = "attention_paged"
    host = max_query_len is not None and max_seq_len is not None
    if host:
        _host_bound(op, "max_seq_len", max_seq_len, block_table.shape[1] * k_cache.shape[1])
        _host_bound(op, "max_query_len", max_query_len, min(max_seq_len, q.shape[0]))
    _check_paged(op, q, k_cache, v_cache, block_table, seq_lens, max_seq_len if host else None)
    check_int("query_start_loc", query_start_loc, op)
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(f"{op}: query_start_loc must be [B+1] ending at T={q.shape[0]}")
    if not host:
        if int(query_start_loc[-1]) != q.shape[0]:
            raise ValueError(f"{op}: query_start_loc must be [B+1] ending at T={q.shape[0]}")
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        if bool((q_lens > seq_lens).any()):
            raise ValueError(f"{op}: a sequence has more queries than seq_lens tokens")
    if backend_for(q) == "reference":
        return attention_paged_reference(q, k_cache, v_cache, block_table, query_start_loc, seq_lens,
                                         float(scale), sliding_window)
    kw = dict(max_query_len=max_query_len, max_seq_len=max_seq_len) if host else {}
    return triton_impl("attention", "attention_paged")(
        q.contiguous(), k_cache, v_cache, block_table, query_start_loc, seq_lens, float(scale), sliding_window,
        **kw)


def attention_decode(q, k_cache, v_cache, block_table, seq_lens, scale: float, sliding_window: int | None = None,
                     *, max_seq_len: int | None = None):
    """One query per sequence, q [B, Hq, D], against the paged cache (= attention_paged).

    Invariance: the same bits as prefill row seq_lens[b]-1 of the same sequence.
    """
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    kw = {} if max_seq_len is None else dict(max_query_len=min(1, q.shape[0]), max_seq_len=max_seq_len)
    return attention_paged(q, k_cache, v_cache, block_table, qsl, seq_lens, scale, sliding_window, **kw)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Store k/v [T, Hkv, D] at ``slot_mapping`` [T] of the paged caches (exact copies)."""
    op = "write_kv_cache"
    check_int("slot_mapping", slot_mapping, op)
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:] or k.dtype != k_cache.dtype:
        raise ValueError(f"{op}: k/v {tuple(k.shape)} {k.dtype} do not fit the cache "
                         f"{tuple(k_cache.shape)} {k_cache.dtype}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"{op}: slot_mapping must be [T={k.shape[0]}]")
    nb, bs = k_cache.shape[:2]
    idx = slot_mapping.long()
    k_cache.view(nb * bs, *k_cache.shape[2:]).index_copy_(0, idx, k.detach())
    v_cache.view(nb * bs, *v_cache.shape[2:]).index_copy_(0, idx, v.detach())

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
``sink_attention_rows`` is the same attention for every query row of a step in one call: row i
(absolute position t_i) reads its keys through a ``KeyRows`` address (engine: the paged cache
through the block table; trainer: the packed step rows), and its compressed entries at the address
of each window's closing position (c+1)*m - 1 (HCA: every complete window; CSA: the indexer's
``selected`` entry indices). No per-sequence loop and no host read on the Triton backend.
Reference: CPU (``sink_attention_rows`` groups the rows by sequence on the host: reads are free
there, and each row's bits are the per-query exact value above). Backward: the reference backend
(and the one-sequence ``sink_attention``) a plain fp32 recompute; ``sink_attention_rows`` on the
Triton backend a fused flash-style kernel from the forward's saved logsumexp
(kernels/triton/compressed_attention_bwd.py). Triton backend (CUDA):
kernels/triton/compressed_attention.py, one fused kernel (sink-initialized online softmax over
absolute-position key blocks, then entry blocks: its docstring states that backend's order);
``sink_attention`` runs the same kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _exact, stock
from ._backend import (
    backend_for,
    check_float,
    check_in_range,
    check_int,
    check_on_device,
    check_same_device,
    host_readable,
    recompute_grads,
    triton_impl,
)

F64 = torch.float64
_SCRATCH = 1 << 22  # float64 score elements per query chunk: bounds memory, not bits


def _int_matmul(qw, qv_t):
    """sum over slices of exact integer products, smallest weight first (``_attend``'s order)."""
    acc = None
    terms = sorted(((a + b, a, b) for a in range(len(qw)) for b in range(len(qv_t))), reverse=True)
    for order, a, b in terms:
        t = _exact.matmul_exact_ints(qw[a], qv_t[b]) * float(2.0 ** (-_exact.grid_bits() * order))
        acc = t if acc is None else acc + t
    return acc


def sink_attention_reference(q, qpos, kv, entries, entry_mask, sinks, scale, window):
    tq, h, d = q.shape
    n_loc, n_ent = kv.shape[0], entries.shape[0]
    keys = torch.cat([kv, entries], 0)  # scores are per (query row, key row): position-free
    qk, ek = _exact.quantize_rows(keys, _exact.slices_for(keys.dtype))  # values = keys (K = V)
    key_scale = _exact.two_pow(ek - _exact.grid_bits()).view(1, 1, -1)   # [1, 1, L + C]
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
        o = num * _exact.two_pow(ew - _exact.grid_bits()) / den.unsqueeze(-1)
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

        def fn(a, b, c, d):
            return _sink_plain(a, b, c, d, qpos, entry_mask, *ctx.args)

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


# ---------------------------------------------------------------- every row of a step in one call

@dataclass(frozen=True)
class KeyRows:
    """Where position j of query row i's own sequence lives in a per-token store [S, ...]: packed
    (``row_start[i] + j``: the trainer's step rows, a sequence's rows contiguous from position 0)
    or paged (``block_table[seq_idx[i], j // block_size] * block_size + j % block_size``: the
    engine's caches). ``max_len`` is a host bound on every position (a CUDA graph's static
    shapes are sized by it, never by a value read back)."""
    max_len: int
    row_start: torch.Tensor | None = None
    seq_idx: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    block_size: int = 0

    @classmethod
    def packed(cls, qpos: torch.Tensor, row_start: torch.Tensor | None = None, max_len: int | None = None):
        """The step's own rows; ``row_start`` defaults to ``i - qpos[i]`` (sequences from position 0)."""
        t = qpos.shape[0]
        if row_start is None:
            row_start = torch.arange(t, device=qpos.device) - qpos.long()
        return cls(max_len=max(1, t if max_len is None else int(max_len)), row_start=row_start.long())

    @classmethod
    def paged(cls, block_table, block_size: int, query_start_loc, num_rows: int, max_len: int | None = None):
        """The engine's caches; ``max_len`` defaults to the block table's width in positions."""
        qsl = query_start_loc
        rows = torch.arange(num_rows, device=qsl.device, dtype=qsl.dtype)
        seq = torch.searchsorted(qsl[1:].contiguous(), rows, right=True)  # device op: no read-back
        bound = block_table.shape[1] * int(block_size)
        return cls(max_len=max(1, bound if max_len is None else min(int(max_len), bound)), seq_idx=seq.long(),
                   block_table=block_table, block_size=int(block_size))

    @property
    def paged_mode(self) -> bool:
        return self.block_table is not None

    def slots(self, pos: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """int64 addresses of positions ``pos`` [N, k] of rows ``rows`` [N] (default: every row);
        positions must be in 0..max_len-1 (callers clamp the ones they mask)."""
        pos = pos.long()
        if not self.paged_mode:
            start = self.row_start if rows is None else self.row_start[rows]
            return start.view(-1, 1) + pos
        seq = self.seq_idx if rows is None else self.seq_idx[rows]
        bt = self.block_table[seq].long()                                   # [N, nb]
        blk = bt.gather(1, torch.div(pos, self.block_size, rounding_mode="floor").clamp(max=bt.shape[1] - 1))
        return blk * self.block_size + pos % self.block_size

    def window_slots(self, positions: torch.Tensor, rate: int, overlap: bool):
        """(idx [T, m], prev [T, m] or None, has_prev [T] or None): the addresses of each row's
        window of ``rate`` positions ending at its position (clamped at 0) and, with ``overlap``
        (CSA), of the previous window (``rate`` positions back), present where position >= rate."""
        t = positions.long().view(-1, 1)
        win = t - rate + 1 + torch.arange(rate, device=t.device).view(1, -1)
        idx = self.slots(win.clamp(min=0))
        if not overlap:
            return idx, None, None
        return idx, self.slots((win - rate).clamp(min=0)), t[:, 0] >= rate

    def rows_slice(self, start: int, stop: int) -> KeyRows:
        """The addressing of rows start..stop-1 (a chunk of the step's rows)."""
        sl = slice(start, stop)
        return KeyRows(self.max_len, None if self.row_start is None else self.row_start[sl],
                       None if self.seq_idx is None else self.seq_idx[sl], self.block_table, self.block_size)

    def take(self, idx: torch.Tensor) -> KeyRows:
        """The addressing of rows ``idx`` (int64 [N], a device gather: no host read)."""
        return KeyRows(self.max_len, None if self.row_start is None else self.row_start[idx],
                       None if self.seq_idx is None else self.seq_idx[idx], self.block_table, self.block_size)

    def group_key(self) -> torch.Tensor:
        """One value per sequence of the step (the reference groups rows by it on the host)."""
        return self.seq_idx if self.paged_mode else self.row_start


def entry_list(mask: torch.Tensor, width: int) -> torch.Tensor:
    """int32 [n, width]: each row's True columns of ``mask`` [n, C] in ascending order, -1 padded
    (and cut to ``width``): the entry-list form ``sink_attention_rows`` reads."""
    n, c = mask.shape
    col = torch.arange(c, device=mask.device).view(1, -1).expand(n, -1)
    lst = torch.where(mask, col, c).sort(1).values[:, :width]
    if lst.shape[1] < width:
        lst = torch.cat([lst, torch.full((n, width - lst.shape[1]), c, device=mask.device, dtype=lst.dtype)], 1)
    return torch.where(lst >= c, -1, lst).to(torch.int32)


def _entry_mask(sel, n_ent):
    """bool [n, C] of -1-padded entry indices sel [n, k]."""
    mask = torch.zeros(sel.shape[0], n_ent + 1, dtype=torch.bool, device=sel.device)
    mask.scatter_(1, torch.where(sel >= 0, sel.long(), n_ent).clamp(max=n_ent), True)
    return mask[:, :n_ent]


def _rows_reference(q, qpos, kv, entries, selected, sinks, rows, scale, window, rate):
    """Per sequence of the step: gather its keys 0..L-1 and complete entries, then the one-sequence
    reference (each row's bits are independent of L and C, so the grouping is free)."""
    out = torch.empty_like(q)
    key = rows.group_key()
    for g in torch.unique(key).tolist():
        r = (key == g).nonzero()[:, 0]
        pos = qpos[r].long()
        n_loc = int(pos.max()) + 1
        first = r[:1]
        kv_g = kv[rows.slots(torch.arange(n_loc, device=q.device).view(1, -1), first)[0]]
        n_ent = n_loc // rate if entries is not None else 0
        ent_g = q.new_zeros((0, q.shape[2]))
        mask = torch.zeros(r.shape[0], 0, dtype=torch.bool, device=q.device)
        if n_ent:
            ends = ((torch.arange(n_ent, device=q.device) + 1) * rate - 1).view(1, -1)
            ent_g = entries[rows.slots(ends, first)[0]]
            if selected is None:  # HCA: every complete window
                mask = torch.arange(n_ent, device=q.device).view(1, -1) < torch.div(pos.view(-1, 1) + 1, rate,
                                                                                       rounding_mode="floor")
            else:
                mask = _entry_mask(selected[r], n_ent)
        out[r] = sink_attention_reference(q[r], pos, kv_g, ent_g, mask, sinks, scale, window)
    return out


# the plain fp32 rows formula the backward recomputes (reference backend): the stock op's (one definition)
_rows_plain = stock.sink_attention_rows_fp32


class SinkAttentionRowsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, entries, sinks, qpos, selected, rows, scale, window, rate):
        ctx.args = (rows, scale, window, rate)
        if backend_for(q) == "reference":
            ctx.save_for_backward(q, kv, entries, sinks, qpos, selected)
            return _rows_forward(q, qpos, kv, entries, selected, sinks, rows, scale, window, rate)
        # Triton: the forward also stores each row's logsumexp for the fused backward (same bits)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        out = triton_impl("compressed_attention", "sink_attention_rows")(
            q, qpos, kv, entries if entries.shape[0] else None, selected if selected.shape[1] else None, sinks,
            rows, scale, window, rate, lse=lse)
        ctx.save_for_backward(q, kv, entries, sinks, qpos, selected, out, lse)
        return out

    @staticmethod
    def backward(ctx, g):
        q, kv, entries, sinks, qpos, selected, *fwd = ctx.saved_tensors
        rows, scale, window, rate = ctx.args
        has_ent = entries.shape[0] > 0
        if fwd:  # Triton: the fused backward (kernels/triton/compressed_attention_bwd.py)
            out, lse = fwd
            dq, dkv, dent, dsink = triton_impl("compressed_attention_bwd", "sink_attention_rows_backward")(
                g, q, qpos, kv, entries if has_ent else None, selected if selected.shape[1] else None, sinks, rows,
                scale, window, rate, out, lse)
            grads = (dq, dkv, dent if has_ent else torch.zeros_like(entries), dsink)
            return (*(gr if n else None for gr, n in zip(grads, ctx.needs_input_grad[:4])),
                    None, None, None, None, None, None)
        return _rows_plain_backward(g, q, kv, entries, sinks, qpos, selected, rows, scale, window, rate,
                                    ctx.needs_input_grad[:4])


def _rows_plain_backward(g, q, kv, entries, sinks, qpos, selected, rows, scale, window, rate, needs):
    """The reference backend's backward: a plain fp32 recompute in row chunks."""
    has_ent = entries.shape[0] > 0
    width = window + (rows.max_len // rate if selected.shape[1] == 0 else selected.shape[1]) if has_ent else window
    step = max(1, _SCRATCH // max(1, width * max(q.shape[1], q.shape[2])))
    acc = [None] * 4
    for s in range(0, q.shape[0], step):  # row chunks bound the recompute's memory, not its value
        sl = slice(s, s + step)
        sub = rows.rows_slice(s, s + step)
        sel = selected[sl] if selected.shape[1] else None

        def fn(a, b, c, d, sl=sl, sel=sel, sub=sub):
            return _rows_plain(a, b, c if has_ent else None, d, qpos[sl], sel, sub, scale, window, rate)
        got = recompute_grads(fn, (q[sl], kv, entries, sinks), needs, (g[sl],))
        if needs[0]:
            acc[0] = [got[0]] if acc[0] is None else acc[0] + [got[0]]
        for i in (1, 2, 3):
            if needs[i] and got[i] is not None:
                acc[i] = got[i] if acc[i] is None else acc[i] + got[i]
    gq = torch.cat(acc[0]) if acc[0] else None
    return (gq, acc[1], acc[2], acc[3], None, None, None, None, None, None)


def _rows_forward(q, qpos, kv, entries, selected, sinks, rows, scale, window, rate):
    ent = entries if entries.shape[0] else None
    sel = selected if selected.shape[1] else None
    if backend_for(q) == "reference":
        return _rows_reference(q, qpos, kv, ent, sel, sinks, rows, scale, window, rate)
    return triton_impl("compressed_attention", "sink_attention_rows")(q, qpos, kv, ent, sel, sinks, rows, scale,
                                                                      window, rate)


def sink_attention_rows(q, qpos, kv, sinks, rows: KeyRows, *, scale: float, window: int, entries=None,
                        rate: int = 0, selected=None):
    """Every query row of a step: q [T, H, D] at absolute positions qpos [T]; kv [S, D] the K = V
    store and entries [S, D] (or None) the compressed-entry store, both addressed through
    ``rows`` (entry c of a sequence at the address of its position (c+1)*rate - 1); selected
    [T, k] int (CSA: each row's entry indices, -1 = none) or None (HCA: every complete window
    c < (t+1) // rate); sinks [H] fp32 -> [T, H, D].

    Invariance: a row's bits depend only on its own q, position, the keys and entries it sees
    and the sinks: never on the batch, the number of rows, the store's layout or block size.
    """
    op = "sink_attention_rows"
    for n, t in (("q", q), ("kv", kv), ("sinks", sinks)):
        check_float(n, t, op)
    check_int("qpos", qpos, op)
    if not isinstance(rows, KeyRows):
        raise ValueError(f"{op}: rows must be a KeyRows, got {type(rows).__name__}")
    if q.dim() != 3 or kv.dim() != 2 or kv.shape[1] != q.shape[2] or kv.dtype != q.dtype:
        raise ValueError(f"{op}: q [T, H, D] and kv [S, D] in q's dtype; got {tuple(q.shape)} {q.dtype}, "
                         f"{tuple(kv.shape)} {kv.dtype}")
    tq, h, d = q.shape
    if qpos.shape != (tq,) or sinks.shape != (h,):
        raise ValueError(f"{op}: qpos must be [T={tq}] and sinks [H={h}]; "
                         f"got {tuple(qpos.shape)}, {tuple(sinks.shape)}")
    if entries is not None:
        check_float("entries", entries, op)
        if entries.dim() != 2 or entries.shape[1] != d or entries.dtype != q.dtype:
            raise ValueError(f"{op}: entries must be [S, D={d}] in q's dtype, "
                             f"got {tuple(entries.shape)} {entries.dtype}")
        if not isinstance(rate, int) or rate < 1:
            raise ValueError(f"{op}: rate must be a positive int with entries, got {rate!r}")
    if selected is not None:
        check_int("selected", selected, op)
        if entries is None or selected.dim() != 2 or selected.shape[0] != tq:
            raise ValueError(f"{op}: selected must be [T={tq}, k] and comes with entries")
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"{op}: window must be a positive int, got {window!r}")
    check_same_device(op, q=q, qpos=qpos, kv=kv, entries=entries, selected=selected, sinks=sinks)
    if tq and host_readable(qpos):
        if int(qpos.max()) >= rows.max_len or int(qpos.min()) < 0:
            raise ValueError(f"{op}: a query position is outside 0..max_len-1 (max_len={rows.max_len})")
    elif tq:
        check_in_range(qpos, 0, rows.max_len,
                       f"{op}: a query position is outside 0..max_len-1 (max_len={rows.max_len})")
    ent = entries.contiguous() if entries is not None else q.new_zeros((0, d))
    sel = selected.contiguous() if selected is not None else torch.zeros(tq, 0, dtype=torch.int32, device=q.device)
    args = (q.contiguous(), kv.contiguous(), ent, sinks.contiguous(), qpos, sel, rows, float(scale), window,
            int(rate) if entries is not None else 1)
    if torch.is_grad_enabled() and any(t.requires_grad for t in args[:4]):
        return SinkAttentionRowsFunction.apply(*args)
    a = args
    return _rows_forward(a[0], a[4], a[1], a[2], a[5], a[3], a[6], a[7], a[8], a[9])

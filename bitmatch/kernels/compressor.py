"""compress_windows: DeepSeek-V4's KV compressor pooling (CSA and HCA), window by window.

A compressed entry w pools the projected tokens of one complete window of ``m`` tokens
(HCA: tokens w*m .. w*m+m-1) or, with ``overlap`` (CSA), 2m slots: window w-1's first-half
channels ("Ca", slots 0..m-1) then window w's second-half channels ("Cb", slots m..2m-1); for
w = 0 the Ca slots are absent (HF: zero kv, -inf gate: weight exactly 0). Per channel:

    z_j  = fp32(gate_j) + position_bias_j               (fp32, one rounding, as HF promotes)
    p    = fp32(softmax_j(z))                           exp64(z - max) / tree_sum over slots
    out  = round_dtype(tree_sum_j f64(kv_j) * f64(round_dtype(p_j)))

Canonical order: the softmax normalizer and the pooled sum are ``_exact.tree_sum`` folds over
the slot axis (fixed width m or 2m), the products exact in float64. So an entry's bits are a
function of its window's tokens alone: whether the window closes inside a full prefill, a
chunked prefill or a decode step, the entry is the same. (HF sums in the model dtype in torch's
order: parity to rounding, not bits.) RMSNorm and RoPE at position w*m follow as separate ops.

compress_rows: the same pooling for every row of a step, each row's window read from a
per-token store through its ``KeyRows`` addressing (the engine's paged caches or the trainer's
packed rows): compress_windows of the gathered windows, bit for bit, without gathering them
(the Triton backend reads the store in the kernel: one launch instead of a gather per slot
list, window and half).

Reference: CPU. Triton backend (CUDA): kernels/triton/compressor.py, the same structure in fp32
in one launch (``tl.exp``, the same folds): its own bits, invariant the same way (order version
2: version 1 composed torch ops, another exp).
"""
from __future__ import annotations

import torch

from . import _exact
from ._backend import (
    backend_for,
    check_float,
    check_int,
    check_same_device,
    needs_autograd,
    recompute_grads,
    triton_impl,
)

F64 = torch.float64
_ROWS_SCRATCH = 1 << 24  # elements of gathered windows per reference chunk (memory only, never bits)


def pooling_slots(kv, gate, bias, prev_kv, prev_gate, has_prev):
    """(kv [W, S, D], z [W, S, D] fp32, valid [W, S, 1]) over the S = m or 2m pooling slots."""
    m = kv.shape[1]
    if prev_kv is None:
        z = gate.float() + bias.float()
        return kv, z, None
    d = prev_kv.shape[-1]
    kv_all = torch.cat([prev_kv, kv[..., d:]], dim=1)
    z = torch.cat([prev_gate.float() + bias[:, :d].float(), gate[..., d:].float() + bias[:, d:].float()], dim=1)
    valid = torch.cat([has_prev.view(-1, 1).expand(-1, m), torch.ones_like(has_prev).view(-1, 1).expand(-1, m)], 1)
    return kv_all, z, valid.unsqueeze(-1)


def compress_reference(kv, gate, bias, prev_kv, prev_gate, has_prev):
    kv_all, z, valid = pooling_slots(kv, gate, bias, prev_kv, prev_gate, has_prev)
    z = z.to(F64)
    if valid is not None:
        z = torch.where(valid, z, -torch.inf)
    mx = z.amax(1, keepdim=True)
    e = _exact.exp64(z - mx)
    if valid is not None:
        e = torch.where(valid, e, 0.0)
    p = (e / _exact.tree_sum(e, 1).unsqueeze(1)).float().to(kv.dtype)  # HF: fp32 softmax, then .to(kv dtype)
    return _exact.tree_sum(kv_all.to(F64) * p.to(F64), 1).to(kv.dtype)


def _compress_plain(kv, gate, bias, prev_kv, prev_gate, has_prev):
    kv_all, z, valid = pooling_slots(kv, gate, bias, prev_kv, prev_gate, has_prev)
    if valid is not None:
        z = z.masked_fill(~valid, float("-inf"))
    return (kv_all.float() * z.softmax(1)).sum(1)


def _forward(kv, gate, bias, prev_kv, prev_gate, has_prev):
    if backend_for(kv) == "reference":
        return compress_reference(kv, gate, bias, prev_kv, prev_gate, has_prev)
    return triton_impl("compressor", "compress_windows")(kv, gate, bias, prev_kv, prev_gate, has_prev)


class CompressFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, gate, bias, prev_kv, prev_gate, has_prev):
        ctx.save_for_backward(kv, gate, bias, prev_kv, prev_gate, has_prev)
        return _forward(kv, gate, bias, prev_kv, prev_gate, has_prev)

    @staticmethod
    def backward(ctx, g):
        kv, gate, bias, prev_kv, prev_gate, has_prev = ctx.saved_tensors
        grads = recompute_grads(lambda a, b, c, d, e: _compress_plain(a, b, c, d, e, has_prev),
                                (kv, gate, bias, prev_kv, prev_gate), ctx.needs_input_grad[:5], (g,))
        return (*grads, None)


def compress_windows(kv, gate, position_bias, *, prev_kv=None, prev_gate=None, has_prev=None):
    """kv, gate [W, m, C] (W complete windows of m tokens, the compressor's projections in the
    compute dtype), position_bias [m, C] (fp32) -> pooled entries [W, D] in kv's dtype.

    HCA: C = D, no ``prev_*``. CSA (overlapping windows): C = 2D, ``prev_kv``/``prev_gate``
    [W, m, D] are each window's previous window's first-half channels and ``has_prev`` [W] bool
    says whether that window exists (False for window 0).
    Invariance: each entry's bits depend only on its own window's (and previous window's) rows.
    """
    op = "compress_windows"
    for n, t in (("kv", kv), ("gate", gate), ("position_bias", position_bias)):
        check_float(n, t, op)
    if kv.dim() != 3 or gate.shape != kv.shape:
        raise ValueError(f"{op}: kv and gate must be [W, m, C] of one shape, "
                         f"got {tuple(kv.shape)}, {tuple(gate.shape)}")
    w_, m, c = kv.shape
    if position_bias.shape != (m, c):
        raise ValueError(f"{op}: position_bias must be [m={m}, C={c}], got {tuple(position_bias.shape)}")
    overlap = prev_kv is not None
    if overlap != (prev_gate is not None) or overlap != (has_prev is not None):
        raise ValueError(f"{op}: prev_kv, prev_gate and has_prev go together (CSA) or not at all (HCA)")
    if overlap:
        if c % 2:
            raise ValueError(f"{op}: overlapping windows need C = 2D, got C={c}")
        check_float("prev_kv", prev_kv, op)
        check_float("prev_gate", prev_gate, op)
        if prev_kv.shape != (w_, m, c // 2) or prev_gate.shape != prev_kv.shape:
            raise ValueError(f"{op}: prev_kv/prev_gate must be [W={w_}, m={m}, D={c // 2}], got "
                             f"{tuple(prev_kv.shape)}, {tuple(prev_gate.shape)}")
        if has_prev.dtype != torch.bool or has_prev.shape != (w_,):
            raise ValueError(f"{op}: has_prev must be a bool tensor [W={w_}]")
        check_same_device(op, kv=kv, prev_kv=prev_kv, has_prev=has_prev)
    check_same_device(op, kv=kv, gate=gate, position_bias=position_bias)
    args = (kv.contiguous(), gate.contiguous(), position_bias.contiguous(),
            None if prev_kv is None else prev_kv.contiguous(), None if prev_gate is None else prev_gate.contiguous(),
            has_prev)
    if needs_autograd(kv, gate, position_bias, prev_kv, prev_gate):
        return CompressFunction.apply(*args)
    return _forward(*args)


def _gathered(raw_kv, raw_gate, positions, rows, rate, overlap):
    idx, prev, has = rows.window_slots(positions, rate, overlap)
    if not overlap:
        return raw_kv[idx], raw_gate[idx], None, None, None
    d = raw_kv.shape[-1] // 2
    return raw_kv[idx], raw_gate[idx], raw_kv[prev][..., :d], raw_gate[prev][..., :d], has


def _rows_forward(raw_kv, raw_gate, bias, positions, rows, rate, overlap):
    if backend_for(raw_kv) != "reference":
        return triton_impl("compressor", "compress_rows")(raw_kv, raw_gate, bias, positions, rows, rate, overlap)
    # rows in chunks: the gathered windows are [rows, m or 2m, C]; a row's entry is its own window's
    step = max(1, _ROWS_SCRATCH // (2 * rate * raw_kv.shape[-1]))
    out = []
    for s in range(0, positions.shape[0], step):
        g = _gathered(raw_kv, raw_gate, positions[s:s + step], rows.rows_slice(s, s + step), rate, overlap)
        out.append(compress_reference(g[0], g[1], bias, *(None if t is None else t.contiguous() for t in g[2:])))
    return torch.cat(out, 0) if len(out) != 1 else out[0]


class CompressRowsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, raw_kv, raw_gate, bias, positions, rows, rate, overlap):
        ctx.save_for_backward(raw_kv, raw_gate, bias, positions)
        ctx.rows, ctx.rate, ctx.overlap = rows, rate, overlap
        return _rows_forward(raw_kv, raw_gate, bias, positions, rows, rate, overlap)

    @staticmethod
    def backward(ctx, g):
        raw_kv, raw_gate, bias, positions = ctx.saved_tensors

        def plain(a, b, c):
            w = _gathered(a, b, positions, ctx.rows, ctx.rate, ctx.overlap)
            return _compress_plain(w[0], w[1], c, *w[2:])
        grads = recompute_grads(plain, (raw_kv, raw_gate, bias), ctx.needs_input_grad[:3], (g,))
        return (*grads, None, None, None, None)


def compress_rows(raw_kv, raw_gate, position_bias, positions, rows, *, rate, overlap):
    """raw_kv, raw_gate [S, C] (a per-token store: the compressor's projections), position_bias
    [m, C] fp32, positions [T] (int) and ``rows`` (``KeyRows`` of the T rows: where each row's
    positions live in the store) -> [T, D]: row t's entry is compress_windows of the window of
    ``rate`` tokens ending at its position (positions below 0 clamped to 0: a row whose window is
    not complete gets a value nobody reads) and, with ``overlap`` (CSA, C = 2D), the previous
    window's first half (absent while the position is below ``rate``).

    Invariance: each row's bits depend only on the store rows of its own windows (compress_windows
    of the gathered windows, bit for bit, on either backend).
    """
    op = "compress_rows"
    for n, t in (("raw_kv", raw_kv), ("raw_gate", raw_gate), ("position_bias", position_bias)):
        check_float(n, t, op)
    check_int("positions", positions, op)
    if raw_kv.dim() != 2 or raw_gate.shape != raw_kv.shape or raw_gate.dtype != raw_kv.dtype:
        raise ValueError(f"{op}: raw_kv and raw_gate must be [S, C] of one shape and dtype, got "
                         f"{tuple(raw_kv.shape)} {raw_kv.dtype}, {tuple(raw_gate.shape)} {raw_gate.dtype}")
    if not isinstance(rate, int) or rate < 1:
        raise ValueError(f"{op}: rate must be a positive int, got {rate!r}")
    c = raw_kv.shape[1]
    if position_bias.shape != (rate, c):
        raise ValueError(f"{op}: position_bias must be [rate={rate}, C={c}], got {tuple(position_bias.shape)}")
    if overlap and c % 2:
        raise ValueError(f"{op}: overlapping windows need C = 2D, got C={c}")
    if positions.dim() != 1:
        raise ValueError(f"{op}: positions must be [T], got {tuple(positions.shape)}")
    check_same_device(op, raw_kv=raw_kv, raw_gate=raw_gate, position_bias=position_bias, positions=positions)
    args = (raw_kv.contiguous(), raw_gate.contiguous(), position_bias.float().contiguous(), positions.long(),
            rows, rate, bool(overlap))
    if needs_autograd(raw_kv, raw_gate, position_bias):
        return CompressRowsFunction.apply(*args)
    return _rows_forward(*args)

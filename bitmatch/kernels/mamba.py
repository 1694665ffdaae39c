"""Mamba2 ops whose per-token bits do not depend on the schedule: causal_conv1d, mamba_chunk_scan,
gated_rms_norm. A token's output is the same whether it arrives in a full prefill, a chunked
prefill with any split, or a one-token decode, and whatever else shares the launch.

Canonical schedule (what fixes the bits). Chunks are aligned to ABSOLUTE positions: chunk c of a
sequence holds positions [c*Q, (c+1)*Q), Q = ``chunk_size``; S_c is the fp32 SSM state at the
start of chunk c (S_0 = 0). For a token at position t = c*Q + l:
- dt_t = clamp(round_dtype(softplus(round_dtype(dt_raw + dt_bias))), min=dt_min), as fp32
  (HF's rounding points); dA = fp32(dt * A); xdt = fp32(x * dt).
- Acum_l = dA_0 + dA_1 + ... + dA_l, summed in float64 left to right over the chunk's positions.
- y_t = fp32( Yoff + Ydiag + D * x_t ), evaluated in float64 in that order, where
  Yoff[h, p]  = tree_sum_n(C_t[n] * S_c[h, p, n]) * exp(Acum_l),
  Ydiag[h, p] = sum over s = 0, 1, ..., l (IN THAT ORDER, from 0.0) of
                tree_sum_n(C_t[n] * B_s[n]) * exp(Acum_l - Acum_s) * xdt_s[h, p].
- S_{c+1} = fp32( exp(Acum_{Q-1}) * S_c + sum over s = 0..Q-1 (in order) of
                  exp(Acum_{Q-1} - Acum_s) * B_s[n] * xdt_s[h, p] ).
So y_t depends only on S_c and the inputs at positions c*Q..t, S_{c+1} only on S_c and chunk c:
a prefill, any chunked prefill and a decode evaluate the same expressions on the same values.
With a per-sequence ``cache`` (ssm_state = S_c, and x / B / dt of the OPEN chunk's positions
c*Q..t-1), a call that starts at position t replays the open chunk from the buffer; the boundary
state is advanced exactly when a chunk's last position is processed. (exp: ``_exact.exp64``;
tree_sum: ``_exact.tree_sum`` over N; group g(h) = h // (H / G).)

causal_conv1d: out_t[c] = act(round_dtype(bias[c] + sum over j = 0..K-1 (in order, from 0.0) of
w[c, j] * x_{t-K+1+j}[c])) in float64, x before the sequence's first token = 0; act = silu
rounded to x.dtype (HF). ``conv_state`` holds the last K-1 inputs of each sequence.

gated_rms_norm: h = fp32(y * fp32(silu(z))); per group of ``group_size`` channels
inv = 1 / sqrt(tree_sum(h^2) / group_size + eps); out = fp32(weight * fp32(h * inv)).

Backward (trainer; correct, not invariant): on the Triton backend, kernels/triton/mamba_bwd.py (the
scan's chunk states and state gradients, then every chunk at once; conv and gated norm in one or two
launches each); on the reference backend, autograd of a plain differentiable fp32 version in torch
(scan_plain and friends). Triton (CUDA) forward: the scan in kernels/triton/mamba_ssd.py
(a chunked SSD with tensor-core products, bf16 dot operands for bf16 inputs), with its own
canonical order documented there; both backends share the schedule above (absolute chunks, the
open-chunk replay), each is bit-exact with itself across schedules, and they agree to rounding.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from . import _exact
from ._backend import (
    backend_for,
    check_float,
    check_int,
    check_on_device,
    host_readable,
    needs_autograd,
    recompute_grads,
    triton_impl,
)

F64 = torch.float64
_SOFTPLUS_THRESHOLD = 20.0  # torch's softplus returns x above it


def _silu64(v):
    return v / (1.0 + _exact.exp64(-v))


def _seqs(cu, cu_host=None):
    """(start, end) of each packed sequence: from the host copy when the caller has one (the
    trainer's layout: nothing read back), else read back from cu."""
    c = list(cu_host) if cu_host is not None else cu.tolist()
    return list(zip(c[:-1], c[1:]))


def _wanted(grads, needs):
    """The Triton backward's gradients, None where autograd asked for none (one per differentiable input)."""
    return [d if n else None for d, n in zip(grads, needs)]


def _check_host_bounds(op, cu_host, cu_seqlens, T):
    """The host copy of cu_seqlens: its shape and values checked on the host (never read back)."""
    if cu_host is None:
        return None
    c = tuple(int(v) for v in cu_host)
    if (len(c) != cu_seqlens.shape[0] or (c and (c[0] != 0 or c[-1] != T))
            or any(b < a for a, b in zip(c[:-1], c[1:]))):
        raise ValueError(f"{op}: cu_seqlens_host must be cu_seqlens' {cu_seqlens.shape[0]} values on the host "
                         f"(0 first, T={T} last, non-decreasing), got {c[:8]}{'...' if len(c) > 8 else ''}")
    return c


# ---------------------------------------------------------------- causal conv1d
def _conv_forward(x, weight, bias, cu, conv_state, slots, activation):
    if backend_for(x) == "reference":
        return conv1d_reference(x, weight, bias, cu, conv_state, slots, activation)
    return triton_impl("mamba", "causal_conv1d")(x, weight, bias, cu, conv_state, slots, activation)


def conv1d_reference(x, weight, bias, cu, conv_state, slots, activation):
    T, Cd = x.shape
    K = weight.shape[1]
    out = torch.empty_like(x)
    w64 = weight.to(F64)
    for b, (s, e) in enumerate(_seqs(cu)):
        prev = (conv_state[int(slots[b])] if conv_state is not None
                else torch.zeros(K - 1, Cd, dtype=x.dtype, device=x.device))
        full = torch.cat([prev.to(x.dtype), x[s:e]]).to(F64)  # [K-1+n, C]
        n = e - s
        acc = torch.zeros(n, Cd, dtype=F64, device=x.device)
        for j in range(K):
            acc = acc + full[j:j + n] * w64[:, j]
        if bias is not None:
            acc = acc + bias.to(F64)
        o = acc.to(x.dtype)
        if activation == "silu":
            o = _silu64(o.to(F64)).to(x.dtype)
        out[s:e] = o
        if conv_state is not None:
            conv_state[int(slots[b])] = full[-(K - 1):].to(conv_state.dtype) if K > 1 else conv_state[int(slots[b])]
    return out


def _conv_plain(x, weight, bias, cu, activation):
    """Differentiable fp32 conv over the packed tokens at once (the backward): tap j reads the
    token K-1-j back when it is in the same sequence (its offset in the sequence >= K-1-j), a
    zero before the sequence's start. Nothing is read back to the host."""
    T, K = x.shape[0], weight.shape[1]
    lens = (cu[1:] - cu[:-1]).long()
    offset = torch.arange(T, device=x.device) - torch.repeat_interleave(cu[:-1].long(), lens, output_size=T)
    xf, w = x.float(), weight.float()
    acc = xf * w[:, K - 1]
    for j in range(K - 1):
        back = K - 1 - j
        shifted = torch.cat([xf.new_zeros(min(back, T), xf.shape[1]), xf[:max(T - back, 0)]])
        acc = acc + torch.where((offset >= back).unsqueeze(1), shifted, 0.0) * w[:, j]
    if bias is not None:
        acc = acc + bias.float()
    return F.silu(acc) if activation == "silu" else acc


class _ConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cu, activation):
        ctx.save_for_backward(x, weight, bias, cu)
        ctx.activation = activation
        return _conv_forward(x, weight, bias, cu, None, None, activation)

    @staticmethod
    def backward(ctx, g):
        x, weight, bias, cu = ctx.saved_tensors
        if backend_for(x) == "triton":
            grads = triton_impl("mamba_bwd", "conv_backward")(g, x, weight, bias, cu, ctx.activation)
            return (*_wanted(grads, ctx.needs_input_grad), None, None)
        grads = recompute_grads(lambda a, w, b: _conv_plain(a, w, b, cu, ctx.activation), (x, weight, bias),
                                ctx.needs_input_grad[:3], (g,))
        return (*grads, None, None)


def _check_total(op, cu_seqlens, T):
    if not host_readable(cu_seqlens):  # on the device: a read per layer would stall every later launch
        check_on_device(cu_seqlens[-1] == T, f"{op}: cu_seqlens[-1] != T={T}")
    elif int(cu_seqlens[-1]) != T:
        raise ValueError(f"{op}: cu_seqlens[-1]={int(cu_seqlens[-1])} != T={T}")


def _check_state(op, name, t, shape, dtype, slots, n_seqs):
    if t.dim() != len(shape) + 1 or tuple(t.shape[1:]) != tuple(shape):
        raise ValueError(f"{op}: {name} must be [num_slots, {', '.join(map(str, shape))}], got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{op}: {name} must be {dtype}, got {t.dtype}")
    if slots is None:
        raise ValueError(f"{op}: {name} needs state_slots (one slot per sequence)")
    check_int("state_slots", slots, op)
    if slots.shape != (n_seqs,):
        raise ValueError(f"{op}: state_slots must be [{n_seqs}] (one per sequence), got {tuple(slots.shape)}")


def causal_conv1d(x, weight, bias, cu_seqlens, *, activation="silu", conv_state=None, state_slots=None,
                  cu_seqlens_host=None):
    """Depthwise causal conv over packed sequences: x [T, C] (bf16|fp32), weight [C, K], bias [C]
    or None, cu_seqlens int [B+1] -> [T, C] in x.dtype (canonical order: module docstring).

    ``conv_state`` [S, K-1, C] (x.dtype) with ``state_slots`` [B]: each sequence continues from
    the K-1 inputs stored in its slot (zeros for a new one), and the slot is updated in place.
    ``cu_seqlens_host``: cu_seqlens' values on the host (the trainer's layout), checked there instead
    of by a device assert.
    Invariance: each token's output depends only on its own and its K-1 predecessors' inputs.
    """
    op = "causal_conv1d"
    check_float("x", x, op)
    check_float("weight", weight, op)
    check_int("cu_seqlens", cu_seqlens, op)
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"{op}: x must be [T, C] and weight [C, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if bias is not None and bias.shape != (x.shape[1],):
        raise ValueError(f"{op}: bias must be [{x.shape[1]}], got {tuple(bias.shape)}")
    if activation not in (None, "silu"):
        raise ValueError(f"{op}: activation must be 'silu' or None, got {activation!r}")
    if _check_host_bounds(op, cu_seqlens_host, cu_seqlens, x.shape[0]) is None:
        _check_total(op, cu_seqlens, x.shape[0])
    w = weight.to(x.dtype).contiguous()
    b = None if bias is None else bias.to(x.dtype).contiguous()
    if conv_state is not None:
        _check_state(op, "conv_state", conv_state, (weight.shape[1] - 1, x.shape[1]), x.dtype, state_slots,
                     cu_seqlens.shape[0] - 1)
        return _conv_forward(x.contiguous(), w, b, cu_seqlens, conv_state, state_slots, activation)
    if needs_autograd(x, w, b):
        return _ConvFunction.apply(x.contiguous(), w, b, cu_seqlens, activation)
    return _conv_forward(x.contiguous(), w, b, cu_seqlens, None, None, activation)


# ---------------------------------------------------------------- chunked SSD scan
def process_dt(dt, dt_bias, dt_min):
    """dt_t = clamp(round_dtype(softplus(round_dtype(dt + dt_bias))), min=dt_min) as fp32 (elementwise)."""
    z = dt.to(F64) if dt_bias is None else (dt.to(F64) + dt_bias.to(F64)).to(dt.dtype).to(F64)
    sp = torch.where(z > _SOFTPLUS_THRESHOLD, z, _exact.log1p64(_exact.exp64(z.clamp(max=_SOFTPLUS_THRESHOLD))))
    sp = sp.to(dt.dtype)
    lo = torch.tensor(dt_min, dtype=F64).to(dt.dtype)
    return torch.where(sp < lo, lo, sp).float()


def _chunk(S, xs, dts, Bs, Cs, A, D, a, rep):
    """Chunk-local evaluation: xs/dts/Bs cover chunk positions 0..e-1, Cs the outputs a..e-1.
    Returns (y [e-a, H, P] fp32, Acum [e, H] f64, xdt [e, H, P] f64)."""
    e = xs.shape[0]
    dA = (dts * A).to(F64)                                     # fp32 product, exact in f64
    acum = _prefix(dA)                                         # float64, left to right
    xdt = (xs.float() * dts.unsqueeze(-1)).to(F64)             # fp32 product
    C64 = Cs.to(F64).repeat_interleave(rep, 1)                 # [n, H, N]
    B64 = Bs.to(F64).repeat_interleave(rep, 1)                 # [e, H, N]
    S64 = S.to(F64)
    la = acum[a:]                                              # [n, H]
    yoff = _exact.tree_sum(C64.unsqueeze(2) * S64.unsqueeze(0), -1) * _exact.exp64(la).unsqueeze(-1)
    G = _exact.tree_sum(C64.unsqueeze(1) * B64.unsqueeze(0), -1)  # [n, e, H]
    n = e - a
    ydiag = torch.zeros(n, *xs.shape[1:], dtype=F64, device=xs.device)
    lidx = torch.arange(a, e, device=xs.device)
    for s in range(e):
        m = G[:, s] * _exact.exp64(la - acum[s])               # [n, H]
        term = m.unsqueeze(-1) * xdt[s]
        ydiag = torch.where((lidx >= s).view(-1, 1, 1), ydiag + term, ydiag)
    dx = 0.0 if D is None else D.to(F64).view(1, -1, 1) * xs[a:].float().to(F64)
    y = ((yoff + ydiag) + dx).float()
    return y, acum, xdt, B64


def _prefix(v):
    out = torch.empty_like(v)
    acc = torch.zeros_like(v[0])
    for i in range(v.shape[0]):
        acc = acc + v[i]
        out[i] = acc
    return out


def _advance(S, acum, xdt, B64):
    """S_{c+1} of a complete chunk (sequential over its Q positions)."""
    last = acum[-1]
    acc = _exact.exp64(last).view(-1, 1, 1) * S.to(F64)
    for s in range(acum.shape[0]):
        w = _exact.exp64(last - acum[s]).view(-1, 1, 1)
        acc = acc + (w * xdt[s].unsqueeze(-1)) * B64[s].unsqueeze(1)
    return acc.float()


def scan_reference(x, dt, A, B, C, D, Q, cu, seq_start, cache, slots):
    T, H, P = x.shape
    G, N = B.shape[1:]
    rep = H // G
    y = torch.empty(T, H, P, dtype=torch.float32, device=x.device)
    A32 = A.float()
    for b, (s, e) in enumerate(_seqs(cu)):
        p0 = int(seq_start[b]) if seq_start is not None else 0
        if cache is not None:
            slot = int(slots[b])
            ssm, xbuf, bbuf, dtbuf = cache
            S = ssm[slot].clone()
        else:
            S = torch.zeros(H, P, N, dtype=torch.float32, device=x.device)
        l0 = p0 % Q
        # the open chunk's earlier positions come from the buffer (cache) - none without one
        px, pdt, pB = ((xbuf[slot, :l0].to(x.dtype), dtbuf[slot, :l0], bbuf[slot, :l0].to(B.dtype))
                       if cache is not None else (x[:0], dt[:0], B[:0]))
        i = s
        while i < e:
            take = min(Q - l0, e - i)
            xs = torch.cat([px, x[i:i + take]])
            dts = torch.cat([pdt, dt[i:i + take]])
            Bs = torch.cat([pB, B[i:i + take]])
            yc, acum, xdt, B64 = _chunk(S, xs, dts, Bs, C[i:i + take], A32, D, l0, rep)
            y[i:i + take] = yc
            if l0 + take == Q:
                S = _advance(S, acum, xdt, B64)
            elif cache is not None:
                xbuf[slot, l0:l0 + take] = x[i:i + take].to(xbuf.dtype)
                bbuf[slot, l0:l0 + take] = B[i:i + take].to(bbuf.dtype)
                dtbuf[slot, l0:l0 + take] = dt[i:i + take]
            i += take
            l0, px, pdt, pB = 0, x[:0], dt[:0], B[:0]
        if cache is not None:
            ssm[slot] = S
    return y


@functools.lru_cache(maxsize=8)  # every Mamba layer of a step has the same layout: built once
def _chunk_layout(seqs, Q, T, dev):
    """Every chunk of every sequence, built on the host and uploaded without a stream sync: token
    index of each chunk position [nc, Q] (clamped) and whether it is real, each chunk's cell on a
    [sequence, chunk index] grid [nc], each packed token's flat position in the [nc * Q] chunk
    rows [T], the grid's shape."""
    starts, lens, cells, rows = [], [], [], []
    width = max([(e - s + Q - 1) // Q for s, e in seqs] + [1])
    for b, (s, e) in enumerate(seqs):
        for j, c in enumerate(range(s, e, Q)):
            rows.extend(range(len(starts) * Q, len(starts) * Q + min(Q, e - c)))
            starts.append(c)
            lens.append(min(Q, e - c))
            cells.append(b * width + j)
    q = torch.arange(Q)
    idx = (torch.tensor(starts, dtype=torch.long)[:, None] + q[None, :]).clamp(max=max(T - 1, 0))
    valid = q[None, :] < torch.tensor(lens, dtype=torch.long)[:, None]

    def put(t):  # host -> device without a stream sync (pageable memory is staged at the call)
        return t.to(dev, non_blocking=True)
    return (put(idx), put(valid), put(torch.tensor(cells, dtype=torch.long)), put(torch.tensor(rows, dtype=torch.long)),
            len(seqs), width)


def scan_plain(x, dt, A, B, C, D, Q, cu, cu_host=None):
    """Differentiable fp32 SSD in torch (dt after softplus): the backward, and a device-side parity
    reference for benchmarks. Not invariant. Every chunk of every sequence at once (chunks padded
    to Q with dt = 0, x = 0: no decay, no input), then the states entering the chunks as one
    decay-weighted sum over earlier chunks: the same few dozen launches per call at any length.
    ``cu_host``: cu's values on the host (the trainer's packed layout); then nothing is read back."""
    T, H, P = x.shape
    G, N = B.shape[1:]
    rep = H // G
    dev = x.device
    seqs = tuple((s, e) for s, e in _seqs(cu, cu_host) if e > s)
    if not seqs:
        return x.new_zeros(T, H, P, dtype=torch.float32)
    idx, valid, flat, out_rows, nseq, width = _chunk_layout(seqs, Q, T, dev)
    nc = idx.shape[0]

    def rows(t):  # [T, ...] -> [nc, Q, ...] fp32, zeros past each chunk's end
        v = t[idx].float()
        return torch.where(valid.view(nc, Q, *([1] * (t.dim() - 1))), v, torch.zeros_like(v))
    xs, dts = rows(x), rows(dt)
    Bs, Cs = rows(B), rows(C)               # [nc, Q, G, N]: a group's heads share them (never repeated)
    acum = torch.cumsum(dts * A.float(), 1)                                       # [nc, Q, H]
    seg = acum.unsqueeze(2) - acum.unsqueeze(1)                                   # [nc, l, s, H]
    tri = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=dev)).view(1, Q, Q, 1)
    L = torch.where(tri, torch.exp(torch.where(tri, seg, torch.zeros_like(seg))), torch.zeros_like(seg))
    xdt = xs * dts.unsqueeze(-1)                                                  # [nc, Q, H, P]
    CB = torch.einsum("clgn,csgn->clsg", Cs, Bs)                                  # [nc, l, s, G]
    W = (L.view(nc, Q, Q, G, rep) * CB.unsqueeze(-1)).view(nc, Q, Q, H)
    yd = torch.einsum("clsh,cshp->clhp", W, xdt)
    last = acum[:, -1]                                                            # [nc, H]
    xdec = (torch.exp(last.unsqueeze(1) - acum).unsqueeze(-1) * xdt).view(nc, Q, G, rep, P)
    own = torch.einsum("csgrp,csgn->cgrpn", xdec, Bs).reshape(nc, H, P, N)
    # the state entering chunk j of a sequence: sum over its chunks i < j of own_i decayed by the
    # chunks strictly between them, exp(sum_{i<m<j} last_m). On a [sequence, chunk index] grid, the
    # segment sums are cumulative sums of masked copies (each its own sum, no difference of two
    # long cumulative sums), so one product covers every chunk: no step per chunk index
    lastg = last.new_zeros(nseq * width, H).index_copy(0, flat, last).view(nseq, width, H)
    ownv = own.view(nc, H * P * N)
    owng = ownv.new_zeros(nseq * width, H * P * N).index_copy(0, flat, ownv).view(nseq, width, H, P, N)
    w = torch.arange(width, device=dev)
    later = (w.view(-1, 1) > w.view(1, -1)).view(1, width, width, 1)              # [m, i]: m > i
    segs = torch.cumsum(torch.where(later, lastg.unsqueeze(2), torch.zeros((), device=dev)), 1)  # [nseq, j, i, H]
    done = (w.view(-1, 1) >= w.view(1, -1)).view(1, width, width, 1)               # i <= j
    decay = torch.where(done, torch.exp(torch.where(done, segs, torch.zeros_like(segs))), torch.zeros_like(segs))
    after = torch.einsum("bjih,bihpn->bjhpn", decay, owng)                          # state after chunk j
    enter = torch.cat([torch.zeros_like(after[:, :1]), after[:, :-1]], 1)           # state entering chunk j
    S_in = enter.flatten(0, 1)[flat]
    yo = torch.einsum("clgn,cgrpn->clgrp", Cs, S_in.view(nc, G, rep, P, N)).reshape(nc, Q, H, P)
    yo = yo * torch.exp(acum).unsqueeze(-1)
    y = yd + yo + (0.0 if D is None else D.float().view(1, 1, -1, 1) * xs)
    # the packed rows in order (an index, not a boolean mask: no data-dependent shape to read back)
    return y.reshape(nc * Q, H, P).index_select(0, out_rows)


def _scan_forward(x, dt_raw, A, B, C, D, dt_bias, Q, cu, dt_min, seq_start, cache, slots, stash=True):
    if backend_for(x) == "reference":
        return scan_reference(x, process_dt(dt_raw, dt_bias, dt_min), A, B, C, D, Q, cu, seq_start, cache, slots)
    return triton_impl("mamba", "mamba_chunk_scan")(x, dt_raw, A, B, C, D, dt_bias, Q, cu, dt_min, seq_start, cache,
                                                    slots, stash=stash)


class _ScanFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt_raw, A, B, C, D, dt_bias, Q, cu, dt_min, cu_host):
        ctx.save_for_backward(x, dt_raw, A, B, C, D, dt_bias, cu)
        ctx.cfg = (Q, dt_min, cu_host)
        return _scan_forward(x, dt_raw, A, B, C, D, dt_bias, Q, cu, dt_min, None, None, None)

    @staticmethod
    def backward(ctx, g):
        x, dt_raw, A, B, C, D, dt_bias, cu = ctx.saved_tensors
        Q, dt_min, cu_host = ctx.cfg
        if backend_for(x) == "triton":
            seqs = _seqs(cu, cu_host)
            grads = triton_impl("mamba_bwd", "scan_backward")(g, x, dt_raw, A, B, C, D, dt_bias, Q, seqs, dt_min)
            return (*_wanted(grads, ctx.needs_input_grad), None, None, None, None)

        def plain(x_, dr, A_, B_, C_, D_, db):
            z = dr.float() + (0.0 if db is None else db.float())
            dt = F.softplus(z).clamp(min=dt_min)
            return scan_plain(x_, dt, A_, B_, C_, D_, Q, cu, cu_host)
        grads = recompute_grads(plain, (x, dt_raw, A, B, C, D, dt_bias), ctx.needs_input_grad[:7], (g,))
        return (*grads, None, None, None, None)


def mamba_chunk_scan(x, dt, A, B, C, chunk_size, cu_seqlens, *, D=None, dt_bias=None, dt_min=0.0,
                     seq_start=None, cache=None, state_slots=None, cu_seqlens_host=None):
    """Mamba2 SSD over packed sequences on the canonical chunk schedule (module docstring).

    x [T, H, P], dt [T, H] (raw, before dt_bias and softplus), B, C [T, G, N] (bf16|fp32, one
    dtype), A [H] fp32 (= -exp(A_log)), D, dt_bias [H] -> y [T, H, P] fp32 (before the gate).
    Without ``cache`` every sequence starts at position 0 from a zero state. With ``cache`` =
    (ssm_state [S, H, P, N] fp32, x_buf [S, Q, H, P], B_buf [S, Q, G, N], dt_buf [S, Q, H] fp32)
    and ``state_slots`` [B], sequence b starts at position ``seq_start[b]``: its slot holds the
    state at the start of the open chunk and that chunk's earlier positions; both are updated.
    ``cu_seqlens_host``: cu_seqlens' values as host ints (the trainer's packed layout), which the
    backward reads instead of reading cu_seqlens back (no host sync in a training step).
    Invariance: a token's y depends only on its sequence's inputs up to it, never on the batch
    or on how the sequence was split into calls (prefill, chunked prefill, decode).
    """
    op = "mamba_chunk_scan"
    for name, t in (("x", x), ("dt", dt), ("B", B), ("C", C), ("A", A)):
        check_float(name, t, op)
    check_int("cu_seqlens", cu_seqlens, op)
    if x.dim() != 3 or dt.shape != x.shape[:2] or B.dim() != 3 or C.shape != B.shape or B.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: need x [T, H, P], dt [T, H], B = C [T, G, N]; got {tuple(x.shape)}, "
                         f"{tuple(dt.shape)}, {tuple(B.shape)}, {tuple(C.shape)}")
    T, H, P = x.shape
    G, N = B.shape[1:]
    if H % G:
        raise ValueError(f"{op}: heads H={H} must be a multiple of n_groups G={G}")
    if A.shape != (H,) or (D is not None and D.shape != (H,)) or (dt_bias is not None and dt_bias.shape != (H,)):
        raise ValueError(f"{op}: A, D and dt_bias must be [H={H}]")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be an int >= 1, got {chunk_size!r}")
    if B.dtype != x.dtype or C.dtype != x.dtype:
        raise ValueError(f"{op}: x, B and C must share one dtype, got {x.dtype}, {B.dtype}, {C.dtype}")
    cu_host = _check_host_bounds(op, cu_seqlens_host, cu_seqlens, T)
    if cu_host is None:  # the host copy, when given, was checked on the host: no device assert
        _check_total(op, cu_seqlens, T)
    if not (isinstance(dt_min, (int, float)) and math.isfinite(dt_min) and dt_min >= 0):
        raise ValueError(f"{op}: dt_min must be a finite float >= 0, got {dt_min!r}")
    nb = cu_seqlens.shape[0] - 1
    if cache is None:
        if seq_start is not None and bool((seq_start != 0).any()):
            raise ValueError(f"{op}: a sequence that starts past position 0 needs its cache (state + open chunk)")
    else:
        if len(cache) != 4:
            raise ValueError(f"{op}: cache must be (ssm_state, x_buf, B_buf, dt_buf)")
        Q = chunk_size
        for nm, t, shp, dt_ in (("ssm_state", cache[0], (H, P, N), torch.float32),
                                ("x_buf", cache[1], (Q, H, P), x.dtype),
                                ("B_buf", cache[2], (Q, G, N), x.dtype),
                                ("dt_buf", cache[3], (Q, H), torch.float32)):
            _check_state(op, nm, t, shp, dt_, state_slots, nb)
        if seq_start is None or seq_start.shape != (nb,):
            raise ValueError(f"{op}: with a cache, seq_start must be [{nb}] (each sequence's first position)")
    Df = None if D is None else D.float().contiguous()
    if cache is not None:
        # host bounds of one token per sequence (a decode step): no call closes a chunk and leaves
        # open rows, so the Triton scan needs no second launch for the buffers
        single = cu_host is not None and all(b - a <= 1 for a, b in zip(cu_host[:-1], cu_host[1:]))
        return _scan_forward(x.contiguous(), dt.contiguous(), A.float(), B.contiguous(), C.contiguous(), Df, dt_bias,
                             chunk_size, cu_seqlens, float(dt_min), seq_start, cache, state_slots, stash=not single)
    args = (x.contiguous(), dt.contiguous(), A.float(), B.contiguous(), C.contiguous(), Df, dt_bias)
    if needs_autograd(*args):
        return _ScanFunction.apply(*args, chunk_size, cu_seqlens, float(dt_min), cu_host)
    return _scan_forward(*args, chunk_size, cu_seqlens, float(dt_min), None, None, None)


# ---------------------------------------------------------------- gated RMSNorm
def gated_norm_reference(y, z, weight, group_size, eps):
    T, I = y.shape
    h = (y.float().to(F64) * _silu64(z.to(F64)).float().to(F64)).float()
    hg = h.to(F64).view(T, I // group_size, group_size)
    inv = 1.0 / torch.sqrt(_exact.tree_sum(hg * hg, -1) / group_size + eps)
    normed = (hg * inv.unsqueeze(-1)).float().view(T, I)
    return (weight.to(F64) * normed.to(F64)).float()


def _gated_plain(y, z, weight, group_size, eps):
    h = y.float() * F.silu(z.float())
    hg = h.view(h.shape[0], -1, group_size)
    hg = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * hg.view_as(h)


def _gated_forward(y, z, weight, group_size, eps):
    if backend_for(y) == "reference":
        return gated_norm_reference(y, z, weight, group_size, eps)
    return triton_impl("mamba", "gated_rms_norm")(y, z, weight, group_size, eps)


class _GatedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, z, weight, group_size, eps):
        ctx.save_for_backward(y, z, weight)
        ctx.cfg = (group_size, eps)
        return _gated_forward(y, z, weight, group_size, eps)

    @staticmethod
    def backward(ctx, g):
        y, z, weight = ctx.saved_tensors
        gs, eps = ctx.cfg
        if backend_for(y) == "triton":
            grads = triton_impl("mamba_bwd", "gated_backward")(g, y, z, weight, gs, eps)
            return (*_wanted(grads, ctx.needs_input_grad), None, None)
        grads = recompute_grads(lambda a, b, c: _gated_plain(a, b, c, gs, eps), (y, z, weight),
                                ctx.needs_input_grad[:3], (g,))
        return (*grads, None, None)


def gated_rms_norm(y, z, weight, group_size, eps):
    """RMSNorm of y * silu(z) over groups of ``group_size`` channels (Mamba2's norm, grouped by
    n_groups): y, z [T, I], weight [I] -> [T, I] fp32 (canonical order: module docstring).

    Invariance: each row's bits depend only on that row of y and z and the weight.
    """
    op = "gated_rms_norm"
    for name, t in (("y", y), ("z", z), ("weight", weight)):
        check_float(name, t, op)
    if y.dim() != 2 or z.shape != y.shape or weight.shape != (y.shape[1],):
        raise ValueError(f"{op}: y, z must be [T, I] and weight [I], got {tuple(y.shape)}, {tuple(z.shape)}, "
                         f"{tuple(weight.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or y.shape[1] % group_size:
        raise ValueError(f"{op}: group_size must divide I={y.shape[1]}, got {group_size!r}")
    if needs_autograd(y, z, weight):
        return _GatedFunction.apply(y.contiguous(), z.contiguous(), weight.contiguous(), group_size, float(eps))
    return _gated_forward(y.contiguous(), z.contiguous(), weight.contiguous(), group_size, float(eps))

"""Attention backward for packed varlen prefill (causal or not, GQA, sliding window).

Flash-attention-2 style, from the forward's saved base-2 logsumexp (lse2 = m + log2(l) of the
scores scaled by scale*log2(e)): P is recomputed tile by tile, never stored.

- _bwd_dq_kernel: one program per query tile (rows = tokens x the GQA heads of one KV head, as
  in the forward); computes delta = rowsum(dO * O) for its rows, stores it, then walks the KV
  blocks its rows can see and accumulates dQ.
- _bwd_dkdv_kernel: one program per KV block of one KV head, launched after the dQ kernel (it
  reads delta); walks the query tiles that can see the block (all G query heads of the group),
  accumulating dK and dV in registers: the GQA sum happens inside the program, no atomics.

Gradients need to be correct, not invariant: tile sizes are tuned freely (BWD_* knobs). Every
sum is still a fixed order for a given launch shape (no atomics), so a backward is
deterministic run to run.

A second backend, cuDNN's flash backward (what HF's SDPA runs on Hopper), takes the same saved
tensors: our forward's output and logsumexp (converted to cuDNN's natural-log stats) on
[B, H, S, D] views of the packed batch (a ragged causal batch is padded, see _cudnn_call).
BWD_BACKEND picks: "triton"; "cudnn" (raises, naming the reason, where it cannot run; a
ragged causal batch is padded); "auto" = cuDNN for causal batches of equal-length sequences
where it runs and passed a one-time check against the Triton backward on this device, Triton
for ragged or non-causal batches (padding costs more than cuDNN saves; the check covers causal
batches) and where cuDNN cannot run (a warning says why, once). torch calls cuDNN's attention
backward non-deterministic (two runs gave equal bits on an H100, which proves nothing): under
torch.use_deterministic_algorithms(True) "auto" picks Triton. The forward's bits are untouched.
"""
import os
import warnings

import torch
import triton
import triton.language as tl

from . import interpreting
from ._jit import dot

_LOG2E = 1.4426950408889634

# Launch knobs (free: the backward is not part of the canonical order, only the forward's bits
# are). Tuning rule: the fastest of the benchmarks/ops/gpu_ops.py attention_backward sweep at the
# target model's shapes; the backward stays deterministic run to run whatever they are.
BWD_DQ_BLOCK_M = 128
BWD_DQ_BLOCK_N = 64
BWD_DQ_WARPS = 8
BWD_DQ_STAGES = 3
BWD_KV_BLOCK_M = 32
BWD_KV_BLOCK_N = 64
BWD_KV_WARPS = 4
BWD_KV_STAGES = 3
BWD_BACKEND = os.environ.get("BITMATCH_ATTENTION_BWD", "auto")


@triton.jit
def _bwd_dq_kernel(q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_ptr,
                   qk_scale, sm_scale, window, Hq, Hkv, G, n_tiles,
                   D: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   INTERP: tl.constexpr, PREC: tl.constexpr):
    TPT: tl.constexpr = BLOCK_M // GP
    # late query tiles see the most keys under a causal mask: launch them first
    tile = n_tiles - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    kvh = bh % Hkv
    q0 = tl.load(cu_ptr + b)
    nq = tl.load(cu_ptr + b + 1) - q0
    t_lo = tile * TPT
    if t_lo >= nq:
        return
    r = tl.arange(0, BLOCK_M)
    tok = t_lo + r // GP
    g = r % GP
    row_ok = (tok < nq) & (g < G)
    rows = (q0 + tok).to(tl.int64) * Hq + kvh * G + g
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    rp = rows[:, None] * D + offs_d[None, :]
    q = tl.load(q_ptr + rp, mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptr + rp, mask=row_ok[:, None], other=0.0)
    o = tl.load(o_ptr + rp, mask=row_ok[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    tl.store(delta_ptr + rows, delta, mask=row_ok)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    t_hi = tl.minimum(nq, t_lo + TPT)
    if CAUSAL:
        kv_end = t_hi
    else:
        kv_end = nq
    kv_begin = 0
    if HAS_WINDOW:
        kv_begin = tl.maximum(0, t_lo - window + 1)
        kv_begin = (kv_begin // BLOCK_N) * BLOCK_N
    stride_tok = Hkv * D
    dq = tl.zeros((BLOCK_M, D), tl.float32)
    for j0 in range(kv_begin, kv_end, BLOCK_N):
        j = j0 + offs_n
        jok = j < nq
        base = (q0 + j).to(tl.int64) * stride_tok + kvh * D
        kt = tl.load(k_ptr + base[None, :] + offs_d[:, None], mask=jok[None, :], other=0.0)
        vt = tl.load(v_ptr + base[None, :] + offs_d[:, None], mask=jok[None, :], other=0.0)
        s = dot(q, kt, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), INTERP, PREC)
        p = tl.exp2(s * qk_scale - lse[:, None])
        # masks only where a row can miss a key of the block (diagonal, window edge, sequence
        # end); rows past the sequence or G have q = dO = lse = delta = 0: exact zero ds rows
        full = j0 + BLOCK_N <= nq
        if CAUSAL:
            full = full & (j0 + BLOCK_N - 1 <= t_lo)
        if HAS_WINDOW:
            full = full & (j0 > t_hi - 1 - window)
        if not full:
            vis = jok[None, :] & row_ok[:, None]
            if CAUSAL:
                vis = vis & (j[None, :] <= tok[:, None])
            if HAS_WINDOW:
                vis = vis & (j[None, :] > tok[:, None] - window)
            p = tl.where(vis, p, 0.0)
        dp = dot(do, vt, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), INTERP, PREC)
        ds = p * (dp - delta[:, None])
        dq = dot(ds.to(kt.dtype), tl.trans(kt), dq, INTERP, PREC)
    dq = dq * sm_scale
    tl.store(dq_ptr + rp, dq.to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_ptr,
                     qk_scale, sm_scale, window, Hq, Hkv, G,
                     D: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     INTERP: tl.constexpr, PREC: tl.constexpr):
    TPT: tl.constexpr = BLOCK_M // GP
    blk = tl.program_id(0)   # early KV blocks are seen by the most queries: launched first
    bh = tl.program_id(1)
    b = bh // Hkv
    kvh = bh % Hkv
    q0 = tl.load(cu_ptr + b)
    nq = tl.load(cu_ptr + b + 1) - q0
    j0 = blk * BLOCK_N
    if j0 >= nq:
        return
    offs_d = tl.arange(0, D)
    j = j0 + tl.arange(0, BLOCK_N)
    jok = j < nq
    stride_tok = Hkv * D
    kp = ((q0 + j).to(tl.int64) * stride_tok + kvh * D)[:, None] + offs_d[None, :]
    k = tl.load(k_ptr + kp, mask=jok[:, None], other=0.0)
    v = tl.load(v_ptr + kp, mask=jok[:, None], other=0.0)
    dk = tl.zeros((BLOCK_N, D), tl.float32)
    dv = tl.zeros((BLOCK_N, D), tl.float32)
    t_begin = 0
    if CAUSAL:
        t_begin = (j0 // TPT) * TPT
    t_end = nq
    if HAS_WINDOW:
        t_end = tl.minimum(nq, j0 + BLOCK_N - 1 + window)
    r = tl.arange(0, BLOCK_M)
    for t0 in range(t_begin, t_end, TPT):
        tok = t0 + r // GP
        g = r % GP
        row_ok = (tok < nq) & (g < G)
        rows = (q0 + tok).to(tl.int64) * Hq + kvh * G + g
        rpt = rows[None, :] * D + offs_d[:, None]
        qt = tl.load(q_ptr + rpt, mask=row_ok[None, :], other=0.0)      # [D, BLOCK_M]
        dot_ = tl.load(do_ptr + rpt, mask=row_ok[None, :], other=0.0)   # [D, BLOCK_M]
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
        st = dot(k, qt, tl.zeros((BLOCK_N, BLOCK_M), tl.float32), INTERP, PREC)
        pt = tl.exp2(st * qk_scale - lse[None, :])
        # rows past the sequence / G give exact zero contributions (q = dO = lse = delta = 0);
        # keys past the sequence only pollute their own dK/dV rows, which are not stored
        full = t0 >= 0
        if CAUSAL:
            full = full & (t0 >= j0 + BLOCK_N - 1)
        if HAS_WINDOW:
            full = full & (t0 + TPT - 1 < j0 + window)
        if not full:
            vis = jok[:, None] & row_ok[None, :]
            if CAUSAL:
                vis = vis & (j[:, None] <= tok[None, :])
            if HAS_WINDOW:
                vis = vis & (j[:, None] > tok[None, :] - window)
            pt = tl.where(vis, pt, 0.0)
        dv = dot(pt.to(v.dtype), tl.trans(dot_), dv, INTERP, PREC)
        dpt = dot(v, dot_, tl.zeros((BLOCK_N, BLOCK_M), tl.float32), INTERP, PREC)
        dst = pt * (dpt - delta[None, :])
        dk = dot(dst.to(k.dtype), tl.trans(qt), dk, INTERP, PREC)
    dk = dk * sm_scale
    tl.store(dk_ptr + kp, dk.to(dk_ptr.dtype.element_ty), mask=jok[:, None])
    tl.store(dv_ptr + kp, dv.to(dv_ptr.dtype.element_ty), mask=jok[:, None])


def attention_prefill_backward(do, q, k, v, o, lse, cu_seqlens, scale, causal=True,
                               sliding_window=None, *, max_seqlen=None):
    """Gradients (dq, dk, dv) of attention_prefill from its output o and base-2 logsumexp
    lse [T, Hq] (attention.attention_prefill(..., return_lse=True)). Inputs contiguous."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    GP = triton.next_power_of_2(G)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
    B = cu.numel() - 1
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if T == 0 or B == 0:
        return dq, dk.zero_(), dv.zero_()
    if max_seqlen is None:
        max_seqlen = int((cu[1:] - cu[:-1]).max().item())
    do = do.contiguous()
    delta = torch.empty((T, Hq), device=q.device, dtype=torch.float32)
    interp = interpreting(q)
    prec = "ieee" if (q.dtype == torch.float32 or interp) else "tf32"
    has_window = sliding_window is not None and sliding_window > 0
    win = int(sliding_window) if has_window else 0
    qk_scale = float(scale) * _LOG2E
    if interp:
        bm_q, bn_q, bm_kv, bn_kv = max(16, GP * 4), 16, max(16, GP * 4), 32
        kw_q = kw_kv = {}
    else:
        bm_q, bn_q = max(BWD_DQ_BLOCK_M, GP), BWD_DQ_BLOCK_N
        bm_kv, bn_kv = max(BWD_KV_BLOCK_M, GP), BWD_KV_BLOCK_N
        kw_q = dict(num_warps=BWD_DQ_WARPS, num_stages=BWD_DQ_STAGES)
        kw_kv = dict(num_warps=BWD_KV_WARPS, num_stages=BWD_KV_STAGES)
    common = dict(D=D, GP=GP, CAUSAL=bool(causal), HAS_WINDOW=has_window, INTERP=interp,
                  PREC=prec)
    n_tiles = triton.cdiv(max_seqlen, bm_q // GP)
    _bwd_dq_kernel[(n_tiles, B * Hkv)](q, k, v, o, do, lse, delta, dq, cu, qk_scale,
                                       float(scale), win, Hq, Hkv, G, n_tiles,
                                       BLOCK_M=bm_q, BLOCK_N=bn_q, **common, **kw_q)
    _bwd_dkdv_kernel[(triton.cdiv(max_seqlen, bn_kv), B * Hkv)](
        q, k, v, do, lse, delta, dk, dv, cu, qk_scale, float(scale), win, Hq, Hkv, G,
        BLOCK_M=bm_kv, BLOCK_N=bn_kv, **common, **kw_kv)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# cuDNN backend

_CUDNN_OK = {}   # device index -> (usable, reason): the one-time check's verdict
_LAYOUT = {}     # device index -> (stats dim names, stride order, "gqa" | "expand")
_LN2 = 0.6931471805599453


def _stats_layout(stats, B, H, S):
    """(names, order) of a cuDNN forward's stats tensor on a batch (B, H heads, S long): each dim
    named "B", "H", "S" or "1" by its size, and the dims from the slowest stride to the fastest."""
    names = tuple({B: "B", H: "H", S: "S", 1: "1"}.get(n, "?") for n in stats.shape)
    if sorted(n for n in names if n != "1") != ["B", "H", "S"]:
        raise RuntimeError(f"cuDNN forward's stats shape {tuple(stats.shape)} is not B x H x S (x 1)")
    return names, tuple(sorted(range(stats.dim()), key=lambda d: (-stats.stride(d), d)))


def _stats_for(lse_bsh, names, order_):
    """Our base-2 lse as [B, S, H] -> cuDNN's natural-log stats with the forward's dims and
    stride order."""
    B, S, H = lse_bsh.shape
    logical = (lse_bsh * _LN2).permute([{"B": 0, "S": 1, "H": 2}[n] for n in names if n != "1"])
    for d, n in enumerate(names):
        if n == "1":
            logical = logical.unsqueeze(d)
    sizes = [{"B": B, "S": S, "H": H, "1": 1}[n] for n in names]
    buf = torch.empty([sizes[d] for d in order_], device=lse_bsh.device, dtype=torch.float32)
    return buf.permute([order_.index(d) for d in range(len(names))]).copy_(logical)


def _cudnn_call(do, q, k, v, o, lse, cu, scale, causal, max_seqlen, layout=None):
    """cuDNN's dense SDPA backward on [B, H, S, D] views. torch 2.11's ragged op takes the head
    dim for the longest sequence (its s_q is query.size(2) of the packed [T, H, D] tensor), which
    breaks every sequence longer than D, so a ragged batch is padded: pad rows have q = dO = 0,
    so under the causal mask they add exactly nothing to dK / dV (dS = P * (dO V^T - rowsum(dO O))
    = 0), and their dQ is dropped."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    B, S = cu.numel() - 1, int(max_seqlen)
    names, order_, gqa = layout or _LAYOUT[q.device.index]
    if B * S == T:    # every sequence S long (the sum of B lengths <= S is T): views, no copies
        flat = None
        pad = lambda t: t.view((B, S) + tuple(t.shape[1:]))  # noqa: E731
    else:
        lens = cu[1:] - cu[:-1]
        seq = torch.repeat_interleave(torch.arange(B, device=q.device), lens, output_size=T)
        flat = seq * S + torch.arange(T, device=q.device) - cu[:-1].long()[seq]

        def pad(t):
            buf = t.new_zeros((B * S,) + tuple(t.shape[1:]))
            buf[flat] = t
            return buf.view((B, S) + tuple(t.shape[1:]))
    qv, kv, vv, ov, dov = (pad(t).transpose(1, 2) for t in (q, k, v, o, do))
    if gqa == "expand" and Hkv != Hq:
        kv, vv = (t.repeat_interleave(Hq // Hkv, dim=1) for t in (kv, vv))
    stats = _stats_for(pad(lse), names, order_)
    seed = torch.zeros((), device=q.device, dtype=torch.int64)   # no dropout: never read
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dov, qv, kv, vv, ov, stats, seed, seed, None, None, None, S, S, 0.0, bool(causal),
        scale=float(scale))
    if gqa == "expand" and Hkv != Hq:
        dk, dv = (t.view(B, Hkv, Hq // Hkv, S, D).float().sum(2).to(t.dtype) for t in (dk, dv))
    dq, dk, dv = (t.transpose(1, 2).reshape(B * S, t.shape[1], D) for t in (dq, dk, dv))
    if flat is not None:
        dq, dk, dv = dq[flat], dk[flat], dv[flat]
    return dq, dk, dv


def _math_forward(q, k, v, lens, scale):
    """(out, base-2 lse) of causal GQA attention per sequence in fp32 torch math: the check's
    forward (the bits of ours do not matter there; its saved-tensor format does)."""
    G = q.shape[1] // k.shape[1]
    outs, lses, s0 = [], [], 0
    for L in lens:
        qs, ks, vs = (t[s0:s0 + L].float().transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(G, 0), vs.repeat_interleave(G, 0)
        sc = (qs @ ks.transpose(1, 2)) * scale
        sc = sc.masked_fill(torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1), -torch.inf)
        lse = torch.logsumexp(sc, -1)
        outs.append((torch.exp(sc - lse[..., None]) @ vs).transpose(0, 1))
        lses.append((lse * _LOG2E).t())
        s0 += L
    return torch.cat(outs).to(q.dtype).contiguous(), torch.cat(lses).contiguous()


def _cudnn_check(device):
    """Once per device: learn the cuDNN forward's stats layout (and whether it takes GQA's
    fewer K/V heads), then run the cuDNN backward from a forward's output and base-2 lse (our
    saved-tensor format) on an equal and a ragged batch, both longer than the head dim, and
    compare with the Triton backward fed the same. (usable, reason)."""
    try:
        g = torch.Generator(device=device).manual_seed(0)
        Hq, Hkv, D, scale = 4, 2, 64, 0.125
        q, k, v = (torch.randn(2 * 80, h, D, device=device, dtype=torch.bfloat16, generator=g)
                   for h in (Hq, Hkv, Hkv))
        bhsd = lambda t: t.view(2, 80, t.shape[1], D).transpose(1, 2)  # noqa: E731
        fw = torch.ops.aten._scaled_dot_product_cudnn_attention(
            bhsd(q), bhsd(k).repeat_interleave(2, 1), bhsd(v).repeat_interleave(2, 1), None, True,
            0.0, True, False, scale=scale)
        names, order_ = _stats_layout(fw[1], 2, Hq, 80)
        verdicts = []
        for gqa in ("gqa", "expand"):
            layout = (names, order_, gqa)
            try:
                for lens in ([80, 80], [40, 150, 7]):
                    T, S = sum(lens), max(lens)
                    q, k, v, do = (torch.randn(T, h, D, device=device, dtype=torch.bfloat16,
                                               generator=g) for h in (Hq, Hkv, Hkv, Hq))
                    cu = torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
                    out, lse = _math_forward(q, k, v, lens, scale)
                    ref = attention_prefill_backward(do, q, k, v, out, lse, cu, scale, max_seqlen=S)
                    got = _cudnn_call(do, q, k, v, out, lse, cu, scale, True, S, layout)
                    for name, a, b in zip(("dq", "dk", "dv"), got, ref):
                        err = float((a.float() - b.float()).pow(2).mean().sqrt()
                                    / b.float().pow(2).mean().sqrt())
                        if not err < 2e-2:
                            raise RuntimeError(f"cuDNN {name} differs from the Triton backward "
                                               f"(rel rms {err:.3g}, lengths {lens})")
                _LAYOUT[device.index] = layout
                return True, f"checked against the Triton backward ({gqa})"
            except Exception as e:
                verdicts.append(f"{gqa}: {type(e).__name__}: {str(e)[:200]}")
        return False, "; ".join(verdicts)
    except Exception as e:  # the op missing in this torch build, no cuDNN SDPA, ...
        return False, f"{type(e).__name__}: {str(e)[:300]}"


def _cudnn_refusal(q, sliding_window):
    """Why the cuDNN backward cannot take this call (None: it can)."""
    if not q.is_cuda:
        return "tensors are not on CUDA"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {q.dtype} (cuDNN's flash backward takes bf16 / fp16)"
    if sliding_window is not None and sliding_window > 0:
        return "sliding window"
    if q.shape[-1] % 8 or q.shape[-1] > 128:
        return f"head dim {q.shape[-1]}"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "GPU older than sm_80"
    if torch.are_deterministic_algorithms_enabled():
        return "torch.use_deterministic_algorithms is on (cuDNN's dQ is not deterministic)"
    dev = q.device.index
    if dev not in _CUDNN_OK:
        _CUDNN_OK[dev] = _cudnn_check(q.device)
    ok, why = _CUDNN_OK[dev]
    return None if ok else why


_WARNED = set()


def attention_prefill_backward_any(do, q, k, v, o, lse, cu_seqlens, scale, causal=True,
                                   sliding_window=None, *, max_seqlen=None):
    """attention_prefill_backward on the backend BWD_BACKEND names (module docstring)."""
    backend = BWD_BACKEND
    if backend not in ("triton", "cudnn", "auto"):
        raise ValueError(f"attention backward: BWD_BACKEND / BITMATCH_ATTENTION_BWD must be "
                         f"'triton', 'cudnn' or 'auto', got {backend!r}")
    if backend != "triton" and q.shape[0] > 0:
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
        if max_seqlen is None:
            max_seqlen = int((cu[1:] - cu[:-1]).max().item())
        equal = max_seqlen * (cu.numel() - 1) == q.shape[0]
        # "auto" sends ragged and non-causal batches to Triton before any check: padding a ragged
        # batch for cuDNN costs more than cuDNN saves (H100, 4 sequences of 300-1500 tokens:
        # 1.07 ms against 0.53), and the one-time check covers causal batches only
        if backend == "cudnn" or (causal and equal):
            why = _cudnn_refusal(q, sliding_window) if causal else \
                "a non-causal batch (the one-time check covers causal ones)"
            if why is None:
                return _cudnn_call(do.contiguous(), q, k, v, o, lse, cu, scale, causal, max_seqlen)
            if backend == "cudnn":
                raise RuntimeError(f"attention backward: BWD_BACKEND='cudnn' cannot run here ({why}); "
                                   f"set it (or BITMATCH_ATTENTION_BWD) to 'auto' or 'triton'")
            if q.is_cuda and why not in _WARNED:
                _WARNED.add(why)
                warnings.warn(f"attention backward: the Triton kernels run, not cuDNN ({why})",
                              stacklevel=2)
    return attention_prefill_backward(do, q, k, v, o, lse, cu_seqlens, scale, causal,
                                      sliding_window, max_seqlen=max_seqlen)

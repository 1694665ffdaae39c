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
tensors: our forward's output and logsumexp (converted to cuDNN's natural-log stats), the packed
varlen batch through torch's ragged cuDNN op. BWD_BACKEND picks: "triton"; "cudnn" (raises,
naming the reason, where it cannot run); "auto" = cuDNN where it runs and passed a one-time check
against the Triton backward on this device, Triton otherwise (a warning says why, once).
cuDNN's dQ is not deterministic run to run: under torch.use_deterministic_algorithms(True),
"auto" picks Triton. Either way the forward's bits are untouched.
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
# are). Tuning rule: the fastest of the benchmarks/gpu_ops.py attention_backward sweep at the
# target model's shapes; the backward stays deterministic run to run whatever they are.
BWD_DQ_BLOCK_M = 128
BWD_DQ_BLOCK_N = 64
BWD_DQ_WARPS = 8
BWD_DQ_STAGES = 3
BWD_KV_BLOCK_M = 32
BWD_KV_BLOCK_N = 64
BWD_KV_WARPS = 4
BWD_KV_STAGES = 3
BWD_BACKEND = os.environ.get("BITMATCH_ATTENTION_BWD", "triton")


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


_LN2 = 0.6931471805599453
_STATS = {}      # device index -> the cuDNN forward's stats layout (_stats_layout)


def _stats_layout(stats, T, H):
    """(names, order) of a cuDNN forward's stats tensor on a batch of T tokens and H heads: each
    dim named "T", "H" or "1" by its size, and the dims from the slowest stride to the fastest."""
    names = tuple("T" if n == T else "H" if n == H else "1" if n == 1 else "?" for n in stats.shape)
    if sorted(n for n in names if n != "1") != ["H", "T"]:
        raise RuntimeError(f"cuDNN forward's stats shape {tuple(stats.shape)} is not T x H (x 1)")
    return names, tuple(sorted(range(stats.dim()), key=lambda d: (-stats.stride(d), d)))


def _stats_for(lse, T, H, dev):
    """Our base-2 lse [T, H] as cuDNN's natural-log stats, laid out as the cuDNN forward lays out
    its own (learned once per device by _cudnn_check): same dims, same stride order."""
    names, order_ = _STATS[dev]
    nat = lse * _LN2
    logical = nat if names.index("T") < names.index("H") else nat.t()
    for d, n in enumerate(names):
        if n == "1":
            logical = logical.unsqueeze(d)
    sizes = [T if n == "T" else H if n == "H" else 1 for n in names]
    buf = torch.empty([sizes[d] for d in order_], device=lse.device, dtype=torch.float32)
    buf = buf.permute([order_.index(d) for d in range(len(names))])
    return buf.copy_(logical)


def _cudnn_call(do, q, k, v, o, lse, cu, scale, causal, max_seqlen):
    T, Hq, _ = q.shape
    dev = q.device.index
    seed = torch.zeros((), device=q.device, dtype=torch.int64)   # no dropout: never read
    return torch.ops.aten._cudnn_attention_backward(
        do, q, k, v, o, _stats_for(lse, T, Hq, dev), seed, seed, None, cu, cu, max_seqlen,
        max_seqlen, 0.0, bool(causal), scale=float(scale))


def _cudnn_check(device):
    """Once per device: learn the cuDNN forward's stats layout on a small ragged batch, then run
    the cuDNN backward from OUR forward's output and lse there and compare with the Triton
    backward. (usable, reason)."""
    from .attention import attention_prefill
    dev = device.index
    try:
        g = torch.Generator(device=device).manual_seed(0)
        lens = [40, 88]
        T, Hq, Hkv, D = sum(lens), 4, 2, 64
        q, k, v, do = (torch.randn(T, h, D, device=device, dtype=torch.bfloat16, generator=g)
                       for h in (Hq, Hkv, Hkv, Hq))
        cu = torch.tensor([0, 40, 128], device=device, dtype=torch.int32)
        fw = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, 88, 88, True, 0.0,
                                                     True, False, scale=D ** -0.5)
        _STATS[dev] = _stats_layout(fw[1], T, Hq)
        out, lse = attention_prefill(q, k, v, cu, D ** -0.5, True, None, max_seqlen=88,
                                     return_lse=True)
        ref = attention_prefill_backward(do, q, k, v, out, lse, cu, D ** -0.5, max_seqlen=88)
        got = _cudnn_call(do, q, k, v, out, lse, cu, D ** -0.5, True, 88)
        for name, a, b in zip(("dq", "dk", "dv"), got, ref):
            err = float((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt())
            if not err < 2e-2:
                return False, f"cuDNN {name} differs from the Triton backward (rel rms {err:.3g})"
        return True, "checked against the Triton backward"
    except Exception as e:  # the op missing in this torch build, cuDNN without ragged SDPA, ...
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
        why = _cudnn_refusal(q, sliding_window)
        if why is None:
            cu = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
            if max_seqlen is None:
                max_seqlen = int((cu[1:] - cu[:-1]).max().item())
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

"""The row-wise ops on the GPU vs the stock torch ops (bits and time): a section of benchmarks/ops/gpu_ops.py.

rms_norm, fused_add_rms_norm, silu_and_mul, apply_rotary, token_logprobs and full_logprobs, each row
alone vs in a batch (control: torch's log_softmax), times against the stock torch ops, and the
public ops' training step (forward + backward) against stock autograd."""
import json
import os
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
from _common import BF, DEV, SHAPES, bench, rows_mismatch, triton_bench


def inv_rowwise(K):
    g = torch.Generator(device=DEV).manual_seed(2)
    H = 4096
    x = torch.randn(4096, H, device=DEV, dtype=BF, generator=g)
    r = torch.randn(4096, H, device=DEV, dtype=BF, generator=g)
    w = torch.randn(H, device=DEV, dtype=BF, generator=g)
    full = K.norm.rms_norm(x, w, 1e-6)
    fo, fr = K.norm.fused_add_rms_norm(x, r, w, 1e-6)
    xs = torch.randn(4096, 2 * 12288, device=DEV, dtype=BF, generator=g)
    fs = K.activation.silu_and_mul(xs)
    q = torch.randn(4096, 32, 128, device=DEV, dtype=BF, generator=g)
    k = torch.randn(4096, 8, 128, device=DEV, dtype=BF, generator=g)
    cos = torch.randn(4096, 64, device=DEV, generator=g)
    sin = torch.randn(4096, 64, device=DEV, generator=g)
    fq, fk = K.rotary.apply_rotary(q, k, cos, sin)
    V = 151936
    lg = torch.randn(512, V, device=DEV, dtype=BF, generator=g) * 3
    tok = torch.randint(0, V, (512,), device=DEV, generator=g)
    temp = torch.rand(512, device=DEV, generator=g) + 0.5
    flp = K.logprobs.token_logprobs(lg, tok, temp)
    ffull = K.logprobs.full_logprobs(lg[:64].contiguous(), temp[:64].contiguous())
    ctl = torch.log_softmax(lg.float() / temp[:, None], -1)
    out = {k_: 0 for k_ in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "apply_rotary",
                            "token_logprobs", "full_logprobs", "torch_log_softmax_control")}
    for M in (1, 3, 7, 64, 333, 1000):
        s = 11
        sl = slice(s, s + M)
        out["rms_norm"] += rows_mismatch(K.norm.rms_norm(x[sl].contiguous(), w, 1e-6), full[sl])
        a, b = K.norm.fused_add_rms_norm(x[sl].contiguous(), r[sl].contiguous(), w, 1e-6)
        out["fused_add_rms_norm"] += rows_mismatch(a, fo[sl]) + rows_mismatch(b, fr[sl])
        out["silu_and_mul"] += rows_mismatch(K.activation.silu_and_mul(xs[sl].contiguous()), fs[sl])
        a, b = K.rotary.apply_rotary(q[sl].contiguous(), k[sl].contiguous(), cos[sl].contiguous(),
                                     sin[sl].contiguous())
        out["apply_rotary"] += rows_mismatch(a, fq[sl]) + rows_mismatch(b, fk[sl])
        if s + M <= 512:
            out["token_logprobs"] += rows_mismatch(
                K.logprobs.token_logprobs(lg[sl].contiguous(), tok[sl].contiguous(),
                                          temp[sl].contiguous())[:, None], flp[sl][:, None])
            c = torch.log_softmax(lg[sl].float() / temp[sl][:, None], -1)
            out["torch_log_softmax_control"] += rows_mismatch(c, ctl[sl])
        if s + M <= 64:
            out["full_logprobs"] += rows_mismatch(
                K.logprobs.full_logprobs(lg[sl].contiguous(), temp[sl].contiguous()), ffull[sl])
    ref = torch.log_softmax(lg.float() / temp[:, None], -1).gather(1, tok[:, None])[:, 0]
    out["token_logprobs_max_abs_vs_torch"] = float((flp - ref).abs().max())
    out["token_equals_full_at_token"] = bool(torch.equal(ffull.gather(1, tok[:64, None])[:, 0], flp[:64]))
    return out
def time_rowwise(K):
    out = {}
    H = 4096
    for M in (16, 4096, 16384):
        xs = [torch.randn(M, H, device=DEV, dtype=BF) for _ in range(4)]
        rs = [torch.randn(M, H, device=DEV, dtype=BF) for _ in range(4)]
        w = torch.randn(H, device=DEV, dtype=BF)

        def torch_rms(x):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return w * h.to(x.dtype)

        def torch_fused(x, r):
            s = x + r
            return torch_rms(s), s

        nb = M * H * 2 * 2
        a = bench(lambda i: (lambda: torch_rms(xs[i % 4])), nb)
        b = bench(lambda i: (lambda: K.norm.rms_norm(xs[i % 4], w, 1e-6)), nb)
        out[f"rms_norm_M{M}"] = {"torch_ms": a, "ours_ms": b, "ratio": a / b}
        a = bench(lambda i: (lambda: torch_fused(xs[i % 4], rs[i % 4])), nb * 2)
        b = bench(lambda i: (lambda: K.norm.fused_add_rms_norm(xs[i % 4], rs[i % 4], w, 1e-6)), nb * 2)
        out[f"fused_add_rms_norm_M{M}"] = {"torch_ms": a, "ours_ms": b, "ratio": a / b}
        xs = rs = None  # frees them now (not del: the timed lambdas read these names)
        I = 12288
        xs = [torch.randn(M, 2 * I, device=DEV, dtype=BF) for _ in range(2)]
        a = bench(lambda i: (lambda: F.silu(xs[i % 2][:, :I]) * xs[i % 2][:, I:]), M * I * 6)
        b = bench(lambda i: (lambda: K.activation.silu_and_mul(xs[i % 2])), M * I * 6)
        out[f"silu_and_mul_M{M}"] = {"torch_ms": a, "ours_ms": b, "ratio": a / b}
        xs = None
        T = M
        qs = [torch.randn(T, 32, 128, device=DEV, dtype=BF) for _ in range(4)]
        kk = [torch.randn(T, 8, 128, device=DEV, dtype=BF) for _ in range(4)]
        cos = torch.randn(T, 64, device=DEV)
        sin = torch.randn(T, 64, device=DEV)
        cos2 = torch.cat([cos, cos], -1).to(BF)[:, None]
        sin2 = torch.cat([sin, sin], -1).to(BF)[:, None]

        def rot_half(x):
            return torch.cat([-x[..., 64:], x[..., :64]], -1)

        def torch_rot(q, k):
            return q * cos2 + rot_half(q) * sin2, k * cos2 + rot_half(k) * sin2

        nb = T * 40 * 128 * 2 * 2
        a = bench(lambda i: (lambda: torch_rot(qs[i % 4], kk[i % 4])), nb)
        b = bench(lambda i: (lambda: K.rotary.apply_rotary(qs[i % 4], kk[i % 4], cos, sin)), nb)
        out[f"apply_rotary_T{T}"] = {"torch_ms": a, "ours_ms": b, "ratio": a / b,
                                     "note": "torch side gets cos/sin pre-concatenated in bf16 (free)"}
        qs = kk = None
        torch.cuda.empty_cache()
    V = 151936
    for N in (64, 1024):
        lgs = [torch.randn(N, V, device=DEV, dtype=BF) * 3 for _ in range(2)]
        tok = torch.randint(0, V, (N,), device=DEV)
        temp = torch.rand(N, device=DEV) + 0.5
        nb = N * V * 2
        a = bench(lambda i: (lambda: torch.log_softmax(lgs[i % 2].float() / temp[:, None], -1)
                             .gather(1, tok[:, None])), nb)
        b = bench(lambda i: (lambda: K.logprobs.token_logprobs(lgs[i % 2], tok, temp)), nb)
        out[f"token_logprobs_N{N}"] = {"torch_ms": a, "ours_ms": b, "ratio": a / b}
        a = bench(lambda i: (lambda: torch.log_softmax(lgs[i % 2].float() / temp[:, None], -1)), nb)
        b = bench(lambda i: (lambda: K.logprobs.full_logprobs(lgs[i % 2], temp)), nb)
        out[f"full_logprobs_N{N}"] = {"torch_ms": a, "ours_ms": b, "ratio": a / b}
        lgs = None
    return out
def time_fwd_bwd_public(K):
    """Training step of the public ops (bitmatch.kernels, autograd) vs stock autograd, eager:
    linear at M = 4096 (its backward: stock matmuls in the operand dtype) and attention_prefill
    (Triton forward + flash backward, through kernels/attention.py's wiring)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import bitmatch.kernels as BK
    res = {"linear": {}, "attention": {}}
    for name in ("qkv", "o", "gate_up", "down"):
        N, Kd = SHAPES[name]
        M = 4096
        x = torch.randn(M, Kd, device=DEV, dtype=BF, requires_grad=True)
        w = (torch.randn(N, Kd, device=DEV, dtype=BF) * 0.02).requires_grad_()
        g = torch.randn(M, N, device=DEV, dtype=BF)
        t_st = triton_bench(lambda: torch.autograd.grad(F.linear(x, w), (x, w), g))
        t_us = triton_bench(lambda: torch.autograd.grad(BK.linear(x, w), (x, w), g))
        res["linear"][f"{name}_M{M}"] = {"stock_fwd_bwd_ms": t_st, "ours_fwd_bwd_ms": t_us,
                                         "ratio": t_st / t_us}
        print("fwd_bwd linear", name, t_st, t_us, flush=True)
        x = w = g = None
    Hq, Hkv, D, S, B = 32, 8, 128, 4096, 4
    T = S * B
    q, k, v = (torch.randn(T, h, D, device=DEV, dtype=BF) for h in (Hq, Hkv, Hkv))
    do = torch.randn(T, Hq, D, device=DEV, dtype=BF)
    cu = torch.arange(0, T + 1, S, dtype=torch.int32, device=DEV)
    lp = [t.clone().requires_grad_() for t in (q, k, v)]
    lf = [t.clone().requires_grad_() for t in (q, k, v)]
    gp = torch.autograd.grad(BK.attention_prefill(*lp, cu, D ** -0.5), lp, do)
    gf = torch.autograd.grad(K.attention.attention_prefill_autograd(*lf, cu, D ** -0.5), lf, do)
    res["attention"]["public_grads_equal_triton_function"] = all(
        bool(torch.equal(a, b)) for a, b in zip(gp, gf))
    qd, kd, vd = (x.view(B, S, -1, D).transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dod = do.view(B, S, Hq, D).transpose(1, 2).contiguous()

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=D ** -0.5,
                                                  enable_gqa=True)

    try:
        t_st = triton_bench(lambda: torch.autograd.grad(sdpa(), (qd, kd, vd), dod))
        t_us = triton_bench(lambda: torch.autograd.grad(BK.attention_prefill(*lp, cu, D ** -0.5),
                                                        lp, do))
        res["attention"][f"S{S}_B{B}"] = {"sdpa_flash_fwd_bwd_ms": t_st, "ours_public_fwd_bwd_ms": t_us,
                                          "ratio": t_st / t_us}
    except Exception:
        res["attention"]["error"] = traceback.format_exc()[-1500:]
    print("fwd_bwd attention", json.dumps(res["attention"]), flush=True)
    return res

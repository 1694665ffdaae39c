"""CPU: each bitmatch op vs the stock torch op on Qwen3-0.6B shapes, as ratios (stock/ours).

    python benchmarks/ops/cpu_ops.py [--out benchmarks/results/cpu.json] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import bitmatch.kernels as K

H, I, HQ, HKV, D, V = 1024, 3072, 16, 8, 128, 151936


def bench(fn, reps=3):
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/cpu.json")
    ap.add_argument("--quick", action="store_true", help="M = 1, 16 only")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    bf = torch.bfloat16
    ms = [1, 16] if a.quick else [1, 16, 256, 2048]
    rows = []

    def add(op, shape, m, ours, stock):
        to, ts = bench(ours), bench(stock)
        rows.append({"op": op, "shape": shape, "M": m, "bitmatch_ms": to * 1e3, "stock_ms": ts * 1e3,
                     "ratio": ts / to})
        print(f"{op:<18} {shape:<14} M={m:<5} bitmatch {to*1e3:9.2f} ms  stock {ts*1e3:9.2f} ms  ratio {ts/to:.3f}",
              flush=True)

    lin = {"qkv": (H, (HQ + 2 * HKV) * D), "o": (HQ * D, H), "gate_up": (H, 2 * I), "down": (I, H), "lm_head": (H, V)}
    for name, (k, n) in lin.items():
        w = torch.randn(n, k).to(bf) * 0.02
        for m in ms:
            if name == "lm_head" and m > 256:
                continue
            x = torch.randn(m, k).to(bf)
            add("linear", name, m, lambda: K.linear(x, w), lambda: F.linear(x, w))
    wn = torch.ones(H).to(bf)
    for m in ms:
        x, r = torch.randn(m, H).to(bf), torch.randn(m, H).to(bf)
        add("rms_norm", f"{H}", m, lambda: K.rms_norm(x, wn, 1e-6),
            lambda: wn * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(bf))
        add("fused_add_rms_norm", f"{H}", m, lambda: K.fused_add_rms_norm(x, r, wn, 1e-6),
            lambda: (lambda s: wn * (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-6))
                     .to(bf))(x + r))
        g = torch.randn(m, 2 * I).to(bf)
        add("silu_and_mul", f"{I}", m, lambda: K.silu_and_mul(g), lambda: F.silu(g[:, :I]) * g[:, I:])
        q, kk = torch.randn(m, HQ, D).to(bf), torch.randn(m, HKV, D).to(bf)
        cos, sin = K.rotary_cos_sin(torch.arange(m), D, 1e6, dtype=bf)
        c2, s2 = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
        rot = lambda t: torch.cat([-t[..., D // 2:], t[..., :D // 2]], -1)  # noqa: E731
        add("apply_rotary", f"{HQ}x{D}", m, lambda: K.apply_rotary(q, kk, cos, sin),
            lambda: (q * c2 + rot(q) * s2, kk * c2 + rot(kk) * s2))
        if m <= 256:
            lg, tok = torch.randn(m, V).to(bf), torch.randint(0, V, (m,))
            add("token_logprobs", f"V={V}", m, lambda: K.token_logprobs(lg, tok, 0.9),
                lambda: torch.log_softmax(lg.float() / 0.9, -1).gather(1, tok[:, None]))
    for n in ([128] if a.quick else [128, 512]):
        q, k, v = torch.randn(n, HQ, D).to(bf), torch.randn(n, HKV, D).to(bf), torch.randn(n, HKV, D).to(bf)
        cu = torch.tensor([0, n], dtype=torch.int32)
        kh, vh = k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1)
        add("attention_prefill", f"seq {n}", n, lambda: K.attention_prefill(q, k, v, cu, D ** -0.5),
            lambda: F.scaled_dot_product_attention(q.transpose(0, 1), kh, vh, is_causal=True))
    for b, ctx in [(1, 512), (16, 512)]:
        bs = 16
        nb = b * ctx // bs
        kc, vc = torch.randn(nb, bs, HKV, D).to(bf), torch.randn(nb, bs, HKV, D).to(bf)
        bt = torch.arange(nb, dtype=torch.int32).view(b, -1)
        lens = torch.full((b,), ctx, dtype=torch.int32)
        q = torch.randn(b, HQ, D).to(bf)
        kd = kc.view(b, ctx, HKV, D).repeat_interleave(2, 2).permute(0, 2, 1, 3)
        vd = vc.view(b, ctx, HKV, D).repeat_interleave(2, 2).permute(0, 2, 1, 3)
        add("attention_decode", f"ctx {ctx}", b, lambda: K.attention_decode(q, kc, vc, bt, lens, D ** -0.5),
            lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd))
    geo = lambda xs: float(torch.tensor(xs).log().mean().exp()) if xs else None  # noqa: E731
    summary = {op: geo([r["ratio"] for r in rows if r["op"] == op]) for op in dict.fromkeys(r["op"] for r in rows)}
    res = {"command": " ".join([sys.executable.split("/")[-1]] + sys.argv),
           "machine": platform.processor() or platform.machine(),
           "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
           "python": platform.python_version(), "note": "ratio = stock time / bitmatch time, same run; "
           "stock = torch eager bf16 (F.linear, SDPA, log_softmax)", "geomean_ratio_by_op": summary, "rows": rows}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

"""DeepSeek-V4's mHC ops on CUDA: the fused Triton kernels vs the torch composition and HF's modules.

hc_pre, hc_post, hc_head: the fused kernels against the torch composition they replaced and HF's own
modules, side by side in one run, plus their invariance checks there.

  python benchmarks/ops/mhc.py --out DIR [--tokens 1,16,64,512,4096] [--hidden 4096] [--hc 4]
      [--iters 20] [--rep 100] [--commit SHA]
  TRITON_INTERPRET=1 python benchmarks/ops/mhc.py --out DIR --device cpu   (tiny shapes: does it run)

Sides: "fused" (bitmatch.kernels, kernels/triton/mhc.py), "composed" (the previous Triton-backend
composition: kernels.linear for the mix, stream-order torch loops for the sums, ~170 launches of
Sinkhorn), "hf" (transformers' DeepseekV4HyperConnection / DeepseekV4HyperHead, and HF's hc_post
formula post * y + comb^T x). Timings: triton.testing.do_bench medians of eager calls and, where
a side captures, of CUDA-graph replays (do_bench_cudagraph); ratio = other side / fused. Inputs:
x bf16 [T, hc, hidden], fp32 parameters (V4-Flash: hidden 4096, hc_mult 4, 20 Sinkhorn
iterations). Checks on the device: each checked token alone and at batch sizes 1..T has the same
bits (fused; HF as the control, whose cuBLAS mix may pick its kernel by T), the error of each side
against a float64 evaluation of HF's formula. Writes DIR/mhc.json after every token count.
"""
import argparse
import json
import os
import sys
import time
import traceback

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
from _common import machine_info  # noqa: E402

KW = dict(eps=1e-6, norm_eps=1e-6)


# ---------------------------------------------------------------- the replaced composition
def composed(K):
    """The Triton backend's hc_pre / hc_head / hc_post before the fused kernels (kept here as
    the baseline): kernels.linear for the mixes, fixed-order torch loops for every sum."""
    from bitmatch.kernels._exact import tree_sum

    def osum(t, dim):
        t = t.movedim(dim, 0)
        acc = t[0]
        for i in range(1, t.shape[0]):
            acc = acc + t[i]
        return acc

    def collapse(x, pre):
        acc = pre[:, 0:1] * x[:, 0].float()
        for i in range(1, x.shape[1]):
            acc = acc + pre[:, i:i + 1] * x[:, i].float()
        return acc.to(x.dtype)

    def mix(x, fn, norm_eps):
        T, n, d = x.shape
        f = x.reshape(T, n * d).float()
        r = 1.0 / torch.sqrt(tree_sum(f * f, -1) / (n * d) + norm_eps)
        return K.linear(f * r.unsqueeze(-1), fn.float())

    def pre(x, fn, base, scale, iters, eps, norm_eps):
        T, n, _ = x.shape
        m = mix(x, fn, norm_eps)
        p = torch.sigmoid(m[:, :n] * scale[0] + base[:n]) + eps
        post = 2 * torch.sigmoid(m[:, n:2 * n] * scale[1] + base[n:2 * n])
        z = (m[:, 2 * n:] * scale[2] + base[2 * n:]).view(T, n, n)
        e = torch.exp(z - z.amax(-1, keepdim=True))
        comb = e / osum(e, -1).unsqueeze(-1) + eps
        comb = comb / (osum(comb, -2).unsqueeze(-2) + eps)
        for _ in range(iters - 1):
            comb = comb / (osum(comb, -1).unsqueeze(-1) + eps)
            comb = comb / (osum(comb, -2).unsqueeze(-2) + eps)
        return post, comb, collapse(x, p)

    def head(x, fn, base, scale, eps, norm_eps):
        return collapse(x, torch.sigmoid(mix(x, fn, norm_eps) * scale[0] + base) + eps)

    def post(x, y, p, c):
        dt = x.dtype
        p, c = p.to(dt).float(), c.to(dt).float()
        outs = []
        for k in range(x.shape[1]):
            mixed = c[:, 0, k:k + 1] * x[:, 0].float()
            for j in range(1, x.shape[1]):
                mixed = mixed + c[:, j, k:k + 1] * x[:, j].float()
            outs.append(((p[:, k:k + 1] * y.float()).to(dt).float() + mixed.to(dt).float()).to(dt))
        return torch.stack(outs, 1)
    return pre, head, post


# ---------------------------------------------------------------- HF
def hf_modules(cfg, device):
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
    conf = DeepseekV4Config(vocab_size=32, hidden_size=cfg.hidden, num_hidden_layers=1, hc_mult=cfg.hc,
                            hc_sinkhorn_iters=cfg.iters, hc_eps=KW["eps"], rms_norm_eps=KW["norm_eps"])
    g = torch.Generator().manual_seed(cfg.seed)
    mod, head = hf.DeepseekV4HyperConnection(conf), hf.DeepseekV4HyperHead(conf)
    with torch.no_grad():
        for m in (mod, head):
            for name, p in m.named_parameters():
                s = (cfg.hc * cfg.hidden) ** -0.5 * 2 if name.endswith("fn") else 0.3
                p.copy_(torch.randn(p.shape, generator=g) * s + (1.0 if name.endswith("scale") else 0.0))
    return mod.to(device).float(), head.to(device).float()


def hf_post(x, y, post, comb):
    return (post.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x.float())).to(x.dtype)


# ---------------------------------------------------------------- timing and checks
def bench(fn, cfg, graph=False):
    if cfg.device != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=cfg.rep, return_mode="median")
    return triton.testing.do_bench(fn, warmup=max(5, cfg.rep // 4), rep=cfg.rep, return_mode="median")


def rows_differ(a, b):
    a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    differ = a.view(torch.uint8 if a.dtype == torch.bool else a.dtype).ne(b) & ~(a.isnan() & b.isnan())
    return int(differ.any(-1).sum())


def invariance(fn, x, extra, sizes, toks):
    """Rows of ``toks`` computed alone and inside batches of ``sizes`` rows (the token at the end,
    neighbours before it): how many (token, size) cases differ in any output bit."""
    bad = 0
    for t in toks:
        alone = fn(x[t:t + 1], *(e[t:t + 1] for e in extra))
        for n in sizes:
            lo = max(0, t + 1 - n)
            idx = torch.cat([torch.arange(lo, t + 1), torch.arange(t + 1, t + 1 + n - (t + 1 - lo))]).to(x.device)
            idx = idx[idx < x.shape[0]]
            pos = int((idx == t).nonzero()[0, 0])
            got = fn(x[idx], *(e[idx] for e in extra))
            got = got if isinstance(got, tuple) else (got,)
            want = alone if isinstance(alone, tuple) else (alone,)
            bad += any(rows_differ(g[pos:pos + 1], w) for g, w in zip(got, want))
    return bad


def f64_reference(mod, head, x, y):
    """HF's formulas in float64 (the accuracy yardstick of every side)."""
    with torch.no_grad():
        m64, h64 = mod.double(), head.double()
        post, comb, col = (t[0] for t in m64(x.double()[None]))
        out = (post.unsqueeze(-1) * y.double().unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x.double()))
        hd = h64(x.double()[None])[0]
        mod.float(), head.float()
    return post, comb, col, out, hd


def run_tokens(K, cfg, T, mod, head, res):
    dev = cfg.device
    g = torch.Generator().manual_seed(cfg.seed + T)
    x = torch.randn(T, cfg.hc, cfg.hidden, generator=g).to(dev, torch.bfloat16)
    y = torch.randn(T, cfg.hidden, generator=g).to(dev, torch.bfloat16)
    pa = (mod.fn, mod.base, mod.scale)
    ha = (head.hc_fn, head.hc_base, head.hc_scale)
    c_pre, c_head, c_post = composed(K)
    sides = {
        "fused": (lambda: K.hc_pre(x, *pa, iters=cfg.iters, **KW), lambda: K.hc_head(x, *ha, **KW),
                  lambda p, c: K.hc_post(x, y, p, c)),
        "composed": (lambda: c_pre(x, *pa, cfg.iters, **KW), lambda: c_head(x, *ha, **KW),
                     lambda p, c: c_post(x, y, p, c)),
        "hf": (lambda: tuple(t[0] for t in mod(x[None])), lambda: head(x[None])[0], lambda p, c: hf_post(x, y, p, c)),
    }
    ref = f64_reference(mod, head, x, y)
    row = {"tokens": T, "ms": {}, "graph_ms": {}, "max_err_vs_f64": {}}
    for name, (pre, hd, post) in sides.items():
        with torch.no_grad():
            p, c, col = pre()
            outs = (p, c, col, post(p, c), hd())
            row["max_err_vs_f64"][name] = {k: float((o.double() - r).abs().max()) for k, o, r in
                                           zip(("post", "comb", "collapse", "hc_post", "hc_head"), outs, ref)}
            for op, fn in (("hc_pre", pre), ("hc_post", lambda: post(p, c)), ("hc_head", hd)):
                row["ms"].setdefault(op, {})[name] = bench(fn, cfg)
                if dev == "cuda":
                    try:
                        row["graph_ms"].setdefault(op, {})[name] = bench(fn, cfg, graph=True)
                    except Exception as exc:  # a side with host reads does not capture
                        row["graph_ms"].setdefault(op, {})[name] = f"no capture: {type(exc).__name__}"
    for key in ("ms", "graph_ms"):
        for op, d in row[key].items():
            f = d.get("fused")
            d["ratio_vs_fused"] = {k: (v / f if isinstance(v, float) and isinstance(f, float) else None)
                                   for k, v in d.items() if k != "fused"}
    toks = sorted({0, T // 2, T - 1})
    sizes = sorted({1, 2, min(7, T), min(33, T), T})
    with torch.no_grad():
        row["invariance_cases_differing"] = {
            "fused hc_pre": invariance(lambda a: K.hc_pre(a, *pa, iters=cfg.iters, **KW), x, (), sizes, toks),
            "fused hc_head": invariance(lambda a: K.hc_head(a, *ha, **KW), x, (), sizes, toks),
            "fused hc_post": invariance(lambda a, b, p, c: K.hc_post(a, b, p, c), x,
                                        (y, *sides["fused"][0]()[:2]), sizes, toks),
            "control hf hc_pre": invariance(lambda a: tuple(t[0] for t in mod(a[None])), x, (), sizes, toks),
        }
    res["runs"][str(T)] = row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,16,64,512,4096")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--hc", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms) per timing")
    ap.add_argument("--commit", default="")
    ap.add_argument("--device", default="cuda", help="cpu: tiny shapes in the Triton interpreter (does it run)")
    cfg = ap.parse_args(argv)
    if cfg.device == "cpu":
        cfg.hidden, cfg.tokens, cfg.iters = 64, "3,20", 4
    import bitmatch.kernels as K
    os.makedirs(cfg.out, exist_ok=True)
    path = os.path.join(cfg.out, "mhc.json")
    res = {"command": "python benchmarks/ops/mhc.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "config": vars(cfg), "machine": machine_info(cfg.device),
           "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": {}, "errors": {}}
    mod, head = hf_modules(cfg, cfg.device)
    with K.use_backend("triton"):  # CUDA: the default anyway; CPU: the kernels in the interpreter
        for T in (int(t) for t in cfg.tokens.split(",")):
            try:
                run_tokens(K, cfg, T, mod, head, res)
            except Exception:
                res["errors"][str(T)] = traceback.format_exc()
            with open(path, "w") as f:
                json.dump(res, f, indent=1, default=str)
            print(json.dumps({T: res["runs"].get(str(T), {}).get("ms", res["errors"].get(str(T)))}, default=str))
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

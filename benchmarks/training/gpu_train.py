"""Training on the GPU: bitmatch's forward + backward vs stock HF's (and each op's backward vs the stock op's).

The training half of the GPU end-to-end benchmark (also imported by benchmarks/engine/gpu_e2e.py).

Sections:
- backward_ops: each op's Triton backward (bitmatch.kernels autograd) on Qwen3-1.7B training
  shapes (8 x 1024 tokens): gradient error against float64 autograd next to the stock op's own
  error, and forward+backward time against the stock torch formulation HF runs (eager), as
  ratios stock_time / bitmatch_time, wall (eager, launch overhead included) and kernel time
  (the sum of the CUDA kernels of one call, torch profiler).
- train: bitmatch.token_logprobs forward+backward on the patched model vs the stock HF model
  (SDPA + cuBLAS, fp32 log_softmax(logits / T) over the full logits), random-weight Qwen3-1.7B at
  8 x 1024 and Qwen3-8B at 4 x 1024 (bf16): tokens/s ratio, peak memory, the top CUDA kernels
  of one step of each (torch profiler).

  python benchmarks/training/gpu_train.py --out DIR [--sections backward_ops,train] [--models 1.7b,8b]
      [--budget-s S]
writes DIR/gpu_train.json after every section and model.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
# the stock ops HF runs, one definition each: the op table's (kernels/stock.py)
import bitmatch.kernels.stock as KS
from _common import (
    BF,
    DEV,
    Recorder,
    cuda_ms,
    empty_cache,
    host_profile as host_profile_of,
    host_syncs,
    sync,
    top_kernels,
)

QWEN3 = {  # the public Qwen3 configs' shapes (random weights)
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, vocab_size=1000),
}
TRAIN_SHAPES = {"1.7b": (8, 1024), "8b": (4, 1024), "tiny": (2, 32)}


# ------------------------------------------------------------------ backward_ops
def _rel_err(g, g64):
    return float((g.double() - g64).abs().max() / g64.abs().max().clamp_min(1e-30))


def _op_case(name, ours, stock, inputs, grads_out, ref64):
    """fwd+bwd time of ours vs stock, and each one's gradient error vs float64 autograd."""
    def step(fn, leaves):
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return torch.autograd.grad(outs, [t for t in leaves if t.requires_grad], grads_out)

    def leaves_of():
        return [t.detach().clone().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in inputs]
    lo, ls = leaves_of(), leaves_of()
    l64 = [t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in inputs]
    outs64 = ref64(*l64)
    outs64 = outs64 if isinstance(outs64, tuple) else (outs64,)
    g64 = torch.autograd.grad(outs64, [t for t in l64 if t.requires_grad], [g.double() for g in grads_out])
    go, gs = step(ours, lo), step(stock, ls)
    res = {"ours_rel_err": [_rel_err(a, b) for a, b in zip(go, g64)],
           "stock_rel_err": [_rel_err(a, b) for a, b in zip(gs, g64)],
           "grad_dtypes": [str(a.dtype) for a in go]}
    del l64, g64, outs64
    t_s = cuda_ms(lambda: step(stock, ls))
    t_o = cuda_ms(lambda: step(ours, lo))
    k_s, k_o = top_kernels(lambda: step(stock, ls), k=6), top_kernels(lambda: step(ours, lo), k=6)
    res.update(stock_fwd_bwd_ms=t_s, ours_fwd_bwd_ms=t_o, ratio=t_s / t_o, stock_kernels=k_s, ours_kernels=k_o,
               kernel_time_ratio=(k_s["total_kernel_ms"] / k_o["total_kernel_ms"]) if k_s and k_o else None)
    print("backward_ops", name, json.dumps(res), flush=True)
    return res


def backward_ops(M=8192, H=2048, I=6144, Hq=16, Hkv=8, D=128, V=151936, N_lp=1024):
    import bitmatch.kernels as K
    dev = DEV
    r = lambda *s, scale=1.0: (torch.randn(*s, device=dev) * scale).to(BF)  # noqa: E731
    out = {"shapes": dict(M=M, H=H, I=I, Hq=Hq, Hkv=Hkv, D=D, V=V, N_logprob_rows=N_lp)}
    w = (1 + 0.1 * torch.randn(H, device=dev)).to(BF).requires_grad_()
    x, g = r(M, H).requires_grad_(), r(M, H)
    out["rms_norm"] = _op_case("rms_norm", lambda a, b: K.rms_norm(a, b, 1e-6), lambda a, b: KS.rms_norm(a, b, 1e-6),
                               [x, w], [g],
                               lambda a, b: b * a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6))
    wq = (1 + 0.1 * torch.randn(D, device=dev)).to(BF).requires_grad_()
    xq, gq = r(M, Hq, D).requires_grad_(), r(M, Hq, D)
    out["rms_norm_qk_heads"] = _op_case(
        "rms_norm_qk_heads", lambda a, b: K.rms_norm(a, b, 1e-6), lambda a, b: KS.rms_norm(a, b, 1e-6), [xq, wq], [gq],
        lambda a, b: b * a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6))
    res, g2 = r(M, H).requires_grad_(), r(M, H)

    def ref_fused(a, b, c):
        s = a + b
        return c * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6), s
    out["fused_add_rms_norm"] = _op_case("fused_add_rms_norm", lambda a, b, c: K.fused_add_rms_norm(a, b, c, 1e-6),
                                         lambda a, b, c: KS.fused_add_rms_norm(a, b, c, 1e-6), [x, res, w], [g, g2],
                                         ref_fused)
    del xq, gq, res, g2
    gu, ga = r(M, 2 * I).requires_grad_(), r(M, I)
    out["silu_and_mul"] = _op_case("silu_and_mul", K.silu_and_mul, KS.silu_and_mul, [gu], [ga],
                                   lambda a: F.silu(a[:, :I]) * a[:, I:])
    del gu, ga
    q, k = r(M, Hq, D).requires_grad_(), r(M, Hkv, D).requires_grad_()
    cos, sin = K.rotary_cos_sin(torch.arange(M, device=dev) % 1024, D, 1e6, dtype=torch.float32)
    gq_, gk_ = r(M, Hq, D), r(M, Hkv, D)

    def ref_rot(a, b, c, s):
        c2, s2 = torch.cat([c, c], -1).to(BF).double()[:, None], torch.cat([s, s], -1).to(BF).double()[:, None]
        h = D // 2
        return tuple(t * c2 + torch.cat([-t[..., h:], t[..., :h]], -1) * s2 for t in (a, b))
    out["apply_rotary"] = _op_case("apply_rotary", K.apply_rotary, KS.apply_rotary, [q, k, cos, sin], [gq_, gk_],
                                   ref_rot)
    del q, k, gq_, gk_
    lg = r(N_lp, V, scale=3.0).requires_grad_()
    tok = torch.randint(0, V, (N_lp,), device=dev)
    glp = torch.randn(N_lp, device=dev)
    out["token_logprobs"] = _op_case(
        "token_logprobs", lambda a: K.token_logprobs(a, tok, 0.7), lambda a: KS.token_logprobs(a, tok, 0.7),
        [lg], [glp],
        lambda a: torch.log_softmax(a / 0.7, -1).gather(1, tok[:, None])[:, 0])
    return out


# ------------------------------------------------------------------ train
def build_model(size, attn="sdpa", seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(**{"vocab_size": 151936, **QWEN3[size]}, max_position_embeddings=40960,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, attn_implementation=attn)
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(BF)  # built in bf16 on the device: no fp32 copy of 8B weights
    try:
        with torch.device(DEV):
            m = Qwen3ForCausalLM(cfg).to(BF)
    finally:
        torch.set_default_dtype(prev)
    return m.eval()


def stock_token_logprobs(model, ids, temperature):
    """The stock trainer: HF forward (SDPA, cuBLAS), fp32 log_softmax(logits / T) at the next token."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    lp = torch.log_softmax(logits.float() / temperature, -1)
    return lp.gather(-1, ids[:, 1:, None])[..., 0]


def train_step_fns(model, ids, temperature=1.0):
    """(stock, ours) training steps: zero grads, logprobs of the next tokens, a weighted sum,
    backward. ``stock`` needs the model unpatched, ``ours`` patched."""
    import bitmatch
    w = torch.randn(ids.shape[0], ids.shape[1] - 1, device=ids.device)

    def stock():
        model.zero_grad(set_to_none=True)
        (stock_token_logprobs(model, ids, temperature) * w).sum().backward()

    def ours():
        model.zero_grad(set_to_none=True)
        (bitmatch.token_logprobs(model, ids, None, temperature=temperature) * w).sum().backward()
    return stock, ours


def _peak(model, fn):
    """(peak GiB above the weights, weights GiB) of one call of fn."""
    model.zero_grad(set_to_none=True)
    if DEV != "cuda":
        fn()
        return 0.0, 0.0
    sync()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    sync()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 30, base / 2 ** 30


def train(size, profile=True, iters=3):
    import bitmatch
    B, L = TRAIN_SHAPES[size]
    empty_cache()
    held = torch.cuda.memory_allocated() / 2**30 if DEV == "cuda" else 0.0
    model = build_model(size)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (B, L), device=DEV)
    stock, ours = train_step_fns(model, ids)
    res = {"batch": [B, L], "gib_held_at_start": held}
    res["stock_peak_gib"], res["weights_gib"] = _peak(model, stock)
    t_s = cuda_ms(stock, iters=iters, warmup=1)
    if profile:
        res["profile_stock"] = top_kernels(stock)
        res["host_syncs_stock"] = host_syncs(stock)
    bitmatch.patch(model)
    res["ours_peak_gib"], _ = _peak(model, ours)
    t_o = cuda_ms(ours, iters=iters, warmup=1)
    if profile:
        res["profile_ours"] = top_kernels(ours)
        res["host_syncs_ours"] = host_syncs(ours)
        res["host_profile_ours"] = host_profile_of(ours, k=25)
    res.update(stock_step_ms=t_s, ours_step_ms=t_o, stock_tokens_per_s=B * L / t_s * 1e3,
               ours_tokens_per_s=B * L / t_o * 1e3, tokens_per_s_ratio=t_s / t_o,
               peak_memory_ratio=res["ours_peak_gib"] / max(res["stock_peak_gib"], 1e-9))
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        probe = bitmatch.token_logprobs(model, ids[:1], None)
    del stock
    empty_cache()
    res.update(liger(size, ids, t_o, res["ours_peak_gib"], iters, profile, ours=(model, ours, probe)))
    del model, ours   # the step closure holds the model too
    empty_cache()
    print("train", size, json.dumps({k: v for k, v in res.items() if not k.startswith("profile")}), flush=True)
    return res


def grad_agreement(model, hf, ours, stock) -> dict:
    """Each parameter's gradient of one step on each side (same weights, same tokens): max |ours -
    HF| / max |HF|; the two forwards differ by bf16 rounding, so this says the backward is the right
    one (a wrong term shows as O(1)), not how exact it is. The worst few and the median."""
    grads = {}
    for m, step, key in ((hf, stock, "hf"), (model, ours, "ours")):
        m.train()
        step()
        for n, p in m.named_parameters():
            if p.grad is not None:
                grads.setdefault(n, {})[key] = p.grad.float().clone()
        m.zero_grad(set_to_none=True)
        m.eval()
    errs = {n: float((g["ours"] - g["hf"]).abs().max() / g["hf"].abs().max().clamp_min(1e-30))
            for n, g in grads.items() if len(g) == 2}
    worst = sorted(errs.items(), key=lambda kv: -kv[1])
    return {"params": len(errs), "missing": sorted(n for n, g in grads.items() if len(g) != 2)[:8],
            "median_rel_err": statistics.median(errs.values()) if errs else None, "worst": dict(worst[:6])}


def train_compare(model, hf, B, L, vocab, device, syncs=False, host_profile=False, seed=3, grads=False) -> dict:
    """One training step of each side on the same B x L random tokens: bitmatch.token_logprobs
    fwd + bwd on ``model`` (patched) vs HF's own forward + backward on ``hf`` (the stock trainer):
    peak memory above the weights, step time, tokens/s, top kernels (and host syncs, host profile)."""
    import bitmatch
    ids = torch.randint(0, vocab, (B, L), device=device, generator=torch.Generator(device).manual_seed(seed))
    w = torch.randn(B, L - 1, device=device, generator=torch.Generator(device).manual_seed(seed + 1))

    def stock():
        hf.zero_grad(set_to_none=True)
        (stock_token_logprobs(hf, ids, 1.0) * w).sum().backward()

    def ours():
        model.zero_grad(set_to_none=True)
        (bitmatch.token_logprobs(model, ids, None, temperature=1.0) * w).sum().backward()
    res = {"batch": [B, L]}
    for name, m, step in (("stock", hf, stock), ("ours", model, ours)):
        m.train()
        try:
            res[f"{name}_peak_gib"], res["weights_gib"] = _peak(m, step)
            res[f"{name}_step_ms"] = cuda_ms(step, iters=3, warmup=1)
            res[f"profile_{name}"] = top_kernels(step, k=10)
            if syncs:
                res[f"host_syncs_{name}"] = host_syncs(step)
            if host_profile:
                res[f"host_profile_{name}"] = host_profile_of(step)
        finally:
            m.zero_grad(set_to_none=True)
            m.eval()
    if grads:
        res["grad_agreement"] = grad_agreement(model, hf, ours, stock)
    res.update(stock_tokens_per_s=B * L / res["stock_step_ms"] * 1e3,
               ours_tokens_per_s=B * L / res["ours_step_ms"] * 1e3,
               tokens_per_s_ratio=res["stock_step_ms"] / res["ours_step_ms"],
               peak_memory_ratio=res["ours_peak_gib"] / max(res["stock_peak_gib"], 1e-9))
    print("train", {k: v for k, v in res.items() if not k.startswith("profile")}, flush=True)
    empty_cache()
    return res


def bwd_gemm_layouts(M=4096, reps=20):
    """The trainer's backward GEMMs (kernels/linear.py, LinearFunction.backward) at the 8B shapes,
    M = 4 x 1024: as called (gx = g @ W, gw = g^T @ x) and as the transposed products (cuBLAS
    then picks other kernels), the transposed result made contiguous or not; ms per call over
    ``reps`` back-to-back calls, and the kernel each ran."""
    shapes = {"q_o": (4096, 4096), "k_v": (1024, 4096), "gate_up": (12288, 4096), "down": (4096, 12288)}
    out = {}
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K, device=DEV, dtype=BF) * 0.02
        x = torch.randn(M, K, device=DEV, dtype=BF)
        g = torch.randn(M, N, device=DEV, dtype=BF)
        fns = {"gx_g@W": lambda: g @ w, "gx_(Wt@gt)t": lambda: (w.t() @ g.t()).t(),
               "gx_(Wt@gt)t_contiguous": lambda: (w.t() @ g.t()).t().contiguous(),
               "gw_gt@x": lambda: g.t() @ x, "gw_(xt@g)t": lambda: (x.t() @ g).t(),
               "gw_(xt@g)t_contiguous": lambda: (x.t() @ g).t().contiguous()}
        r = {}
        for k, fn in fns.items():
            for _ in range(3):
                fn()
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
            top = top_kernels(fn, k=2) or {}
            r[k] = {"ms": (time.perf_counter() - t0) * 1e3 / reps,
                    "kernels": [t["name"][:70] for t in top.get("top", [])]}
        out[name] = r
        print("bwd_gemm", name, json.dumps({k: round(v["ms"], 4) for k, v in r.items()}), flush=True)
        empty_cache()
    return out


def alternate(steps: dict, iters: int) -> dict:
    """Median wall ms of each ``name: (model, step)``, the steps taken in turn ``iters`` times
    (a, b, a, b, ...: clock and thermal drift fall on both sides alike); grads freed after each
    step, outside its time, so one side's gradients do not sit in memory while the other runs."""
    ts = {k: [] for k in steps}
    for _ in range(iters):
        for k, (model, fn) in steps.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ts[k].append((time.perf_counter() - t0) * 1e3)
            model.zero_grad(set_to_none=True)
    return {k: statistics.median(v) for k, v in ts.items()}


def liger(size, ids, ours_ms, ours_peak, iters, profile=True, ours=None) -> dict:
    """The training baseline TRL users enable (GRPOConfig(use_liger_kernel=True)): HF + Liger's
    Triton rms_norm, swiglu and rope on a fresh copy of the same model (same seed). With ``ours``
    = (patched model, its step, its logprobs of ids[:1] before Liger) the two steps are timed in
    turn (``alternate``) and the ratio is theirs; the logprobs are checked unchanged with Liger's
    module-level swaps in place (bitmatch's forward must not read HF's functions)."""
    try:
        import liger_kernel
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3
    except ImportError as e:
        return {"liger": f"not installed ({e}); carry the liger-kernel wheel"}
    import transformers.models.qwen3.modeling_qwen3 as mq
    saved = dict(vars(mq))   # Liger swaps module-level functions and classes: put them back after,
    try:                     # or every later "stock HF" row of this process would be HF + Liger
        model = build_model(size)
        model.train()
        apply_liger_kernel_to_qwen3(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
        stock, _ = train_step_fns(model, ids)
        peak, _ = _peak(model, stock)
        t_l = cuda_ms(stock, iters=iters, warmup=1)
        prof = {"profile_liger": top_kernels(stock, k=16)} if profile else {}
        if ours is not None:
            import bitmatch
            om, ostep, probe = ours
            with torch.no_grad():
                same = bool(torch.equal(bitmatch.token_logprobs(om, ids[:1], None), probe))
            alt = alternate({"liger": (model, stock), "ours": (om, ostep)}, iters=max(iters, 6))
            prof.update(ours_bits_unchanged_beside_liger=same, alternating={
                "iters": max(iters, 6), "liger_step_ms": alt["liger"], "ours_step_ms": alt["ours"],
                "tokens_per_s_ratio_vs_liger": alt["liger"] / alt["ours"]})
            t_l, ours_ms = alt["liger"], alt["ours"]
    finally:
        for k in set(vars(mq)) - set(saved):
            delattr(mq, k)
        for k, v in saved.items():
            setattr(mq, k, v)
    out = {**prof, "liger_version": getattr(liger_kernel, "__version__", "?"), "liger_step_ms": t_l,
           "liger_peak_gib": peak,
           "liger_tokens_per_s": ids.numel() / t_l * 1e3, "tokens_per_s_ratio_vs_liger": t_l / ours_ms,
           "peak_memory_ratio_vs_liger": ours_peak / max(peak, 1e-9)}
    model.zero_grad(set_to_none=True)
    del model, stock
    empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--sections", default="backward_ops,train")
    ap.add_argument("--models", default="1.7b,8b")
    ap.add_argument("--budget-s", type=float, default=0, help="skip what would start after this many s")
    ap.add_argument("--repeat", type=int, default=1, help="time each model this many times (runs 2.. "
                    "recorded as <model>_run<i>): the spread between runs of one process")
    ap.add_argument("--bwd-tiles", default="", help="the attention backward's launch knobs for this "
                    "run, 'dq BM,BN,warps,stages/kv BM,BN,warps,stages' (kernels/triton/attention_bwd.py)")
    ap.add_argument("--tma-rows", default="", help="JSON {\"N,K\": [[min_M, BM, BN, BK, GROUP_M, warps, "
                    "stages(, variant)], ...]} replacing those shapes' rows of kernels/triton/linear.py TMA_TABLE "
                    "for this run (rows whose bits the time_linear_tma harness checked)")
    ap.add_argument("--attn-bwd", default="", help="comma list of attention backward backends to time "
                    "in turn (kernels/triton/attention_bwd.py BWD_BACKEND: triton, cudnn, auto); rows "
                    "recorded as <model>_<backend>")
    a = ap.parse_args()
    if a.tma_rows:
        from bitmatch.kernels.triton import linear as lin
        for key, rows in json.loads(a.tma_rows).items():
            lin.TMA_TABLE[tuple(int(v) for v in key.split(","))] = [tuple(r) for r in rows]
    if a.bwd_tiles:
        from bitmatch.kernels.triton import attention_bwd
        from ops.ops_attention import set_bwd_tiles
        dq, kv = (tuple(int(v) for v in part.split(",")) for part in a.bwd_tiles.split("/"))
        set_bwd_tiles(attention_bwd, dq, kv)
    os.makedirs(a.out, exist_ok=True)
    rec = Recorder(os.path.join(a.out, "gpu_train.json"), a)
    t0 = time.time()
    secs = a.sections.split(",")
    if "backward_ops" in secs:
        try:
            rec.put("backward_ops", backward_ops())
        except Exception:
            rec.err("backward_ops")
    if "bwd_gemms" in secs:
        try:
            rec.put("bwd_gemms", bwd_gemm_layouts())
        except Exception:
            rec.err("bwd_gemms")
    if "train" in secs:
        out = {}
        for size in a.models.split(","):
            if a.budget_s and time.time() - t0 > a.budget_s:
                rec.data.setdefault("skipped_for_time", []).append(f"train_{size}")
                continue
            backends = a.attn_bwd.split(",") if a.attn_bwd else [None]
            for j, backend in enumerate(backends):
                if backend:
                    from bitmatch.kernels.triton import attention_bwd
                    attention_bwd.BWD_BACKEND = backend
                    nth = backends[:j].count(backend)   # alternating backends: rows _b, _b_2, ...
                for i in range(max(a.repeat, 1)):
                    key = (size + (f"_{backend}" if backend else "") + (f"_{nth + 1}" if backend and nth else "")
                           + ("" if i == 0 else f"_run{i + 1}"))
                    try:
                        out[key] = train(size)
                        if backend:
                            out[key]["attention_bwd"] = {"backend": backend,
                                                         "cudnn_check": str(attention_bwd._CUDNN_OK)}
                    except Exception:
                        rec.err(f"train_{key}")
                    rec.put("train", out)
    rec.data["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rec.flush()


if __name__ == "__main__":
    main()

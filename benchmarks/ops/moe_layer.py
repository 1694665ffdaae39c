"""The invariant MoE layer on CUDA vs HF's own Qwen3-MoE block, side by side, with its invariance checks.

The layer: router linear + moe_route + moe_experts.

  python benchmarks/ops/moe_layer.py --out DIR [--tokens 1,64,512,4096,16384] [--hidden 2048]
      [--experts 128] [--top-k 8] [--inter 768] [--variants] [--commit SHA]

Timings: triton.testing.do_bench medians of eager calls (every side syncs on the host once per
call: HF's nonzero, our ids range check), ratio = stock time / ours. Stock sides: HF's
Qwen3MoeSparseMoeBlock with experts_implementation "eager" (its default) and "grouped_mm" (where
this transformers has it), and a plain torch._grouped_mm layer; the same for the experts alone
on the same ids and weights. Checks on CUDA: a subset of tokens alone vs in the batch (ours and,
as the control, HF eager), tile-config variants give the same bits, and each checked token
equals the composition of the public ops (linear, silu_and_mul, linear per rank, fp32 rank-order
combine in torch), i.e. the grouped GEMM keeps linear's K order. Writes DIR/moe_layer.json
after every token count.

--backward (tokens from --bwd-tokens): the layer's forward + backward (dL/dx and the router,
gate_up and down gradients) against HF's block with experts_implementation "grouped_mm" and the
torch._grouped_mm layer, the experts alone fwd+bwd, the Triton backward kernels alone, peak
memory of one fwd+bwd, and on the device: the forward's bits with autograd on vs off, the
backward run to run, and each gradient's relative error ||g - g_ref|| / ||g_ref|| against an
fp32 autograd of the plain math on the same routing (HF grouped_mm's beside it). --old-bwd also
times the per-expert autograd loop the backward used before (a few calls, no do_bench).
--device cpu --smoke: tiny shapes, a check that the script runs (reference backend; with
TRITON_INTERPRET=1 the Triton backward kernels run in the interpreter too).
"""
import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
from _common import machine_info


def build(cfg):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    conf = Qwen3MoeConfig(hidden_size=cfg.hidden, num_experts=cfg.experts, num_experts_per_tok=cfg.top_k,
                          moe_intermediate_size=cfg.inter, norm_topk_prob=True)
    conf._experts_implementation = "eager"
    torch.manual_seed(cfg.seed)
    with torch.device(cfg.device):
        blk = Qwen3MoeSparseMoeBlock(conf).to(torch.bfloat16)
    with torch.no_grad():
        blk.gate.weight.normal_(0, 0.02)
        blk.experts.gate_up_proj.normal_(0, 0.02)
        blk.experts.down_proj.normal_(0, 0.02)
    return conf, blk.eval()


def ours_layer(K, blk, top_k):
    gw, w_in, w_out = blk.gate.weight, blk.experts.gate_up_proj, blk.experts.down_proj

    def run(x):
        w, ids = K.moe_route(K.linear(x, gw), top_k, renormalize=True)
        return K.moe_experts(x, ids, w, w_in, w_out)
    return run


def torch_grouped_mm_layer(blk, top_k):
    """A plain layer on torch._grouped_mm (HF's router math, sort by expert, fp32 reduce)."""
    gw, w_in, w_out = blk.gate.weight, blk.experts.gate_up_proj, blk.experts.down_proj
    E = w_in.shape[0]

    def run(x):
        p = torch.softmax(F.linear(x, gw), dim=-1, dtype=torch.float)
        tv, ti = torch.topk(p, top_k, dim=-1)
        tv = (tv / tv.sum(-1, keepdim=True)).to(x.dtype)
        flat = ti.reshape(-1)
        _, perm = torch.sort(flat)
        offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
        h = torch._grouped_mm(x[perm // top_k], w_in.transpose(-2, -1), offs=offs)
        g, u = h.chunk(2, -1)
        y = torch._grouped_mm(F.silu(g) * u, w_out.transpose(-2, -1), offs=offs)
        y = y * tv.reshape(-1)[perm, None]
        out = torch.empty_like(y)
        out[perm] = y
        return out.view(-1, top_k, x.shape[1]).float().sum(1).to(x.dtype)
    return run


def bench(fn, rep, device, calls=0):
    if device != "cuda" or calls:  # CPU smoke runs, or very slow sides: median wall clock of calls
        times = []
        for _ in range(max(calls, 1)):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        return sorted(times)[len(times) // 2]
    import triton
    return triton.testing.do_bench(fn, warmup=max(5, rep // 4), rep=rep, return_mode="median")


def rows_differ(a, b):
    return int((a.view(torch.int16) != b.view(torch.int16)).any(-1).sum())


def composed_rows(K, x, w, ids, w_in, w_out, toks):
    """Each token from the public ops alone: linear -> silu_and_mul -> linear per rank, then
    acc = acc + w * y in fp32 in rank order (separate torch kernels: no fused multiply-add)."""
    rows = []
    for t in toks:
        acc = torch.zeros(1, x.shape[1], device=x.device, dtype=torch.float32)
        for r in range(ids.shape[1]):
            e = int(ids[t, r])
            y = K.linear(K.silu_and_mul(K.linear(x[t:t + 1], w_in[e])), w_out[e])
            acc = acc + w[t:t + 1, r:r + 1] * y.float()
        rows.append(acc.to(x.dtype))
    return torch.cat(rows)


def route_checks(K, cfg):
    """moe_route on the device: the tie rule (equal logits -> ids 0..k-1; duplicated columns ->
    the lower index first), a row alone vs in the batch, ids vs the CPU reference's."""
    g = torch.Generator().manual_seed(cfg.seed)
    z = torch.randn(4096, cfg.experts, generator=g) * 2
    z[:, 9] = z[:, 2]
    z[:64] = 0.5
    out = {}
    for scoring in ("softmax", "sigmoid", "sqrtsoftplus"):
        w, ids = K.moe_route(z.to(cfg.device), cfg.top_k, scoring=scoring, renormalize=True, scaling=1.5)
        ids = ids.cpu()
        both = (ids == 2).any(1) & (ids == 9).any(1)
        pos2, pos9 = (ids == 2).int().argmax(1), (ids == 9).int().argmax(1)
        _, rids = K.moe_route(z, cfg.top_k, scoring=scoring, renormalize=True, scaling=1.5)
        alone = [K.moe_route(z[t:t + 1].to(cfg.device), cfg.top_k, scoring=scoring, renormalize=True,
                             scaling=1.5) for t in (0, 100, 4095)]
        out[scoring] = {
            "equal_logit_rows_not_0_to_k": int((ids[:64] != torch.arange(cfg.top_k)).any(1).sum()),
            "dup_rows_with_both": int(both.sum()), "dup_rows_9_before_2": int((both & (pos9 < pos2)).sum()),
            "rows_ids_differ_from_cpu_reference": int((ids != rids).any(1).sum()),
            "alone_vs_batch_differ": sum(int(not torch.equal(a[0].cpu(), w[t:t + 1].cpu()) or
                                             not torch.equal(a[1].cpu(), ids[t:t + 1]))
                                         for a, t in zip(alone, (0, 100, 4095)))}
    return out


def plain_experts(x, w, w_in, w_out, ids):
    """The experts' plain math (swiglu) on per-expert weight leaves, for fp32 gradient references
    and (bf16, whole-tensor leaves) the per-expert autograd loop the backward used to run."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ys = []
    for e, xe in enumerate(torch.split(x[order // k], torch.bincount(flat, minlength=len(w_in)).tolist())):
        if xe.shape[0]:
            g, u = (xe @ w_in[e].t()).chunk(2, -1)
            ys.append((F.silu(g) * u) @ w_out[e].t())
    y = x.new_empty(flat.numel(), x.shape[1]).index_copy(0, order, torch.cat(ys))
    return (w.float().reshape(-1, 1) * y.float()).view(-1, k, x.shape[1]).sum(1)


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def backward_rows(K, TMB, cfg, conf, blk, ours, gmm, hf_block, T):
    """fwd+bwd timings, peak memory and gradient checks at T tokens (see the module docstring)."""
    dev = cfg.device
    r = {}
    g = torch.Generator(device=dev).manual_seed(cfg.seed + 7 * T)
    x = torch.randn(T, cfg.hidden, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
    gout = torch.randn(T, cfg.hidden, device=dev, generator=g).to(torch.bfloat16)
    gw, w_in, w_out = blk.gate.weight, blk.experts.gate_up_proj, blk.experts.down_proj
    params = [x, gw, w_in, w_out]

    def step(fn):
        def run():
            for t in params:  # fresh gradients: no accumulation add in the timed step
                t.grad = None
            fn(x).backward(gout)
        return run

    def grads():
        out = [t.grad.clone() for t in params]
        for t in params:
            t.grad = None
        return out
    with torch.no_grad():
        out_nograd = ours(x)
        w, ids = K.moe_route(K.linear(x, gw), cfg.top_k, renormalize=True)
    out = ours(x)
    r["forward_rows_differ_autograd_on_vs_off"] = rows_differ(out, out_nograd)
    out.backward(gout)
    first = grads()
    ours(x).backward(gout)
    r["bwd_run_to_run_identical"] = all(torch.equal(a, b) for a, b in zip(first, grads()))
    # gradient accuracy of the experts op on fixed routing: ours and HF grouped_mm vs fp32 autograd
    wl = w.detach().clone().requires_grad_()
    K.moe_experts(x, ids, wl, w_in, w_out).backward(gout)
    ours_g = [x.grad, wl.grad, w_in.grad, w_out.grad]
    for t in params:
        t.grad = None
    ref_leaves = [x.detach().float().requires_grad_(), w.detach().float().requires_grad_()]
    wi = [t.detach().float().requires_grad_() for t in w_in]
    wo = [t.detach().float().requires_grad_() for t in w_out]
    ref = torch.autograd.grad(plain_experts(*ref_leaves, wi, wo, ids), ref_leaves + wi + wo, gout.float())
    ref = [ref[0], ref[1], torch.stack(ref[2:2 + len(wi)]), torch.stack(ref[2 + len(wi):])]
    names = ("x", "routing_weights", "gate_up_proj", "down_proj")
    r["grad_rel_err_vs_fp32"] = {"ours": {n: rel_err(a, b) for n, a, b in zip(names, ours_g, ref)}}
    wb = w.detach().to(torch.bfloat16).requires_grad_()
    try:
        conf._experts_implementation = "grouped_mm"
        blk.experts(x, ids, wb).backward(gout)
        hf_g = [x.grad, wb.grad, w_in.grad, w_out.grad]
        r["grad_rel_err_vs_fp32"]["hf_grouped_mm"] = {n: rel_err(a, b) for n, a, b in zip(names, hf_g, ref)}
    except Exception:
        r["errors_hf_grouped_mm_grads"] = traceback.format_exc()[-1500:]
    finally:
        conf._experts_implementation = "eager"
        for t in params:
            t.grad = None
    del ref, ref_leaves, wi, wo, ours_g
    ms, mem = {}, {}
    sides = {"ours_layer_fwd_bwd": step(ours),
             "ours_experts_fwd_bwd": step(lambda xx: K.moe_experts(xx, ids, wl, w_in, w_out))}
    if gmm is not None:
        sides["torch_grouped_mm_layer_fwd_bwd"] = step(gmm)
    if dev == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        sides["ours_experts_bwd_kernels"] = lambda: TMB.moe_experts_backward(
            gout, x.detach(), ids, w, w_in.detach(), w_out.detach(), "swiglu", None)
        # what autograd runs: the forward's saved pre-activations instead of recomputing x W_in
        from bitmatch.kernels.triton import moe as TM  # main imports it after the device setup
        _, kept = TM.moe_experts(x.detach(), ids, w, w_in.detach(), w_out.detach(), "swiglu", None, keep_h=True)
        sides["ours_experts_bwd_kernels_saved_h"] = lambda: TMB.moe_experts_backward(
            gout, x.detach(), ids, w, w_in.detach(), w_out.detach(), "swiglu", None, kept=kept)
    for name, fn in sides.items():
        ms[name] = bench(fn, cfg.rep, dev)
        mem[name] = peak_mem(fn, dev)
    try:
        conf._experts_implementation = "grouped_mm"
        for name, fn in (("hf_grouped_mm_layer_fwd_bwd", step(hf_block)),
                         ("hf_grouped_mm_experts_fwd_bwd", step(lambda xx: blk.experts(xx, ids, wb)))):
            ms[name] = bench(fn, cfg.rep, dev)
            mem[name] = peak_mem(fn, dev)
    except Exception:
        r["errors_hf_grouped_mm"] = traceback.format_exc()[-1500:]
    finally:
        conf._experts_implementation = "eager"
    if cfg.old_bwd:  # the former backward: per-expert autograd through whole-tensor leaves
        wlo = w.detach().requires_grad_()
        ms["old_plain_loop_experts_fwd_bwd"] = bench(lambda: torch.autograd.grad(
            plain_experts(x, wlo, w_in, w_out, ids), [x, wlo, w_in, w_out], gout), cfg.rep, dev, calls=3)
    for t in params:
        t.grad = None
    if cfg.bwd_variants and "ours_experts_bwd_kernels" in sides:
        r["bwd_variants"] = bwd_variants(TMB, cfg, gout, x.detach(), ids, w, w_in.detach(), w_out.detach())
    r["ms"], r["peak_mem_mb"] = ms, mem
    base = {"layer": ms["ours_layer_fwd_bwd"], "experts": ms["ours_experts_fwd_bwd"]}
    r["ratio_stock_over_ours"] = {k: v / base["layer" if "_layer" in k else "experts"]
                                  for k, v in ms.items() if not k.startswith("ours")}
    return r


# (64, 64, 64, 8, 3): the activation backward without register spills on sm_90 (4 warps spill
# ~100 bytes with swiglu; scripts/sm90_resources.py moe)
BWD_VARIANTS = [((128, 64, 64, 8, 3), (128, 128, 64, 8, 3)), ((64, 128, 64, 8, 3), (128, 128, 64, 8, 4)),
                ((64, 64, 64, 4, 4), (128, 256, 64, 8, 3)), ((32, 64, 64, 4, 3), (64, 128, 64, 4, 3)),
                ((64, 64, 64, 8, 3), (128, 128, 64, 8, 3))]


def bwd_variants(TMB, cfg, *args):
    """Backward launch configs with the forward's saved pre-activations (what autograd runs):
    kernel time and each gradient's max relative difference from the table's config (tiles are
    free in the backward; this run picks the table's entries)."""
    from bitmatch.kernels.triton import moe as TM
    g, x, ids, w, w_in, w_out = args
    kept = TM.moe_experts(x, ids, w, w_in, w_out, "swiglu", None, keep_h=True)[1]
    base = TMB.moe_experts_backward(*args, "swiglu", None, kept=kept)
    out = {"table": list(TMB.bwd_config_for(args[2].numel(), cfg.experts))}
    for c in BWD_VARIANTS:
        try:
            got = TMB.moe_experts_backward(*args, "swiglu", None, config=c, kept=kept)
            out[str(c)] = {"ms": bench(lambda: TMB.moe_experts_backward(*args, "swiglu", None, config=c, kept=kept),
                                       cfg.rep, cfg.device),
                           "max_rel_diff_vs_table": max(float((a.float() - b.float()).abs().max() /
                                                              b.float().abs().max()) for a, b in zip(got, base))}
        except Exception:  # e.g. out of shared memory: the other configs still report
            out[str(c)] = {"error": traceback.format_exc()[-800:]}
    return out


def peak_mem(fn, device):
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1,64,512,4096,16384")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rep", type=int, default=60, help="do_bench rep (ms) per timing")
    ap.add_argument("--check-tokens", type=int, default=6)
    ap.add_argument("--variants", action="store_true", help="also time and bit-check tile-config variants")
    ap.add_argument("--commit", default="")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (reference backend)")
    ap.add_argument("--backward", action="store_true", help="fwd+bwd rows at --bwd-tokens (see the docstring)")
    ap.add_argument("--bwd-tokens", default="2048,4096")
    ap.add_argument("--old-bwd", action="store_true", help="also time the former per-expert autograd backward")
    ap.add_argument("--bwd-variants", action="store_true", help="time backward launch configs (BWD_VARIANTS)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (with --device cpu: does the script run)")
    cfg = ap.parse_args(argv)
    if cfg.smoke:
        cfg.hidden, cfg.experts, cfg.top_k, cfg.inter, cfg.rep = 64, 16, 2, 32, 1
        cfg.tokens, cfg.bwd_tokens, cfg.check_tokens = "5,16", "16,33", 3
    import bitmatch.kernels as K
    import bitmatch.kernels.triton.moe as TM
    import bitmatch.kernels.triton.moe_bwd as TMB
    os.makedirs(cfg.out, exist_ok=True)
    path = os.path.join(cfg.out, "moe_layer.json")
    res = {"command": "python benchmarks/ops/moe_layer.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "config": vars(cfg), "machine": machine_info(cfg.device),
           "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": {}, "errors": {}}

    def flush():
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)
    conf, blk = build(cfg)
    ours = ours_layer(K, blk, cfg.top_k)
    gmm = torch_grouped_mm_layer(blk, cfg.top_k) if hasattr(torch, "_grouped_mm") and cfg.device == "cuda" else None

    def hf_block(x):
        o = blk(x[None])
        return (o[0] if isinstance(o, tuple) else o).reshape(-1, x.shape[1])
    w_in, w_out = blk.experts.gate_up_proj, blk.experts.down_proj
    variants = [(16, 64, 64, 64, 4, 4), (64, 64, 128, 64, 4, 3), (128, 64, 128, 64, 8, 3),
                (128, 128, 128, 64, 8, 3), (64, 128, 64, 64, 4, 4)] if cfg.variants else []
    try:
        res["route_checks"] = route_checks(K, cfg)
    except Exception:
        res["errors"]["route_checks"] = traceback.format_exc()[-3000:]
    flush()
    for T in [int(t) for t in cfg.tokens.split(",") if t]:
        r = {}
        res["runs"][str(T)] = r
        try:
            g = torch.Generator(device=cfg.device).manual_seed(cfg.seed + T)
            x = torch.randn(T, cfg.hidden, device=cfg.device, generator=g).to(torch.bfloat16)
            with torch.no_grad():
                out = ours(x)
                w, ids = K.moe_route(K.linear(x, blk.gate.weight), cfg.top_k, renormalize=True)
                toks = sorted(set(torch.linspace(0, T - 1, min(T, cfg.check_tokens)).long().tolist()))
                alone = torch.cat([ours(x[t:t + 1]) for t in toks])
                r["ours_alone_vs_batch_rows_differ"] = rows_differ(alone, out[toks])
                r["ours_vs_composed_public_ops_rows_differ"] = rows_differ(
                    composed_rows(K, x, w, ids, w_in, w_out, toks), out[toks])
                hf = hf_block(x)
                hf_alone = torch.cat([hf_block(x[t:t + 1]) for t in toks])
                r["control_hf_eager_alone_vs_batch_rows_differ"] = rows_differ(hf_alone, hf[toks])
                r["checked_tokens"] = toks
                r["max_abs_vs_hf_eager"] = float((out.float() - hf.float()).abs().max())
                r["experts_hist_min_max"] = [int(v) for v in torch.aminmax(torch.bincount(ids.reshape(-1),
                                                                                          minlength=cfg.experts))]
                r["config_used"] = list(TM.config_for(T * cfg.top_k, cfg.experts))
                t_ours = bench(lambda: ours(x), cfg.rep, cfg.device)
                t_ours_exp = bench(lambda: K.moe_experts(x, ids, w, w_in, w_out), cfg.rep, cfg.device)
                r["ms"] = {"ours_layer": t_ours, "ours_experts": t_ours_exp}
                wb = w.to(torch.bfloat16)
                for impl in ("eager", "grouped_mm"):
                    try:
                        conf._experts_implementation = impl
                        r["ms"][f"hf_{impl}_layer"] = bench(lambda: hf_block(x), cfg.rep, cfg.device)
                        r["ms"][f"hf_{impl}_experts"] = bench(lambda: blk.experts(x, ids, wb), cfg.rep, cfg.device)
                    except Exception:
                        res["errors"][f"{T}/hf_{impl}"] = traceback.format_exc()[-1500:]
                    finally:
                        conf._experts_implementation = "eager"
                if gmm is not None:
                    try:
                        r["ms"]["torch_grouped_mm_layer"] = bench(lambda: gmm(x), cfg.rep, cfg.device)
                    except Exception:
                        res["errors"][f"{T}/torch_grouped_mm"] = traceback.format_exc()[-1500:]
                # layer timings against our layer, experts-only timings against our experts
                r["ratio_stock_over_ours"] = {k: v / (t_ours if k.endswith("_layer") else t_ours_exp)
                                              for k, v in r["ms"].items() if not k.startswith("ours")}
                if variants:
                    vr = {}
                    for c in variants:
                        o = TM.moe_experts(x, ids, w, w_in, w_out, "swiglu", None, config=c)
                        vr[str(c)] = {"rows_differ_vs_default": rows_differ(o, K.moe_experts(x, ids, w, w_in, w_out)),
                                      "ms_experts": bench(lambda: TM.moe_experts(x, ids, w, w_in, w_out, "swiglu",
                                                                                 None, config=c), cfg.rep, cfg.device)}
                    r["variants"] = vr
        except Exception:
            res["errors"][str(T)] = traceback.format_exc()[-3000:]
        print(T, json.dumps(r), flush=True)
        flush()
    res["backward"] = {}
    for T in [int(t) for t in cfg.bwd_tokens.split(",") if t] if cfg.backward else []:
        try:
            res["backward"][str(T)] = r = backward_rows(K, TMB, cfg, conf, blk, ours, gmm, hf_block, T)
            print("bwd", T, json.dumps(r), flush=True)
        except Exception:
            res["errors"][f"bwd/{T}"] = traceback.format_exc()[-3000:]
        flush()
    res["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    flush()
    return res


if __name__ == "__main__":
    main()

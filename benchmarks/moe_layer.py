"""The invariant MoE layer (router linear + moe_route + moe_experts) against HF's own Qwen3-MoE
block on CUDA, side by side in one run, plus its invariance checks there.

  python benchmarks/moe_layer.py --out DIR [--tokens 1,64,512,4096,16384] [--hidden 2048]
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
"""
import argparse
import json
import os
import platform
import sys
import time
import traceback

import torch
import torch.nn.functional as F


def machine_info(device):
    import triton
    import transformers
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine()}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sm_count=p.multi_processor_count)
    return info


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


def bench(fn, rep, device):
    if device != "cuda":  # CPU smoke runs of this script only: wall clock of one call
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
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
    cfg = ap.parse_args(argv)
    import bitmatch.kernels as K
    import bitmatch.kernels.triton.moe as TM
    os.makedirs(cfg.out, exist_ok=True)
    path = os.path.join(cfg.out, "moe_layer.json")
    res = {"command": "python benchmarks/moe_layer.py " + " ".join(argv if argv is not None else sys.argv[1:]),
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
    for T in [int(t) for t in cfg.tokens.split(",")]:
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
    res["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    flush()
    return res


if __name__ == "__main__":
    main()

"""DeepSeek-V4 on bitmatch kernels vs HF's own implementation, side by side in one run.

  python benchmarks/families/deepseek_v4_layer.py --out DIR [--device cpu] [--batch 4] [--seq 48] [--new 16]
  python benchmarks/families/deepseek_v4_layer.py --out DIR --device cuda --config flash4 --batch 2 --seq 1024 --new 32
  python benchmarks/families/deepseek_v4_layer.py --out DIR --device cuda --config flash4 --sections attn --seq 1024 \
      --attn-batches 16,64

``--config flash4``: a 4-layer truncation of DeepSeek-V4-Flash at its real widths (hidden 4096, 64
heads, head_dim 512, q_lora 1024, 256 experts top-6 of width 2048, index 64 x 128 top-512, window
128, rates 4 / 128, hc_mult 4, 20 Sinkhorn iterations, vocab 129280), layers sliding / CSA / HCA /
CSA, 3 hash layers, random bf16 weights built on the device. One model object serves both sides
(bitmatch.patch / unpatch); for fwd+bwd the routed experts and embeddings are frozen on both
sides (their gradients would not fit beside the weights on one GPU).

Measures, on the same weights and inputs: trainer forward+backward tokens/s (bitmatch.token_logprobs
+ backward vs HF's forward, log_softmax gather + backward, fp32) and rollout decode tokens/s
(bitmatch.Engine vs HF ``generate`` with its DeepSeek-V4 cache, bf16, greedy, same prompts), and
checks Diff = 0 between the engine's logprobs and token_logprobs on the decoded tokens. Writes
DIR/deepseek_v4_<device>.json (command, machine, versions, setup, results, ratios).

``--sections attn``: the attention block alone (deepseek_v4_attention.attention) of each layer
type (sliding / CSA / HCA) at batches ``--attn-batches``: the trainer's packed prefill of B x seq
rows (forward alone, and forward + backward), and the engine's decode step (B rows against paged
caches holding B x seq tokens, block size 16, graph-style host bounds); per-token times, decode /
prefill ratios, and the engine == trainer bit check (the decode rows vs the last rows of the
trainer's prefill of seq + 1 tokens, same x); then the fused sink-attention backward vs the plain
fp32 recompute on random rows (first batch x seq, HCA and CSA at rate 4): each gradient's relative
error and both times.

On CUDA the V4 attention runs batched with fused Triton kernels (sink attention, indexer scores;
the compressor pools through gathers + the compress_windows composition), no per-sequence loop,
no host read in a decode step.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
import _common
from _common import machine_info


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn, reps, device):
    fn()  # warm-up (Triton compiles, rotary tables, first allocations)
    _sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / reps


FLASH4 = dict(vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=4,
              num_attention_heads=64, head_dim=512, q_lora_rank=1024, partial_rotary_factor=64 / 512,
              num_experts_per_tok=6, n_routed_experts=256, sliding_window=128,
              compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
              mlp_layer_types=["hash_moe"] * 3 + ["moe"], hc_mult=4, hc_sinkhorn_iters=20, o_groups=8,
              o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512,
              max_position_embeddings=1048576, initializer_range=0.02, swiglu_limit=10.0,
              rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536})


# a mid-size V4 (the shape the V4 speed issue was filed on, one more layer of each compressed
# type): hidden 2048, 16 heads x 512, 64 experts top-6, layers sliding / CSA / HCA / CSA / HCA / CSA
MID = dict(FLASH4, hidden_size=2048, moe_intermediate_size=1024, num_hidden_layers=6, num_attention_heads=16,
           q_lora_rank=512, n_routed_experts=64, o_groups=4, o_lora_rank=512, index_n_heads=32, index_topk=256,
           layer_types=["sliding_attention"] + ["compressed_sparse_attention", "heavily_compressed_attention"] * 2
           + ["compressed_sparse_attention"], mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 4)
CONFIGS = {"flash4": FLASH4, "mid": MID}


def build(name, dtype, device, seed=0):
    """The model of ``name`` (tiny | flash4 | mid) in ``dtype``, built directly on ``device``."""
    from transformers import DeepseekV4ForCausalLM

    from bitmatch.models.deepseek_v4_tiny import randomize_constants, tiny_config, tiny_model
    if name == "tiny":
        return tiny_model(dtype, seed=seed).to(device)
    cfg = tiny_config(**CONFIGS[name])
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DeepseekV4ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    randomize_constants(model, seed + 1)
    return model.eval()



def _diff_on_device(model, outs, device):
    """Engine logprobs vs bitmatch.token_logprobs of the same tokens (one padded batch on the
    model's device, T = 1): tokens compared and tokens whose fp32 bits differ."""
    import bitmatch
    from bitmatch.testing.models import pad_batch
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    ids, mask = pad_batch(seqs)
    with torch.no_grad():
        lp = bitmatch.token_logprobs(model, ids.to(device), mask.to(device), temperature=1.0).float().cpu()
    n = bad = 0
    for b, o in enumerate(outs):
        p, c = len(o.prompt_token_ids), len(o.outputs[0].token_ids)
        got = torch.tensor(o.outputs[0].logprobs, dtype=torch.float32)
        bad += int((got.view(torch.int32) != lp[b, p - 1:p + c - 1].contiguous().view(torch.int32)).sum())
        n += c
    return {"tokens": n, "mismatches": bad}

def _attn_ctx(device, B, n_ctx, n_new, caches, bs, nb):
    """A paged ForwardContext for B sequences holding n_ctx tokens, computing the next n_new each;
    sequence b owns blocks b*nb .. b*nb + nb - 1 (the same table for every step of a sequence)."""
    from bitmatch.context import ForwardContext
    bt = torch.arange(B * nb, device=device, dtype=torch.int32).view(B, nb)
    pos = (torch.arange(n_new, device=device) + n_ctx).repeat(B)
    seq = torch.arange(B, device=device).repeat_interleave(n_new)
    slots = bt[seq, pos // bs].long() * bs + pos % bs
    qsl = torch.arange(B + 1, device=device, dtype=torch.int32) * n_new
    lens = torch.full((B,), n_ctx + n_new, device=device, dtype=torch.int32)
    return ForwardContext(positions=pos, slot_mapping=slots, query_start_loc=qsl, seq_lens=lens, block_table=bt,
                          caches=caches, max_query_len=n_new, max_seq_len=nb * bs)


def attention_section(a, model, device, res):
    """The V4 attention block per layer type: trainer prefill, engine decode, engine == trainer bits."""
    from bitmatch.context import ForwardContext
    from bitmatch.models import deepseek_v4_attention as A, family_of, unwrap_causal_lm
    from bitmatch.models.registry import allocate_caches
    lm, fam = unwrap_causal_lm(model), family_of(model)
    spec, dt, bs = fam.build_spec(lm), torch.bfloat16, 16
    out = res.setdefault("attention_block", {})
    for lt in (A.SLIDING, A.CSA, A.HCA):
        if lt not in spec.layer_types:
            continue
        i = spec.layer_types.index(lt)
        attn = lm.model.layers[i].self_attn
        for B in [int(b) for b in a.attn_batches.split(",")]:
            key = f"{lt}/B{B}"
            try:
                g = torch.Generator(device=device).manual_seed(B)
                x = (torch.randn(B, a.seq + 1, spec.hidden_size, generator=g, device=device) * 0.5).to(dt)

                def call(xr, ctx):
                    rows = A.sequences(ctx, ctx.positions)
                    rope_at = A.rope_lookup(spec, ctx, rows)
                    rope = {k: rope_at(ctx.positions, k) for k in ("main", "compress")}
                    return A.attention(attn, xr, None, rope, rope_at, ctx, spec, i, dt, rows)
                n = a.seq + 1
                cu = torch.arange(B + 1, device=device, dtype=torch.int32) * n
                tctx = ForwardContext(positions=torch.arange(n, device=device).repeat(B), cu_seqlens=cu,
                                      max_seq_len=n)
                with torch.no_grad():
                    t_pre = _timed(lambda: call(x.reshape(B * n, -1), tctx), a.reps, device)
                    train = call(x.reshape(B * n, -1), tctx).view(B, n, -1)[:, -1]
                    nb = -(-n // bs)
                    caches = allocate_caches(fam.cache_groups(spec, dt), B * nb, bs, device)
                    call(x[:, :-1].reshape(B * a.seq, -1), _attn_ctx(device, B, 0, a.seq, caches, bs, nb))
                    dctx = _attn_ctx(device, B, a.seq, 1, caches, bs, nb)
                    dec = call(x[:, -1], dctx)
                    # re-running the step rewrites the same slots with the same values: timing is safe
                    t_dec = _timed(lambda: call(x[:, -1], dctx), a.reps, device)
                bad = int((dec.view(torch.int16) != train.contiguous().view(torch.int16)).any(-1).sum())
                xg = x.reshape(B * n, -1).detach().requires_grad_()

                def fwd_bwd():  # the trainer's block forward + backward (fused sink-attention backward)
                    call(xg, tctx).float().sum().backward()
                    attn.zero_grad(set_to_none=True)
                    xg.grad = None
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                t_bwd = _timed(fwd_bwd, a.reps, device)
                out[key] = {"prefill_rows": B * n, "prefill_us_per_token": 1e6 * t_pre / (B * n),
                            "train_fwd_bwd_us_per_token": 1e6 * t_bwd / (B * n),
                            "train_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
                            "decode_rows": B, "decode_us_per_token": 1e6 * t_dec / B,
                            "decode_over_prefill_per_token": (t_dec / B) / (t_pre / (B * n)),
                            "engine_vs_trainer_rows_differing": bad}
            except Exception as exc:  # recorded, not hidden
                out[key] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}


def decode_bytes(model, spec, B, ctx):
    """(weight bytes, cache bytes) one decode step of B sequences at ``ctx`` tokens must read:
    every weight once but the embedding (B rows) and the routed experts (the expected number of
    distinct experts B uniform top-k rows touch, E (1 - (1 - k/E)^B), per MoE layer); per sequence
    and layer the window's K = V rows, the compressed entries attention reads (HCA: all, CSA: the
    indexer's top-k) and, for CSA, every indexer key it scores."""
    cfg = model.config
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = E * (1 - (1 - k / E) ** B)
    w = 0
    for n, p in model.named_parameters():
        nb = p.numel() * p.element_size()
        if n.endswith("embed_tokens.weight"):
            nb = B * p.shape[1] * p.element_size()
        elif ".experts." in n:
            nb = nb * touched / E
        w += nb
    d, di, el = spec.head_dim, spec.index_head_dim, 2
    cache = 0
    for lt in spec.layer_types:
        per = min(ctx, spec.sliding_window) * d
        if lt in spec.compress_rates:
            n_ent = ctx // spec.compress_rates[lt]
            if lt == "compressed_sparse_attention":
                per += min(n_ent, spec.index_topk) * d + n_ent * di
            else:
                per += n_ent * d
        cache += per * el * B
    return int(w), int(cache)


def _decode_engine(a, model, B, n_new):
    """An engine holding B requests of --seq random tokens (n_new new each), past their prefill."""
    import bitmatch
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, 128, (B, a.seq), generator=g).tolist()
    eng = bitmatch.Engine(model, max_num_seqs=B)
    for i, p in enumerate(prompts):
        eng.add_request(p, bitmatch.SamplingParams(temperature=1.0, max_tokens=n_new, ignore_eos=True, seed=i))
    while eng.scheduler.waiting:
        eng.step()
    return eng


def _timed_steps(eng, n, device):
    """n engine steps: wall ms each (device drained at both ends), their median, and the graph
    captures after each (a slow step that captured a graph shows there)."""
    import statistics
    ts, caps = [], []
    graphs = getattr(eng.model_runner, "graphs", None)
    for _ in range(n):
        _sync(device)
        t = time.perf_counter()
        eng.step()
        _sync(device)
        ts.append((time.perf_counter() - t) * 1e3)
        caps.append(getattr(graphs, "num_captures", None))
    return {"median_ms": statistics.median(ts), "steps_ms": ts, "captures_after_each_step": caps}


def decode_section(a, out):
    """The engine's decode step at --decode-batch sequences of --seq tokens (graphs as the engine
    chooses), median wall ms of 8 steps, against the weight + cache read roofline at --hbm-tbps."""
    import bitmatch
    from bitmatch.models import family_of, unwrap_causal_lm
    model = build(a.config, torch.bfloat16, a.device)
    bitmatch.patch(model)
    B = a.decode_batch
    # the scheduler admits max_num_batched_tokens // seq prompts a step, so the first requests reach
    # their last token that many steps before the last ones: 48 new tokens keep every timed and
    # profiled step at the full batch (24 let requests finish mid-timing: a smaller graph bucket and
    # its capture landed in the timed steps)
    eng = _decode_engine(a, model, B, 48)
    for _ in range(4):  # the prefill (possibly chunked), compiles, graph capture
        eng.step()
    timed = _timed_steps(eng, 8, a.device)
    ts = timed["steps_ms"]
    prof = {}
    if a.profile and a.device == "cuda":  # where a step's time goes (before the requests finish): a graph
        runner = eng.model_runner             # replay with its host time, then eagerly
        prof = {"graph_step": _common.top_kernels(eng.step, k=20), "graph_host": _common.host_profile(eng.step, k=20),
                "graphs": {"captures": getattr(runner.graphs, "num_captures", None),
                           "replays": getattr(runner.graphs, "num_replays", None)}}
        graphs, runner.graphs = runner.graphs, None
        try:
            prof["eager_step"] = _common.top_kernels(eng.step, k=20)
            prof["eager_host"] = _common.host_profile(eng.step, k=20)
        finally:
            runner.graphs = graphs
    while eng.has_unfinished_requests():
        eng.step()
    step_ms = timed["median_ms"]
    spec = family_of(model).build_spec(unwrap_causal_lm(model))
    wb, cb = decode_bytes(model, spec, B, a.seq + 8)
    tbps = _common.hbm_tbps(a.hbm_tbps)
    roof = (wb + cb) / (tbps * 1e12) * 1e3
    out["results"]["decode_step"] = {"batch": B, "context_tokens": a.seq + 8, "step_ms": step_ms, "steps_ms": ts,
                          "captures_after_each_step": timed["captures_after_each_step"],
                          "weight_bytes": wb, "cache_bytes": cb, "hbm_tbps": tbps, "roofline_ms": roof,
                          "fraction_of_roofline": roof / step_ms,
                          "graphs": getattr(eng.model_runner, "graphs", None) is not None,
                          "graph_counts": {"captures": getattr(eng.model_runner.graphs, "num_captures", None),
                                           "replays": getattr(eng.model_runner.graphs, "num_replays", None)}}
    out["ratios"]["decode_fraction_of_roofline"] = roof / step_ms
    if prof:
        out["results"]["decode_step"]["profile"] = prof
    del eng, model
    if a.device == "cuda":
        torch.cuda.empty_cache()


# decode-M tile candidates for the invariant linear (BM, BN, BK, GROUP_M, warps, stages): smaller
# output tiles for more programs, longer K blocks for fewer sequential steps. Tiles never change
# the bits on the GPU (kernels/triton/linear.py); the sweep checks each against the table's.
DECODE_TILES = [(64, 64, 128, 8, 4, 4), (64, 32, 128, 8, 4, 4), (32, 32, 128, 8, 4, 4), (16, 32, 128, 8, 4, 4),
                (16, 64, 128, 8, 4, 4), (64, 32, 256, 8, 4, 3), (32, 32, 256, 8, 4, 3), (16, 32, 256, 8, 4, 4),
                (16, 16, 256, 8, 4, 4), (64, 64, 256, 8, 4, 3), (16, 64, 256, 8, 4, 3), (16, 32, 512, 8, 4, 2)]


def tiles_section(a, out, save=lambda: None):
    """Issue 21's decode linears: every (M, N, K) the invariant linear runs in one decode step of
    --decode-batch sequences, each timed (CUDA graph) over DECODE_TILES with its bits against the
    table's config; then the decode step side by side in one engine: the table's tiles vs the
    fastest bit-equal ones (the graphs recaptured)."""
    import ast

    import triton.testing as tt

    import bitmatch
    from bitmatch.kernels.triton import linear as lin
    model = build(a.config, torch.bfloat16, a.device)
    bitmatch.patch(model)
    B = a.decode_batch
    eng = _decode_engine(a, model, B, 40)
    for _ in range(4):
        eng.step()
    shapes = {}
    real = lin._launch

    def spy(x, weight, bias, cfg, split, out=None):
        k = (x.shape[0], weight.shape[0], x.shape[1], split)
        shapes[k] = shapes.get(k, 0) + 1
        return real(x, weight, bias, cfg, split, out)
    runner = eng.model_runner
    graphs, runner.graphs = runner.graphs, None
    lin._launch = spy
    try:
        eng.step()   # one eager step: every linear launch of a decode step
    finally:
        lin._launch, runner.graphs = real, graphs
    res = {"batch": B, "shapes": {}}
    tuned = {}
    for (M, N, K, split), calls in sorted(shapes.items(), key=lambda kv: -kv[1]):
        x = torch.randn(M, K, device=a.device, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=a.device, dtype=torch.bfloat16) * 0.02
        base = lin.config_for(M, N, K, torch.bfloat16)
        ref = real(x, w, None, base, split)
        rows = {}
        for c in [base[:-1]] + [t for t in DECODE_TILES if t != base[:-1]]:
            cfg = (*c, base[-1])
            try:
                o = real(x, w, None, cfg, split)
                same = bool(torch.equal(o, ref))
                ms = tt.do_bench_cudagraph(lambda: real(x, w, None, cfg, split), rep=20)
                rows[str(c)] = {"ms": ms, "bits_equal_table": same}
            except Exception as exc:
                rows[str(c)] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        ok = {k: v["ms"] for k, v in rows.items() if v.get("bits_equal_table")}
        best = min(ok, key=ok.get)
        res["shapes"][f"M{M}_N{N}_K{K}_S{split}"] = {"calls_per_step": calls, "table_cfg": list(base),
                                                     "table_ms": rows[str(base[:-1])].get("ms"), "best": best,
                                                     "best_ms": ok[best], "configs": rows}
        tuned[(N, K)] = (M, (*ast.literal_eval(best), base[-1]))
        print("tiles", M, N, K, calls, "table", rows[str(base[:-1])].get("ms"), "best", best, ok[best], flush=True)
    est = sum(v["calls_per_step"] * (v["table_ms"] - v["best_ms"]) for v in res["shapes"].values())
    res["linear_ms_saved_per_step_estimate"] = est
    out["results"]["tiles"] = res
    save()   # the sweep is kept even if the decode steps below run out of time

    steps = {"table_tiles": _timed_steps(eng, 6, a.device)}
    saved = dict(lin.CONFIG_TABLES)
    for (N, K), (M, cfg) in tuned.items():
        rows = lin.CONFIG_TABLES.get((N, K)) or lin.HALF_TABLES.get((N, K)) or lin.CONFIG_TABLE
        lin.CONFIG_TABLES[(N, K)] = [(M, *cfg)] + [r for r in rows if r[0] > M]
    try:
        runner.graphs.graphs.clear()   # the captured graphs hold the table's kernels
        for _ in range(2):
            eng.step()
        steps["swept_tiles"] = _timed_steps(eng, 6, a.device)
    finally:
        lin.CONFIG_TABLES.clear()
        lin.CONFIG_TABLES.update(saved)
    res["decode_steps"] = steps
    res["captures"] = runner.graphs.num_captures
    out["ratios"]["decode_step_swept_over_table_tiles"] = (steps["swept_tiles"]["median_ms"]
                                                           / steps["table_tiles"]["median_ms"])
    while eng.has_unfinished_requests():
        eng.step()
    del eng, model
    if a.device == "cuda":
        torch.cuda.empty_cache()


def sink_backward_check(a, spec, device, res):
    """The fused sink-attention backward vs the plain fp32 recompute (the reference backend's
    backward) on random rows at the config's widths (B x seq packed rows, HCA and CSA): the
    relative error of each gradient, and both backwards' times. Triton backend only."""
    import bitmatch.kernels as K
    from bitmatch.kernels.compressed_attention import KeyRows, _rows_plain_backward, entry_list
    out = res.setdefault("sink_attention_backward", {})
    B, n, H, D, m = int(a.attn_batches.split(",")[0]), a.seq, spec.num_heads, spec.head_dim, 4
    g = torch.Generator(device=device).manual_seed(0)
    T = B * n
    pos = torch.arange(n, device=device).repeat(B)
    q, kv, ent, w = (torch.randn(*sh, generator=g, device=device).to(torch.bfloat16)
                     for sh in ((T, H, D), (T, D), (T, D), (T, H, D)))
    sinks = torch.randn(H, generator=g, device=device)
    rows = KeyRows.packed(pos, max_len=n)
    vis = torch.arange(n // m, device=device).view(1, -1) < ((pos + 1) // m).view(-1, 1)
    sel = entry_list(vis & (torch.rand(vis.shape, generator=g, device=device) < 0.5), min(spec.index_topk, n // m))
    for mode, selected in (("hca", None), ("csa", sel)):
        try:
            kw = dict(scale=D ** -0.5, window=spec.sliding_window, entries=None, rate=m, selected=selected)
            leaves = [t.clone().requires_grad_() for t in (q, kv, ent, sinks)]
            with K.use_backend("triton"):
                o = K.sink_attention_rows(leaves[0], pos, leaves[1], leaves[3], rows, **{**kw, "entries": leaves[2]})
            t_fused = _timed(lambda: torch.autograd.grad(o, leaves, w, retain_graph=True), a.reps, device)
            fused = torch.autograd.grad(o, leaves, w, retain_graph=True)
            sel_t = selected if selected is not None else torch.zeros(T, 0, dtype=torch.int32, device=device)

            def plain():
                return _rows_plain_backward(w, q, kv, ent, sinks, pos, sel_t, rows, D ** -0.5, spec.sliding_window,
                                            m, (True,) * 4)[:4]
            t_plain = _timed(plain, a.reps, device)
            want = plain()
            out[f"{mode}/T{T}"] = {
                "fused_ms": 1e3 * t_fused, "plain_fp32_ms": 1e3 * t_plain,
                "rel_err": {k: float((f.double() - r.double()).norm() / r.double().norm())
                            for k, f, r in zip(("q", "kv", "entries", "sinks"), fused, want)}}
        except Exception as exc:  # recorded, not hidden
            out[f"{mode}/T{T}"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--config", default="tiny", choices=("tiny", "flash4", "mid"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=48)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sections", default="train,rollout",
                    help="comma list of train, rollout, decode, tiles (CUDA), attn")
    ap.add_argument("--decode-batch", type=int, default=64, help="decode section: sequences per step")
    ap.add_argument("--hbm-tbps", type=float, default=None, help="roofline TB/s (default: the card's)")
    ap.add_argument("--profile", action="store_true",
                    help="train and decode sections: the top CUDA kernels and the host's own time of one step per side")
    ap.add_argument("--attn-batches", default="16,64", help="decode batches of the attn section")
    ap.add_argument("--backend", default=None, choices=("reference", "triton"),
                    help="force a kernel backend (--device cpu --backend triton: the Triton kernels in the "
                         "interpreter, a smoke test of the CUDA path)")
    a = ap.parse_args(argv)
    if a.backend == "triton" and a.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    torch.set_num_threads(a.threads)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))

    import bitmatch
    from bitmatch.engine import Engine, SamplingParams

    out = {"command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
           "machine": {**machine_info(a.device), "platform": platform.platform(), "threads": a.threads},
           "setup": {"config": a.config, "batch": a.batch, "seq": a.seq, "new_tokens": a.new, "reps": a.reps,
                     "backend": a.backend or "by device", "attn_batches": a.attn_batches,
                     "device": a.device}, "results": {}, "ratios": {}}
    path = os.path.join(a.out, f"deepseek_v4_{a.config}_{a.device}.json")
    os.makedirs(a.out, exist_ok=True)

    def save():
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    res = out["results"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (a.batch, a.seq), generator=g).to(a.device)
    mask = torch.ones_like(ids)
    sections = a.sections.split(",")
    flash = a.config != "tiny"

    if "train" in sections:  # trainer forward + backward; fp32 on the tiny config, bf16 at Flash widths
        model = build(a.config, torch.bfloat16 if flash else torch.float32, a.device).train()
        if flash:  # gradients for everything but the routed experts and the embeddings (memory)
            for n, p_ in model.named_parameters():
                if ".experts." in n or "embed_tokens" in n or "lm_head" in n:
                    p_.requires_grad_(False)

        def hf_step():
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
            lp.sum().backward()
            model.zero_grad(set_to_none=True)

        def ours_step():
            bitmatch.token_logprobs(model, ids, mask).sum().backward()
            model.zero_grad(set_to_none=True)
        def peak_gib():  # each side's own peak (the weights included): the target is ours <= HF's
            if a.device != "cuda":
                return None
            gib = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
            return gib
        try:
            peak_gib()
            t_hf = _timed(hf_step, a.reps, a.device)
            peak_hf = peak_gib()
            bitmatch.patch(model)
            t_ours = _timed(ours_step, a.reps, a.device)
            peak_ours = peak_gib()
            if a.profile and a.device == "cuda":
                bitmatch.unpatch(model)
                res["profile_hf"] = _common.top_kernels(hf_step, k=25)
                bitmatch.patch(model)
                res["profile_bitmatch"] = _common.top_kernels(ours_step, k=25)
                res["host_profile_bitmatch"] = _common.host_profile(ours_step, k=40)
            n_tok = a.batch * a.seq
            res["train_tokens_per_s"] = {"bitmatch": n_tok / t_ours, "hf": n_tok / t_hf}
            out["ratios"]["train_bitmatch_over_hf"] = t_hf / t_ours
            if a.device == "cuda":
                res["train_peak_gib"] = {"bitmatch": peak_ours, "hf": peak_hf}
        except Exception as exc:  # recorded, not hidden: the JSON says which side failed and why
            res["train_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        save()
        del model
        if a.device == "cuda":
            torch.cuda.empty_cache()

    if "rollout" in sections:  # rollout decode, bf16, greedy, same prompts on both sides
        model = build(a.config, torch.bfloat16, a.device)
        half = max(1, a.seq // 2)
        prompts = [r.tolist() for r in ids[:, :half].cpu()]
        params = SamplingParams(temperature=0.0, max_tokens=a.new, ignore_eos=True)

        def hf_decode():
            with torch.no_grad():
                return model.generate(ids[:, :half], attention_mask=mask[:, :half], max_new_tokens=a.new,
                                      min_new_tokens=a.new, do_sample=False, pad_token_id=0)
        try:
            d_hf = _timed(hf_decode, a.reps, a.device)
            res["rollout_tokens_per_s"] = {"hf_generate": a.batch * a.new / d_hf}
            bitmatch.patch(model)
            eng = Engine(model, max_num_seqs=a.batch)
            d_ours = _timed(lambda: eng.generate(prompts, params, use_tqdm=False), a.reps, a.device)
            res["rollout_tokens_per_s"]["bitmatch_engine"] = a.batch * a.new / d_ours
            out["ratios"]["rollout_bitmatch_over_hf"] = d_hf / d_ours
            save()
            outs = eng.generate(prompts, params, use_tqdm=False)
            res["diff"] = _diff_on_device(model, outs, a.device)
        except Exception as exc:
            res["rollout_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        save()
        # the engine holds its KV cache (90% of the free memory): the decode section builds its own
        eng = None
        del model, eng
        gc.collect()  # the engine's parts refer to one another: free them now, not at the next collection
        if a.device == "cuda":
            torch.cuda.empty_cache()
    if "decode" in sections:
        try:
            decode_section(a, out)
        except Exception as exc:
            res["decode_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        save()
    if "tiles" in sections and a.device == "cuda":
        try:
            tiles_section(a, out, save)
        except Exception:
            import traceback
            res["tiles_error"] = traceback.format_exc()[-3000:]
        save()
    if "attn" in sections:
        import bitmatch.kernels as K
        model = build(a.config, torch.bfloat16, a.device)
        bitmatch.patch(model)
        with K.use_backend(a.backend):
            attention_section(a, model, a.device, res)
        save()
        if a.device == "cuda" or a.backend == "triton":
            from bitmatch.models import family_of, unwrap_causal_lm
            sink_backward_check(a, family_of(model).build_spec(unwrap_causal_lm(model)), a.device, res)
            save()
        del model
    out["limits"] = ("CPU: the bitmatch side runs the float64-exact reference (integer float64 products, "
                     "polynomial exp/log) against HF's fp32/bf16 BLAS. CUDA: the V4 attention is batched (fused "
                     "Triton sink attention and indexer scores; the compressor's pooling a gather + composition; "
                     "the grouped o_a projection o_groups launches of the invariant linear).")
    save()
    print(json.dumps(out["results"], indent=1), json.dumps(out["ratios"], indent=1))
    return out


if __name__ == "__main__":
    main()

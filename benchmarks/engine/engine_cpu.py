"""Engine throughput on CPU: bitmatch kernels vs the same engine on stock torch ops vs HF generate.

Same tiny model, same requests, one run; reports generated tokens/s and their ratios, and
writes benchmarks/results/engine_cpu.json.

The stock variant runs the very same engine schedule (scheduler, paged cache, sampler) with
the ``bitmatch.kernels`` ops temporarily swapped for their stock counterparts of the op table
(F.linear, HF-style RMSNorm, SDPA over the gathered cache, torch log_softmax): ``stock_ops()``
(benchmarks/ops/stock_ops.py, ``kernels.override``), the same baseline as benchmarks/engine/gpu_e2e.py.

    python benchmarks/engine/engine_cpu.py [--requests 16] [--max-tokens 32] [--layers 2] [--hidden 128]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
from ops.stock_ops import stock_ops


# ----------------------------------------------------------------------------- runs
def run_engine(model, prompts, sp, args):
    from bitmatch.engine import Engine
    eng = Engine(model, block_size=16, num_gpu_blocks=1024, max_num_seqs=args.requests, seed=0)
    eng.generate(prompts[:2], sp, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = eng.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs), dt, outs


def run_hf(model, prompts, args):
    from bitmatch.testing.models import pad_batch
    ids, mask = pad_batch(prompts, side="left")
    kw = dict(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=True, temperature=1.0,
              top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=mask[:2], **kw)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        dt = time.perf_counter() - t0
    return (out.shape[1] - ids.shape[1]) * len(prompts), dt


def git_rev():
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], stderr=subprocess.DEVNULL,
                                       text=True).strip()
    except Exception:
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                  "results", "engine_cpu.json"))
    args = ap.parse_args(argv)

    import transformers

    from bitmatch.engine import SamplingParams
    from bitmatch.testing.models import random_prompts, tiny_model

    torch.manual_seed(0)
    model = tiny_model("qwen3", seed=0, num_hidden_layers=args.layers, hidden_size=args.hidden,
                       intermediate_size=2 * args.hidden)
    prompts = random_prompts(args.requests, args.min_prompt, args.max_prompt, seed=0)
    sp = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)

    res = {}
    n, dt, outs_bm = run_engine(model, prompts, sp, args)
    res["engine_bitmatch"] = dict(tokens=n, seconds=dt, tokens_per_s=n / dt)
    with stock_ops():
        n, dt, outs_stock = run_engine(model, prompts, sp, args)
    # proof the swap took effect: same seeds, so until the first differing token the only
    # difference is the kernels; count logprobs that differ on that common prefix
    same = diff = 0
    for a, b in zip(outs_bm, outs_stock):
        for ta, tb, la, lb in zip(a.outputs[0].token_ids, b.outputs[0].token_ids, a.outputs[0].logprobs,
                                  b.outputs[0].logprobs):
            if ta != tb:
                break
            same, diff = same + (la == lb), diff + (la != lb)
    res["engine_stock"] = dict(tokens=n, seconds=dt, tokens_per_s=n / dt,
                               logprobs_differing_from_bitmatch=diff, logprobs_compared=same + diff)
    n, dt = run_hf(model, prompts, args)
    res["hf_generate"] = dict(tokens=n, seconds=dt, tokens_per_s=n / dt)
    tps = {k: v["tokens_per_s"] for k, v in res.items()}
    ratios = {"engine_bitmatch / engine_stock": tps["engine_bitmatch"] / tps["engine_stock"],
              "engine_bitmatch / hf_generate": tps["engine_bitmatch"] / tps["hf_generate"],
              "engine_stock / hf_generate": tps["engine_stock"] / tps["hf_generate"]}
    report = dict(
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        machine=dict(platform=platform.platform(), processor=platform.processor(), cpu_count=os.cpu_count(),
                     torch_threads=torch.get_num_threads()),
        versions=dict(python=platform.python_version(), torch=torch.__version__,
                      transformers=transformers.__version__, bitmatch_git=git_rev()),
        setup=dict(model="tiny qwen3 (random weights, bf16)", layers=args.layers, hidden=args.hidden,
                   requests=args.requests, prompt_lengths=[args.min_prompt, args.max_prompt],
                   max_tokens=args.max_tokens, temperature=1.0, block_size=16),
        results=res, ratios=ratios)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    for k, v in res.items():
        print(f"{k:16s} {v['tokens']:6d} tokens {v['seconds']:8.3f} s {v['tokens_per_s']:9.1f} tok/s")
    for k, v in ratios.items():
        print(f"{k:32s} {v:.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

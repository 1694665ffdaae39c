"""``bitmatch locate``: the same tokens through two paths of one model, and the first op whose
output bits differ between them (docs/porting.md)."""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import bitmatch
from bitmatch.cli.common import (
    load_error,
    one_line,
    seed_problem,
    usage_error,
    version_string,
    writable_file_problem,
)
from bitmatch.diagnostics import verify
from bitmatch.diagnostics.family_check import tiny_model_for
from bitmatch.logprobs import check_temperature
from bitmatch.models import load_model
from bitmatch.parallel import enable_tensor_parallel
from bitmatch.parallel.launch import run_ranks
from bitmatch.testing.models import random_prompts


def _args_problem(a) -> str | None:
    """The first bad ``bitmatch locate`` option, named by its flag with the valid range (before any
    model is built, so a typo costs nothing and never surfaces as an engine argument's name)."""
    for flag, v in (("--prompts", a.prompts), ("--min-len", a.min_len), ("--max-len", a.max_len),
                    ("--max-tokens", a.max_tokens), ("--block-size", a.block_size),
                    ("--step-tokens", a.step_tokens), ("--rows", a.rows), ("--tp", a.tp)):
        if v < 1:
            return f"{flag} must be >= 1, got {v}"
    if a.tp > 1 and a.pair != "engine":
        return f"--tp {a.tp} runs the engine pair only (--pair engine); the {a.pair} pair runs at --tp 1"
    if a.tp > 1 and torch.cuda.is_available():
        return f"--tp {a.tp} runs CPU ranks on gloo; on a GPU machine set CUDA_VISIBLE_DEVICES= to use them"
    if a.min_len > a.max_len:
        return f"--min-len {a.min_len} is more than --max-len {a.max_len}: give --min-len <= --max-len"
    if a.tolerance is not None and not a.tolerance >= 0:
        return f"--tolerance must be >= 0, got {a.tolerance}"
    if seed_problem(a.seed):
        return seed_problem(a.seed)
    try:
        check_temperature("locate", a.temperature, name="--temperature")
    except ValueError as e:
        return one_line(e).removeprefix("locate: ")
    return a.json and writable_file_problem("--json", a.json)


def main(argv=None) -> int:
    """Run the same tokens through two paths of one model and name the first op whose output bits
    differ (layer, op, position, both values in hex, each op's fingerprint); exit 1 if one does."""
    ap = argparse.ArgumentParser(prog="bitmatch locate", description=main.__doc__)
    ap.add_argument("checkpoint", nargs="?", help="an HF checkpoint folder (or hub name); or use --family")
    ap.add_argument("--family", help="a registered family (or a tiny config name): a tiny random model built in code")
    ap.add_argument("--pair", required=True, choices=["engine", "hf", "schedule", "backend"],
                    help="engine: embedded engine (paged, chunked prefill, decode) vs trainer token_logprobs; "
                    "hf: HF's fp32 forward vs bitmatch's (tolerance); schedule: prefill vs decode, two chunk "
                    "splits, batch vs alone; backend: CPU reference vs Triton (tolerance; interpreter on CPU)")
    ap.add_argument("--inject", help="a fault on side B, to see a report: weight:LAYER.PARAM (e.g. "
                    "weight:1.mlp.down_proj), kernel:OP (a stock torch op, e.g. kernel:linear), temperature "
                    "(logits * (1/T) instead of logits / T)")
    ap.add_argument("--prompts", type=int, default=3, help="number of random prompts (default 3)")
    ap.add_argument("--min-len", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens generated per prompt (engine pair)")
    ap.add_argument("--block-size", type=int, default=16, help="paged KV block size (engine, schedule)")
    ap.add_argument("--step-tokens", type=int, default=7,
                    help="engine: max_num_batched_tokens (small: prompts prefilled in chunks beside decodes)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--tolerance", type=float, help="hf/backend: max |a-b| / max |a| allowed per op")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--format", choices=["table", "json"], default="table", help="what to print")
    ap.add_argument("--json", metavar="PATH", help="also write the JSON report to PATH")
    ap.add_argument("--rows", type=int, default=40, help="op rows shown per comparison (around the divergence)")
    ap.add_argument("--tp", type=int, default=1, help="engine pair: run both sides tensor-parallel on N forked CPU "
                    "ranks (gloo), each rank on its share of the model; rank 0's report (default 1)")
    a = ap.parse_args(argv)
    prog = "bitmatch locate"
    if (a.checkpoint is None) == (a.family is None):
        return usage_error(prog, "give a checkpoint path or --family NAME (not both)")
    problem = _args_problem(a)
    if problem:
        return usage_error(prog, problem)
    if a.pair == "backend" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (none of the above does)
    dtype = getattr(torch, a.dtype)
    try:
        verify.parse_inject(a.inject)
    except ValueError as e:
        return usage_error(prog, one_line(e).removeprefix("locate: "))
    if a.family is not None:
        try:
            model, what = tiny_model_for(a.family, dtype, a.seed)
        except ValueError as e:
            return usage_error(prog, f"--family: {one_line(e)}")
        what += f" (random weights, seed {a.seed})"
    else:
        try:
            model, what = load_model(a.checkpoint, dtype=dtype), a.checkpoint
        except Exception as e:  # any load failure is the checkpoint's (or the path's): one line, exit 2
            return usage_error(prog, load_error(a.checkpoint, e))
    bitmatch.patch(model, compute_dtype=dtype)   # as a user runs it: the compute dtype set once
    vocab = model.lm_head.weight.shape[0]
    prompts = random_prompts(a.prompts, a.min_len, a.max_len, seed=a.seed + 1, vocab_hi=min(99, vocab))
    def run(tp=None):
        if tp is not None:
            enable_tensor_parallel(model, tp)   # this rank's share of every layer, the family's own layout
        return verify.locate_pair(a.pair, model, prompts, inject=a.inject, temperature=a.temperature,
                                  tolerance=a.tolerance, max_tokens=a.max_tokens, seed=a.seed,
                                  block_size=a.block_size,
                                  engine_kw=dict(block_size=a.block_size, max_num_batched_tokens=a.step_tokens))

    try:
        if a.tp == 1:
            results = run()
        else:
            per_rank = run_ranks(lambda tp: run(tp), a.tp)
            results = per_rank[0]
            if any([r.bitmatched for r in rs] != [r.bitmatched for r in results] for rs in per_rank[1:]):
                return usage_error(f"{prog} --tp {a.tp}", "the ranks' reports disagree (a rank-local "
                                   "divergence): " + "; ".join(f"rank {i}: " + str([r.first_divergent for r in rs])
                                                               for i, rs in enumerate(per_rank)))
    except (NotImplementedError, RuntimeError, ValueError) as e:   # e.g. an op with no Triton version
        return usage_error(f"{prog} --pair {a.pair}", one_line(e))
    report = {"command": "bitmatch locate " + " ".join(argv if argv is not None else sys.argv[2:]),
              "versions": version_string(), "model": what, "dtype": a.dtype, "pair": a.pair, "inject": a.inject,
              "tp": a.tp,
              "prompts": prompts, "bitmatched": all(r.bitmatched for r in results),
              "results": [r.to_dict() for r in results]}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    if a.format == "json":
        print(json.dumps(report, indent=1))
    else:
        print(f"model: {what}, {a.dtype}; {len(prompts)} prompts of {a.min_len}-{a.max_len} tokens; "
              f"T = {a.temperature}" + (f"; TP = {a.tp} (rank 0's ops, each on its share)" if a.tp > 1 else ""))
        print(verify.format_table(results, a.rows))
        print("verdict:", "no divergent op" if report["bitmatched"] else "DIVERGED at " + "; ".join(
            r.first_divergent for r in results if not r.bitmatched))
    return 0 if report["bitmatched"] else 1

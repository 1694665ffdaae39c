"""``bitmatch demo``: its options, checked before anything is built, and the run
(``bitmatch.demo.run``); exit 0 when the rollout and trainer logprobs bitmatched."""
from __future__ import annotations

import argparse

import torch

from bitmatch.cli.common import load_error, one_line, seed_problem, usage_error, writable_folder_problem
from bitmatch.demo import PROMPTS, run
from bitmatch.logprobs import check_temperature
from bitmatch.models import load_model


def _args_problem(args) -> str | None:
    for flag, v in (("--num-prompts", args.num_prompts), ("--max-tokens", args.max_tokens)):
        if v < 1:
            return f"{flag} must be >= 1, got {v}"
    if seed_problem(args.seed):
        return seed_problem(args.seed)
    try:
        check_temperature("demo", args.temperature, name="--temperature")
    except ValueError as e:
        return one_line(e).removeprefix("demo: ")
    if args.dtype != "bfloat16" and not args.model:
        return (f"--dtype {args.dtype} applies to a --model checkpoint; the tiny model built in code is bf16: "
                "drop --dtype or pass --model")
    return writable_folder_problem("--out", args.out, ["report.json"] + ([] if args.no_plot else ["diff.png"]))


def main(argv=None) -> int:
    """Check the options (a bad one: one line naming it, exit 2, before anything is built), run the demo;
    exit 0 when the trainer's logprobs equal the rollout's bit for bit, 1 when they do not."""
    ap = argparse.ArgumentParser(prog="bitmatch demo", description="Rollout logprobs (bitmatch.Engine) vs "
                                 "trainer logprobs, with and without bitmatch; writes report.json and diff.png.")
    ap.add_argument("--model", default=None, help="HF checkpoint path or hub name (default: tiny model built in code)")
    ap.add_argument("--out", default="bitmatch-demo", help="output folder for report.json and diff.png")
    ap.add_argument("--num-prompts", type=int, default=12,
                    help="rollout requests, split into three batches of different sizes (default 12)")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens sampled per request (default 8)")
    ap.add_argument("--temperature", type=float, default=0.9,
                    help="sampling temperature, > 0; the trainer uses the same one (default 0.9)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights and of sampling (default 0)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="dtype of the --model checkpoint (the tiny model is always bf16)")
    ap.add_argument("--no-plot", action="store_true", help="do not write diff.png (no matplotlib needed)")
    args = ap.parse_args(argv)
    problem = _args_problem(args)
    if problem:  # one line, exit 2 (as argparse's own errors), before anything is built
        raise SystemExit(usage_error("bitmatch demo", problem))
    model = tok = None
    if args.model:
        try:
            model = load_model(args.model, dtype=getattr(torch, args.dtype))
        except Exception as e:  # any load failure is the checkpoint's: one line naming it and the fix
            raise SystemExit(usage_error("bitmatch demo", f"--model: {load_error(args.model, e)}")) from None
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(args.model)
            # transformers 5 builds a tokenizer without a vocabulary from config.json alone
            tok = tok if tok.encode(PROMPTS[0]) else None
        except Exception:
            tok = None
        if tok is None:
            print(f"bitmatch demo: no tokenizer with {args.model!r}: the prompts are token ids (for text prompts, "
                  "save one beside the weights: tokenizer.save_pretrained(folder))", flush=True)
    rep = run(model, tok, out_dir=args.out, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
              temperature=args.temperature, seed=args.seed, plot=not args.no_plot)
    return 0 if rep["bitmatch_on"]["bitmatched"] else 1

"""``bitmatch replay``: a repro bundle (what the TRL / verl step check saves on a mismatch)
rescored on the step's model and compared with the rollout's logprobs bit for bit."""
from __future__ import annotations

import argparse
import json
import sys

import torch

from bitmatch.cli.common import (
    EXIT_DIVERGED,
    EXIT_OK,
    load_error,
    one_line,
    usage_error,
    version_string,
    writable_file_problem,
)
from bitmatch.diagnostics.replay import read_bundle, replay as replay_bundle
from bitmatch.models import load_model


def main(argv=None) -> int:
    """Rescore a repro bundle's tokens (what the TRL / verl step check saves on a mismatch) on the
    step's model and compare them with the rollout's logprobs bit for bit; on a difference, name the
    first op whose bits differ on that sequence. Exit 1 if the rollout's logprobs are not reproduced."""
    ap = argparse.ArgumentParser(prog="bitmatch replay", description=main.__doc__)
    ap.add_argument("bundle", help="a bundle folder (config.json, tokens.pt), e.g. "
                    "<output_dir>/bitmatch_repro/step3_train_rank0")
    ap.add_argument("--model", help="the policy as it was at the bundle's step: HF checkpoint folder or hub name "
                    "(default: the checkpoint named in the bundle's model config); a bundle holds no weights")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the model runs (default: cuda if torch sees one)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="compute dtype (default: the bundle's)")
    ap.add_argument("--block-size", type=int, default=16, help="paged KV block size of the engine side of locate")
    ap.add_argument("--any-weights", action="store_true", help="replay even if the model's weights fingerprint "
                    "differs from the bundle's (it is then not the step's policy)")
    ap.add_argument("--json", metavar="PATH", help="also write the verdict and both comparisons to PATH")
    a = ap.parse_args(argv)
    prog = "bitmatch replay"
    if a.block_size < 1:
        return usage_error(prog, f"--block-size must be >= 1, got {a.block_size}")
    problem = (a.json and writable_file_problem("--json", a.json)) or (
        a.device == "cuda" and not torch.cuda.is_available() and "--device cuda but torch sees no CUDA device")
    if problem:
        return usage_error(prog, problem)
    try:
        bundle = read_bundle(a.bundle)
    except ValueError as e:
        return usage_error(prog, one_line(e).removeprefix("replay: "))
    path = a.model or (bundle.config.get("model_config") or {}).get("_name_or_path")
    if not path:
        return usage_error(prog, "the bundle names no checkpoint and holds no weights: give --model PATH_OR_HUB "
                           f"(the policy as it was at step {bundle.config.get('step')})")
    dtype = getattr(torch, a.dtype) if a.dtype else (bundle.dtype or torch.bfloat16)
    try:
        model = load_model(path, dtype=dtype, device=a.device)
    except Exception as e:  # any load failure is the checkpoint's (or the path's): one line, exit 2
        return usage_error(prog, load_error(path, e))
    try:
        res = replay_bundle(bundle, model, dtype=dtype, block_size=a.block_size, check_weights=not a.any_weights)
    except ValueError as e:
        return usage_error(prog, one_line(e).removeprefix("replay: "))
    cfg = bundle.config
    print(f"bundle: {bundle.folder} (step {cfg.get('step')}, {cfg.get('mode')}; {tuple(bundle.ids.shape)} tokens, "
          f"T = {bundle.temperature}); model: {path}, {dtype}, {a.device}")
    if bundle.dtype is not None and dtype != bundle.dtype:
        print(f"note: the step ran in {bundle.dtype}; rescoring in {dtype} gives other bits by design")
    print(res.summary())
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "bitmatch replay " + " ".join(argv if argv is not None else sys.argv[2:]),
                       "versions": version_string(), "bundle": bundle.folder, "model": path, "dtype": str(dtype),
                       "bitmatched": res.bitmatched, "rollout": res.rollout.to_dict(),
                       "trainer": res.trainer.to_dict(), "weights_fingerprint_matches": res.fingerprint_matches,
                       "located": res.located.to_dict() if res.located is not None else None}, f, indent=1)
    return EXIT_OK if res.bitmatched else EXIT_DIVERGED

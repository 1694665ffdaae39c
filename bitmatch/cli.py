"""The ``bitmatch`` command: ``check`` (invariance self-test of every op, or of every op one family
uses: ``--family``), ``locate`` (the first op whose bits differ between two paths), ``replay`` (a
repro bundle rescored on the step's model) and ``demo``."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from importlib import metadata

import torch

import bitmatch
import bitmatch.kernels as K
from bitmatch import controls, testing as T, verify
from bitmatch.cli_common import (  # noqa: F401
    EXIT_DIVERGED,
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_USAGE,
    front,
    load_error,
    one_line,
    seed_problem,
    usage_error,
    version_string,
    writable_file_problem,
    writable_folder_problem,
)
from bitmatch.demo import main as demo_main
from bitmatch.family_check import family_cases, tiny_model_for
from bitmatch.logprobs import check_temperature
from bitmatch.models import families, load_model
from bitmatch.replay import read_bundle, replay as replay_bundle
from bitmatch.testing_models import random_prompts


def _cases(device: str):
    """(op, axes, fn, is_control) rows; fn runs the harness and returns the number of cases run.

    Controls run the same harness on a stock formula and must find a mismatch: they show the
    harness can fail on this machine.
    """
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).bfloat16().to(device)  # noqa: E731
    w, wn, res = rnd(256, 512) * 0.05, (1 + 0.1 * rnd(512).float()).bfloat16(), rnd(4, 512)
    rows = rnd(4, 512)
    q, k = rnd(16, 4, 64), rnd(16, 2, 64)
    cos, sin = K.rotary_cos_sin(torch.arange(16, device=device) * 37, 64, 10000.0, dtype=torch.bfloat16)
    lg, tok = rnd(32, 5000) * 4, torch.randint(0, 5000, (32,), generator=g).to(device)
    seqs = [(rnd(n, 4, 64), rnd(n, 2, 64), rnd(n, 2, 64)) for n in (1, 23, 61)]
    n = 12
    rows_ = [
        ("linear", "batch, padding", lambda: T.assert_batch_invariant(lambda x: K.linear(x, w), rows, cases=n) or n),
        ("rms_norm", "batch, padding",
         lambda: T.assert_batch_invariant(lambda x: K.rms_norm(x, wn, 1e-6), rows, cases=n) or n),
        ("fused_add_rms_norm", "batch, padding",
         lambda: T.assert_batch_invariant(lambda x, r: K.fused_add_rms_norm(x, r, wn, 1e-6), (rows, res),
                                          cases=n) or n),
        ("apply_rotary", "batch, position",
         lambda: T.assert_batch_invariant(lambda a, b, c, s: K.apply_rotary(a, b, c, s), (q, k, cos, sin),
                                          max_batch=64, cases=n) or n),
        ("silu_and_mul", "batch, padding", lambda: T.assert_batch_invariant(K.silu_and_mul, rows, cases=n) or n),
        ("attention", "schedule (prefill/chunked/decode), block size, batch",
         lambda: T.assert_schedule_invariant(seqs, 0.125, cases=6) or 6),
        ("attention (window 16)", "schedule, block size, batch",
         lambda: T.assert_schedule_invariant(seqs, 0.125, sliding_window=16, cases=4) or 4),
        ("token_logprobs", "batch, padding",
         lambda: T.assert_batch_invariant(lambda x, t: K.token_logprobs(x, t, 0.7), (lg, tok), max_batch=64,
                                          cases=n) or n),
    ]
    if device == "cpu":  # thread count is a CPU axis; CUDA launch parallelism is covered by the batch axis
        rows_.insert(1, ("linear", "threads", lambda: T.assert_thread_invariant(_lin, (rows.repeat(40, 1), w)) or 2))
    return [(op, axes, fn, False) for op, axes, fn in rows_] + [(c.name, c.axes, c.run, True)
                                                               for c in controls.stock_controls(device)]


def _lin(x, w):
    return K.linear(x, w)


def check(argv=None) -> int:
    """Run every op's invariance self-test on this machine's backends and print a table; the stock
    controls (``bitmatch.controls``) run the same comparisons on stock ops and must find mismatches.
    Exit 1 if an op mismatched or a control found none (the harness did not show it can fail)."""
    ap = argparse.ArgumentParser(prog="bitmatch check", description=check.__doc__)
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="all",
                    help="cpu: reference backend; cuda: Triton backend; all: every available one")
    ap.add_argument("--verbose", action="store_true", help="print each mismatch found")
    ap.add_argument("--family", help="check every op this registered family uses, at its tiny-config shapes "
                    "(op list derived by running its forward), the whole model along the schedule axes, "
                    "the stock controls and the family's HF forward as a control")
    ap.add_argument("--cases", type=int, default=6, help="harness cases per op with --family (default 6)")
    ap.add_argument("--json", metavar="PATH", help="also write every row and the verdict to PATH as JSON")
    a = ap.parse_args(argv)
    if a.cases < 1:
        return usage_error("bitmatch check", f"--cases must be >= 1, got {a.cases}")
    problem = a.json and writable_file_problem("--json", a.json)
    if problem:
        return usage_error("bitmatch check", problem)
    if a.family is not None:
        try:
            if not any(a.family in (f.name, *f.model_types) for f in families()):
                # a family's named tiny shape passes; anything else raises naming the families
                tiny_model_for(a.family)
        except ValueError as e:
            print(f"bitmatch check: {e}", file=sys.stderr)
            return 2
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bitmatch check: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    devices = ["cpu", "cuda"] if a.device == "all" and torch.cuda.is_available() else \
        (["cpu"] if a.device == "all" else [a.device])
    w = 40 if a.family else 34
    print(f"{'op':<{w}} {'backend':<16} {'axes checked':<52} {'cases':>5} {'mismatches':>10} {'time':>7}")
    failed, weak, table = [], [], []
    for device in devices:
        backend = "triton (cuda)" if device == "cuda" else "reference (cpu)"
        rows = family_cases(a.family, device, a.cases) if a.family else _cases(device)
        for op, axes, fn, control in rows:
            t0, first = time.time(), None
            try:
                cases, bad = fn(), 0
            except T.BitMismatch as e:
                cases, bad, first = 1, 1, str(e)
                if a.verbose or not control:
                    print(f"  MISMATCH: {e}", file=sys.stderr)
            if control and not bad:
                weak.append(f"{op} ({device})")
            elif bad and not control:
                failed.append(f"{op} ({device})")
            found = f"{bad} (want >0)" if control else str(bad)
            label = f"stock ({device})" if control else backend
            dt = time.time() - t0
            print(f"{op:<{w}} {label:<16} {axes:<52} {cases:>5} {found:>10} {dt:>6.1f}s", flush=True)
            table.append({"op": op, "device": device, "backend": label, "axes": axes, "control": control,
                          "cases": cases, "mismatch_found": bool(bad), "first_mismatch": first,
                          "seconds": round(dt, 2)})
    verdict = "all ops bitmatched" if not failed else f"{len(failed)} op(s) MISMATCHED: {', '.join(failed)}"
    if a.family:
        verdict += f" (family {a.family})"
    ctl = "every control found a mismatch" if not weak else \
        f"{len(weak)} control(s) found NO mismatch (the harness did not show it can fail): {', '.join(weak)}"
    print(f"\nbackends: {', '.join(devices)}; {verdict}; {ctl}")
    rc = 1 if failed or weak else 0
    if a.json:
        try:
            triton = metadata.version("triton")
        except metadata.PackageNotFoundError:
            triton = None
        machine = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                   "gpu": torch.cuda.get_device_name() if "cuda" in devices else None,
                   "cuda": torch.version.cuda, "triton": triton}
        with open(a.json, "w") as f:
            json.dump({"command": "bitmatch check " + " ".join(argv if argv is not None else sys.argv[2:]),
                       "versions": version_string(), "machine": machine, "devices": devices,
                       "family": a.family, "rows": table, "ops_mismatched": failed,
                       "controls_without_mismatch": weak, "exit_code": rc}, f, indent=1)
    return rc


# ----------------------------------------------------------------------------- locate

def _locate_args_problem(a) -> str | None:
    """The first bad ``bitmatch locate`` option, named by its flag with the valid range (before any
    model is built, so a typo costs nothing and never surfaces as an engine argument's name)."""
    for flag, v in (("--prompts", a.prompts), ("--min-len", a.min_len), ("--max-len", a.max_len),
                    ("--max-tokens", a.max_tokens), ("--block-size", a.block_size),
                    ("--step-tokens", a.step_tokens), ("--rows", a.rows)):
        if v < 1:
            return f"{flag} must be >= 1, got {v}"
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


def locate(argv=None) -> int:
    """Run the same tokens through two paths of one model and name the first op whose output bits
    differ (layer, op, position, both values in hex, each op's fingerprint); exit 1 if one does."""
    ap = argparse.ArgumentParser(prog="bitmatch locate", description=locate.__doc__)
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
    a = ap.parse_args(argv)
    prog = "bitmatch locate"
    if (a.checkpoint is None) == (a.family is None):
        return usage_error(prog, "give a checkpoint path or --family NAME (not both)")
    problem = _locate_args_problem(a)
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
    try:
        results = verify.locate_pair(a.pair, model, prompts, inject=a.inject, temperature=a.temperature,
                                     tolerance=a.tolerance, max_tokens=a.max_tokens, seed=a.seed,
                                     block_size=a.block_size,
                                     engine_kw=dict(block_size=a.block_size, max_num_batched_tokens=a.step_tokens))
    except (NotImplementedError, RuntimeError, ValueError) as e:   # e.g. an op with no Triton version
        return usage_error(f"{prog} --pair {a.pair}", one_line(e))
    report = {"command": "bitmatch locate " + " ".join(argv if argv is not None else sys.argv[2:]),
              "versions": version_string(), "model": what, "dtype": a.dtype, "pair": a.pair, "inject": a.inject,
              "prompts": prompts, "bitmatched": all(r.bitmatched for r in results),
              "results": [r.to_dict() for r in results]}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    if a.format == "json":
        print(json.dumps(report, indent=1))
    else:
        print(f"model: {what}, {a.dtype}; {len(prompts)} prompts of {a.min_len}-{a.max_len} tokens; "
              f"T = {a.temperature}")
        print(verify.format_table(results, a.rows))
        print("verdict:", "no divergent op" if report["bitmatched"] else "DIVERGED at " + "; ".join(
            r.first_divergent for r in results if not r.bitmatched))
    return 0 if report["bitmatched"] else 1


# ----------------------------------------------------------------------------- replay

def replay(argv=None) -> int:
    """Rescore a repro bundle's tokens (what the TRL / verl step check saves on a mismatch) on the
    step's model and compare them with the rollout's logprobs bit for bit; on a difference, name the
    first op whose bits differ on that sequence. Exit 1 if the rollout's logprobs are not reproduced."""
    ap = argparse.ArgumentParser(prog="bitmatch replay", description=replay.__doc__)
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


def main(argv=None) -> int:
    """The ``bitmatch`` command (the console script enters at cli_common.main, which answers help,
    version and unknown commands without importing this module)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    early = front(argv)
    if early is not None:
        return early
    cmd, rest = argv[0], argv[1:]
    commands = {"check": check, "locate": locate, "replay": replay, "demo": _demo}
    try:
        return commands[cmd](rest) or EXIT_OK
    except Exception:  # a bug, not a user error: the traceback, and a code that is not "divergence found"
        traceback.print_exc()
        print(f"bitmatch {cmd}: internal error (exit {EXIT_INTERNAL}); please report it with the traceback above",
              file=sys.stderr)
        return EXIT_INTERNAL


def _demo(argv) -> int:
    return demo_main(argv)


if __name__ == "__main__":
    sys.exit(main())

"""``bitmatch check``: the invariance self-test of every op on this machine's backends, with the
stock controls that must find a mismatch (``--family``: every op one registered family uses)."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from importlib import metadata

import torch

import bitmatch.kernels as K
from bitmatch import testing as T
from bitmatch.cli.common import usage_error, version_string, writable_file_problem
from bitmatch.diagnostics import controls
from bitmatch.diagnostics.family_check import family_cases, tiny_model_for
from bitmatch.models import families
from bitmatch.parallel.launch import run_ranks


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


def main(argv=None) -> int:
    """Run every op's invariance self-test on this machine's backends and print a table; the stock
    controls (``bitmatch.diagnostics.controls``) run the same comparisons on stock ops and must find mismatches.
    Exit 1 if an op mismatched or a control found none (the harness did not show it can fail)."""
    ap = argparse.ArgumentParser(prog="bitmatch check", description=main.__doc__)
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="all",
                    help="cpu: reference backend; cuda: Triton backend; all: every available one")
    ap.add_argument("--verbose", action="store_true", help="print each mismatch found")
    ap.add_argument("--family", help="check every op this registered family uses, at its tiny-config shapes "
                    "(op list derived by running its forward), the whole model along the schedule axes, "
                    "the stock controls and the family's HF forward as a control")
    ap.add_argument("--cases", type=int, default=6, help="harness cases per op with --family (default 6)")
    ap.add_argument("--json", metavar="PATH", help="also write every row and the verdict to PATH as JSON")
    ap.add_argument("--tp", type=int, default=1, help="with --family: run the family tensor-parallel on N forked "
                    "CPU ranks (gloo), every op at a rank's shapes, TP N vs TP 1, the all-reduce layout as control")
    a = ap.parse_args(argv)
    if a.cases < 1:
        return usage_error("bitmatch check", f"--cases must be >= 1, got {a.cases}")
    if a.tp < 1:
        return usage_error("bitmatch check", f"--tp must be >= 1, got {a.tp}")
    if a.tp > 1 and (a.family is None or a.device == "cuda"):
        return usage_error("bitmatch check", f"--tp {a.tp} needs --family NAME and runs on CPU ranks (--device cpu)")
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
    if a.tp > 1:
        devices = ["cpu"]
    w = 40 if a.family else 34
    print(f"{'op':<{w}} {'backend':<16} {'axes checked':<52} {'cases':>5} {'mismatches':>10} {'time':>7}")
    if a.tp > 1:
        per_rank = run_ranks(lambda tp: _run_rows(family_cases(a.family, "cpu", a.cases, tp), "cpu", w,
                                                  a.verbose, quiet=tp.rank > 0), a.tp)
        failed, weak, table = per_rank[0]
        for r, (f, wk, _) in enumerate(per_rank[1:], 1):   # a rank-local result counts too
            failed += [f"{op} (rank {r})" for op in f]
            weak += [f"{op} (rank {r})" for op in wk]
    else:
        failed, weak, table = [], [], []
        for device in devices:
            rows = family_cases(a.family, device, a.cases) if a.family else _cases(device)
            f, wk, t = _run_rows(rows, device, w, a.verbose)
            failed, weak, table = failed + f, weak + wk, table + t
    verdict = "all ops bitmatched" if not failed else f"{len(failed)} op(s) MISMATCHED: {', '.join(failed)}"
    if a.family:
        verdict += f" (family {a.family}" + (f", TP {a.tp}" if a.tp > 1 else "") + ")"
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
                       "family": a.family, "tp": a.tp, "rows": table, "ops_mismatched": failed,
                       "controls_without_mismatch": weak, "exit_code": rc}, f, indent=1)
    return rc


def _run_rows(rows, device, w, verbose, quiet=False):
    """Run (op, axes, fn, is_control) rows, printing each (unless ``quiet``): (failed, weak, table)."""
    failed, weak, table = [], [], []
    backend = "triton (cuda)" if device == "cuda" else "reference (cpu)"
    for op, axes, fn, control in rows:
        t0, first = time.time(), None
        try:
            cases, bad = fn(), 0
        except T.BitMismatch as e:
            cases, bad, first = 1, 1, str(e)
            if (verbose or not control) and not quiet:
                print(f"  MISMATCH: {e}", file=sys.stderr)
        if control and not bad:
            weak.append(f"{op} ({device})")
        elif bad and not control:
            failed.append(f"{op} ({device})")
        found = f"{bad} (want >0)" if control else str(bad)
        label = f"stock ({device})" if control else backend
        dt = time.time() - t0
        if not quiet:
            print(f"{op:<{w}} {label:<16} {axes:<52} {cases:>5} {found:>10} {dt:>6.1f}s", flush=True)
        table.append({"op": op, "device": device, "backend": label, "axes": axes, "control": control,
                      "cases": cases, "mismatch_found": bool(bad), "first_mismatch": first,
                      "seconds": round(dt, 2)})
    return failed, weak, table

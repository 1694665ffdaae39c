"""The ``bitmatch`` command: ``check`` (invariance self-test of every op) and ``demo``."""
from __future__ import annotations

import argparse
import sys
import time


def _cases():
    """(op, axes, fn) triples; fn runs the harness and returns the number of cases run."""
    import torch

    import bitmatch.kernels as K
    from bitmatch import testing as T

    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).bfloat16()  # noqa: E731
    w, wn, res = rnd(256, 512) * 0.05, (1 + 0.1 * rnd(512).float()).bfloat16(), rnd(4, 512)
    rows = rnd(4, 512)
    q, k = rnd(16, 4, 64), rnd(16, 2, 64)
    cos, sin = K.rotary_cos_sin(torch.arange(16) * 37, 64, 10000.0, dtype=torch.bfloat16)
    lg, tok = rnd(4, 5000) * 4, torch.randint(0, 5000, (4,), generator=g)
    seqs = [(rnd(n, 4, 64), rnd(n, 2, 64), rnd(n, 2, 64)) for n in (1, 23, 61)]
    n = 12
    return [
        ("linear", "batch, padding", lambda: T.assert_batch_invariant(lambda x: K.linear(x, w), rows, cases=n) or n),
        ("linear", "threads", lambda: T.assert_thread_invariant(_lin, (rows.repeat(40, 1), w)) or 2),
        ("rms_norm", "batch, padding", lambda: T.assert_batch_invariant(lambda x: K.rms_norm(x, wn, 1e-6), rows, cases=n) or n),
        ("fused_add_rms_norm", "batch, padding",
         lambda: T.assert_batch_invariant(lambda x, r: K.fused_add_rms_norm(x, r, wn, 1e-6), (rows, res), cases=n) or n),
        ("apply_rotary", "batch, position",
         lambda: T.assert_batch_invariant(lambda a, b, c, s: K.apply_rotary(a, b, c, s), (q, k, cos, sin), max_batch=64, cases=n) or n),
        ("silu_and_mul", "batch, padding", lambda: T.assert_batch_invariant(K.silu_and_mul, rows, cases=n) or n),
        ("attention", "schedule (prefill/chunked/decode), block size, batch",
         lambda: T.assert_schedule_invariant(seqs, 0.125, cases=6) or 6),
        ("attention (window 16)", "schedule, block size, batch",
         lambda: T.assert_schedule_invariant(seqs, 0.125, sliding_window=16, cases=4) or 4),
        ("token_logprobs", "batch, padding",
         lambda: T.assert_batch_invariant(lambda x, t: K.token_logprobs(x, t, 0.7), (lg, tok), max_batch=64, cases=n) or n),
    ]


def _lin(x, w):
    import bitmatch.kernels as K
    return K.linear(x, w)


def check(argv=None) -> int:
    """Run every op's invariance self-test on this machine's backend and print a table."""
    import torch

    from bitmatch.testing import BitMismatch
    ap = argparse.ArgumentParser(prog="bitmatch check", description=check.__doc__)
    ap.parse_args(argv)
    backend = "triton (cuda)" if torch.cuda.is_available() else "reference (cpu)"
    print(f"{'op':<22} {'backend':<16} {'axes checked':<52} {'cases':>5} {'mismatches':>10} {'time':>7}")
    failed = 0
    for op, axes, fn in _cases():
        t0 = time.time()
        try:
            cases, bad = fn(), 0
        except BitMismatch as e:
            cases, bad = 1, 1
            print(f"  MISMATCH: {e}", file=sys.stderr)
        failed += bad
        print(f"{op:<22} {'reference (cpu)':<16} {axes:<52} {cases:>5} {bad:>10} {time.time() - t0:>6.1f}s")
    print(f"\nbackend on this machine: {backend}; "
          f"{'all ops bitmatched' if not failed else f'{failed} op(s) MISMATCHED'}")
    return 1 if failed else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: bitmatch {check,demo} [options]\n\n"
              "  check   run the invariance self-test of every op and print a table\n"
              "  demo    rollouts with the embedded engine vs trainer logprobs: Diff = 0 with\n"
              "          bitmatch, the nonzero diff without (tiny model built in code)")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "check":
        return check(rest)
    if cmd == "demo":
        from bitmatch.demo import main as demo_main
        return demo_main(rest) or 0
    print(f"bitmatch: unknown command {cmd!r} (use check or demo)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

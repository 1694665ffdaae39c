"""The ``bitmatch`` command: ``check`` (invariance self-test of every op, or of every op one family
uses: ``--family``), ``locate`` (the first op whose bits differ between two paths) and ``demo``."""
from __future__ import annotations

import argparse
import sys
import time


def _cases(device: str):
    """(op, axes, fn, is_control) rows; fn runs the harness and returns the number of cases run.

    Controls run the same harness on a stock formula and must find a mismatch: they show the
    harness can fail on this machine.
    """
    import torch

    import bitmatch.kernels as K
    from bitmatch import testing as T

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
    if device == "cpu":  # thread count is a CPU axis; CUDA launch parallelism is covered by the batch axis
        rows_.insert(1, ("linear", "threads", lambda: T.assert_thread_invariant(_lin, (rows.repeat(40, 1), w)) or 2))
    out = [(op, axes, fn, False) for op, axes, fn in rows_]
    return out + _controls(device, g, w, seqs)


def _controls(device, g, w, seqs):
    """Control rows: the same harness on stock ops, sized so that they mismatch on this device.

    fp32 F.linear (one row takes another BLAS path than many); on CUDA also bf16 cuBLAS at small
    vs large M. SDPA across schedules: on CPU with boolean masks; on CUDA as an engine calls it
    (is_causal flash prefill, unmasked one-token decode) at contexts up to 700 tokens, where
    flash-decoding splits the keys. Temperature: vLLM divides by a per-row temperature tensor,
    HF/TRL write ``logits / T`` with a float, which CUDA runs as ``logits * (1/T)``; on CUDA at
    realistic scale (logits ~ N(0, 5) over a 151,936 vocabulary, T = 0.7).
    """
    import torch
    import torch.nn.functional as F

    from bitmatch import testing as T

    cuda = device != "cpu"
    wf, rf = w.float(), torch.randn(32, 512, generator=g).to(device)
    out = [("control: F.linear fp32", "batch",
            lambda: T.assert_batch_invariant(lambda x: F.linear(x, wf), rf, cases=20) or 20, True)]
    if cuda:
        # 4096 x 4096 bf16: cuBLAS's rows at M <= 33 differ from the same rows at M = 4096
        wb = (torch.randn(4096, 4096, generator=g) * 0.02).bfloat16().to(device)
        rb = torch.randn(32, 4096, generator=g).bfloat16().to(device)
        out.append(("control: F.linear bf16", "batch (M 1 vs up to 4096)", lambda: T.assert_batch_invariant(
            lambda x: F.linear(x, wb), rb, max_batch=4096, cases=20) or 20, True))
        rnd = lambda *s: torch.randn(*s, generator=g).bfloat16().to(device)  # noqa: E731
        sdpa_seqs = [(rnd(n, 8, 128), rnd(n, 2, 128), rnd(n, 2, 128)) for n in (1, 200, 700)]
        pre = lambda *a: T.stock_sdpa_prefill(*a, engine_style=True)  # noqa: E731
        dec = lambda *a: T.stock_sdpa_paged(*a, engine_style=True)  # noqa: E731
        sdpa = lambda: T.assert_schedule_invariant(  # noqa: E731
            sdpa_seqs, 128 ** -0.5, prefill_fn=pre, paged_fn=dec, cases=8, seed=1) or 8
        lg = (torch.randn(16, 151936, generator=g) * 5).to(device)
    else:
        sdpa = lambda: T.assert_schedule_invariant(  # noqa: E731
            seqs, 0.125, prefill_fn=T.stock_sdpa_prefill, paged_fn=T.stock_sdpa_paged, cases=8, seed=1) or 8
        lg = (torch.randn(32, 5000, generator=g) * 4).bfloat16().float()
    out += [
        ("control: SDPA", "schedule", sdpa, True),
        ("control: x/T vs x*(1/T)", "engine", lambda: T.assert_batch_invariant(
            _stock_logprob_rows, lg, max_batch=64, cases=40, seed=9) or 40, True),
    ]
    return out


def _lin(x, w):
    import bitmatch.kernels as K
    return K.linear(x, w)


def _stock_logprob_rows(x, temperature=0.7):
    """Full log_softmax rows (what an engine's sampled and top-k logprobs are read from). Alone:
    vLLM's formula (x / a per-row temperature tensor, true division); in a batch: the trainer's
    x * (1/T) (what HF/TRL's ``logits / T`` with a float runs as on CUDA). About 5% of the
    entries differ, so every row of a realistic vocabulary shows it."""
    import torch
    if x.shape[0] == 1:
        z = x / torch.full((1, 1), temperature, dtype=x.dtype, device=x.device)
    else:
        z = x * (1 / temperature)
    return torch.log_softmax(z, -1)


def check(argv=None) -> int:
    """Run every op's invariance self-test on this machine's backends and print a table;
    controls run the same harness on stock ops and must find mismatches."""
    import torch

    from bitmatch.testing import BitMismatch
    ap = argparse.ArgumentParser(prog="bitmatch check", description=check.__doc__)
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="all",
                    help="cpu: reference backend; cuda: Triton backend; all: every available one")
    ap.add_argument("--verbose", action="store_true", help="print each mismatch found")
    ap.add_argument("--family", help="check every op this registered family uses, at its tiny-config shapes "
                    "(op list derived by running its forward), the whole model along the schedule axes, "
                    "and controls at the same shapes")
    ap.add_argument("--cases", type=int, default=6, help="harness cases per op with --family (default 6)")
    a = ap.parse_args(argv)
    if a.family is not None:
        try:
            from bitmatch.models import families
            if not any(a.family in (f.name, *f.model_types) for f in families()):
                tiny_model_for(a.family)   # a TINY_CONFIGS name passes; anything else raises naming the families
        except ValueError as e:
            print(f"bitmatch check: {e}", file=sys.stderr)
            return 2
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bitmatch check: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    devices = ["cpu", "cuda"] if a.device == "all" and torch.cuda.is_available() else \
        (["cpu"] if a.device == "all" else [a.device])
    w = 40 if a.family else 24
    print(f"{'op':<{w}} {'backend':<16} {'axes checked':<52} {'cases':>5} {'mismatches':>10} {'time':>7}")
    failed, weak = 0, 0
    for device in devices:
        backend = "triton (cuda)" if device == "cuda" else "reference (cpu)"
        rows = _family_cases(a.family, device, a.cases) if a.family else _cases(device)
        for op, axes, fn, control in rows:
            t0 = time.time()
            try:
                cases, bad = fn(), 0
            except BitMismatch as e:
                cases, bad = 1, 1
                if a.verbose or not control:
                    print(f"  MISMATCH: {e}", file=sys.stderr)
            if control:
                weak += not bad
            else:
                failed += bad
            found = f"{bad} (want >0)" if control else str(bad)
            label = f"stock ({device})" if control else backend
            print(f"{op:<{w}} {label:<16} {axes:<52} {cases:>5} {found:>10} {time.time() - t0:>6.1f}s")
    verdict = "all ops bitmatched" if not failed else f"{failed} op(s) MISMATCHED"
    if a.family:
        verdict += f" (family {a.family})"
    ctl = "every control found a mismatch" if not weak else f"{weak} control(s) found NO mismatch"
    print(f"\nbackends: {', '.join(devices)}; {verdict}; {ctl}")
    return 1 if failed else 0


# ----------------------------------------------------------------------------- check --family

def tiny_model_for(family: str, dtype=None, seed: int = 0):
    """(tiny random-weight model of ``family``, what it is): a TINY_CONFIGS entry name; or a
    registered family (its name or a model_type), built by the family's own ``tiny_model`` (on the
    Family, its module, or its ``<module>_tiny`` module), else the first TINY_CONFIGS entry of its
    model types. ValueError naming the registered families otherwise."""
    import importlib

    import torch

    from bitmatch.models import families
    from bitmatch.testing_models import TINY_CONFIGS, tiny_model

    dtype = dtype or torch.bfloat16
    if family in TINY_CONFIGS:
        return tiny_model(family, dtype=dtype, seed=seed), f"tiny {family}"
    fams = families()
    fam = next((f for f in fams if f.name == family or family in f.model_types), None)
    if fam is None:
        raise ValueError(f"unknown family {family!r}; registered: {', '.join(f.name for f in fams)} "
                         f"(or a tiny config: {', '.join(TINY_CONFIGS)})")
    mod = type(fam).__module__
    for where in (fam, mod, mod + "_tiny"):
        try:
            obj = importlib.import_module(where) if isinstance(where, str) else where
        except ImportError:
            continue
        if callable(getattr(obj, "tiny_model", None)):
            return obj.tiny_model(dtype=dtype, seed=seed), f"tiny {fam.name} ({getattr(obj, '__name__', fam.name)}.tiny_model)"
    try:
        cfg = fam.tiny_config()   # the registry's: the module's tiny_config, else a TINY_CONFIGS entry
    except (NotImplementedError, AttributeError):
        raise ValueError(f"family {fam.name!r} has no tiny model: give its module a tiny_model(dtype, seed) or "
                         f"tiny_config(), or add a TINY_CONFIGS entry (model types {sorted(fam.model_types)}); "
                         "or pass a checkpoint") from None
    import transformers
    cfg._attn_implementation = "eager"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    entry = next((n for n, (mt, _) in TINY_CONFIGS.items() if mt in fam.model_types), None)
    return model.to(dtype).eval(), f"tiny {entry or fam.name + ' (' + type(fam).__name__ + '.tiny_config)'}"


def _capture_kernel_calls(model, seqs):
    """Every bitmatch.kernels call one trainer forward (packed prefill + token_logprobs) and one
    engine-style forward (paged, chunked) make, as (op, args, kwargs): the op list of the family,
    at its shapes, derived by running it (no per-family table)."""
    import torch

    import bitmatch.kernels as K
    from bitmatch import verify
    from bitmatch.models import compute_logits, forward_hidden, pack
    from bitmatch.testing_models import pad_batch

    calls = []
    names = [n for n in K.__all__ if callable(getattr(K, n)) and n not in ("use_backend", "backend_for")]
    saved = {n: getattr(K, n) for n in names}

    def wrap(name, fn):
        def w(*a, **k):
            calls.append((name, a, k))
            return fn(*a, **k)
        return w
    for n, fn in saved.items():
        setattr(K, n, wrap(n, fn))
    try:
        ids, mask = pad_batch(seqs, "right")
        p = pack(ids, mask)
        with torch.no_grad():
            logits = compute_logits(model, forward_hidden(model, p.input_ids, p.context()))
            src = (~p.seq_end).nonzero(as_tuple=True)[0]
            K.token_logprobs(logits[src], p.input_ids[src + 1], 0.7)
            verify._paged_trace(model, seqs, verify.schedule_steps([len(s) for s in seqs], "chunked"))
    finally:
        for n, fn in saved.items():
            setattr(K, n, fn)
    return calls


def _signature(op, args, kwargs):
    import torch
    sig = lambda a: (tuple(a.shape[1:]), str(a.dtype)) if isinstance(a, torch.Tensor) else repr(a)  # noqa: E731
    return (op, tuple(sig(a) for a in args), tuple((k, sig(v)) for k, v in sorted(kwargs.items())))


def invariance_kind(fn) -> str:
    """"row" when the op's documented guarantee is per row / token / element (the batch harness
    applies), else "sequence" (the output depends on other tokens: a causal prefix, keys, windows,
    a state). A kernel may say so itself with ``fn.invariance``; otherwise the "Invariance:"
    sentence of its docstring (every public op has one) decides."""
    import re

    kind = getattr(fn, "invariance", None)
    if kind in ("row", "sequence"):
        return kind
    doc = " ".join((fn.__doc__ or "").split())
    m = re.search(r"Invariance:(.*?)(\.\s|\.$|$)", doc)
    text = m.group(1).lower() if m else ""
    if re.search(r"sequence|predecessor|window|keys|prefix|prefill|block|state", text):
        return "sequence"
    return "row" if re.search(r"\brow|token|element", text) else "sequence"


def _row_harness(op, args, kwargs, n):
    """assert_batch_invariant on the op's row arguments (tensors whose dim 0 is the first tensor's),
    the rest held fixed; None when the op is not row-wise (an int tensor that is not rows: a
    sequence/state op)."""
    import torch

    import bitmatch.kernels as K
    from bitmatch import testing as T

    if invariance_kind(getattr(K, op)) != "row":
        return None
    items = list(enumerate(args)) + list(kwargs.items())
    tens = [(k, v) for k, v in items if isinstance(v, torch.Tensor)]
    if not tens or tens[0][1].dim() == 0:
        return None
    R = tens[0][1].shape[0]
    rows = [(k, v) for k, v in tens if v.dim() and v.shape[0] == R]
    keys = [k for k, _ in rows]
    if any(not v.is_floating_point() for k, v in tens if k not in keys):
        return None
    fn = getattr(K, op)

    def call(*vals):
        a, kw = list(args), dict(kwargs)
        for k, v in zip(keys, vals):
            if isinstance(k, int):
                a[k] = v
            else:
                kw[k] = v
        return fn(*a, **kw)
    return lambda: T.assert_batch_invariant(call, tuple(v for _, v in rows), max_batch=64, cases=n) or n


def _family_cases(family: str, device: str, n: int = 6):
    """(op, axes, fn, is_control) rows for every kernel op ``family`` calls at its tiny shapes, the
    whole model along the schedule axes, and controls at the same shapes (stock ops)."""
    import torch
    import torch.nn.functional as F

    from bitmatch import testing as T
    from bitmatch import verify
    from bitmatch.testing_models import random_prompts

    import bitmatch
    model = bitmatch.patch(tiny_model_for(family, torch.bfloat16, seed=0)[0].to(device), compute_dtype=torch.bfloat16)
    # 53 tokens: a prime row count no weight dimension shares, so "rows" are tokens
    seqs = [s[:n_] for s, n_ in zip(random_prompts(3, 23, 23, seed=5), (11, 19, 23))]
    calls = _capture_kernel_calls(model, seqs)
    groups: dict = {}
    for op, a, k in calls:
        groups.setdefault(_signature(op, a, k), (op, a, k))
    out, first, seen_seq = [], {}, set()
    for op, a, k in groups.values():
        first.setdefault(op, (a, k))
        shapes = [tuple(t.shape) for t in list(a) + list(k.values()) if isinstance(t, torch.Tensor)][:2]
        label = f"{op} " + "x".join(str(list(sh)).replace(" ", "") for sh in shapes)
        if op == "attention_prefill":
            q, kk, v, cu, scale = a[:5]
            win = a[6] if len(a) > 6 else k.get("sliding_window")
            cu_ = cu.tolist()
            sq = [(q[s:e], kk[s:e], v[s:e]) for s, e in zip(cu_[:-1], cu_[1:])]
            out.append((label, f"schedule (prefill/chunked/decode), block size, batch{', window ' + str(win) if win else ''}",
                        lambda sq=sq, scale=scale, win=win: T.assert_schedule_invariant(
                            sq, scale, sliding_window=win, cases=n) or n, False))
        elif op in ("attention_paged", "write_kv_cache", "attention_decode"):
            continue  # the attention_prefill rows run these against paged caches
        else:
            h = _row_harness(op, a, k, n)
            if h is None and op not in seen_seq:
                seen_seq.add(op)
                out.append((f"{op} (every shape)", "sequence op: covered by the model row", lambda: 0, False))
            elif h is None:
                continue
            else:
                out.append((label, "batch, padding", h, False))
    out.append((f"model ({family})", "schedule: decode, chunk splits, batch composition",
                lambda: _raise_if_diverged(verify.locate_pair("schedule", model, [s[:7] for s in seqs])), False))
    x, w = first["linear"][0][:2]
    out.append(("control: F.linear fp32", "batch", lambda: T.assert_batch_invariant(
        lambda r: F.linear(r, w.float()), x.float(), cases=20) or 20, True))
    if "attention_prefill" in first:
        q, kk, v, cu, scale = first["attention_prefill"][0][:5]
        cu_ = cu.tolist()
        sq = [(q[s:e], kk[s:e], v[s:e]) for s, e in zip(cu_[:-1], cu_[1:])]
        out.append(("control: SDPA", "schedule", lambda: T.assert_schedule_invariant(
            sq, scale, prefill_fn=T.stock_sdpa_prefill, paged_fn=T.stock_sdpa_paged, cases=8, seed=1) or 8, True))
    lg = first["token_logprobs"][0][0]
    out.append(("control: x/T vs x*(1/T)", "engine", lambda: T.assert_batch_invariant(
        _stock_logprob_rows, lg.float(), max_batch=64, cases=20, seed=9) or 20, True))
    out.append(("control: HF forward", "batch", lambda: _hf_batch_control(model, seqs), True))
    return out


def _raise_if_diverged(results) -> int:
    from bitmatch.testing import BitMismatch
    bad = [r for r in results if not r.bitmatched]
    if bad:
        raise BitMismatch("; ".join(r.summary() for r in bad))
    return len(results)


def _hf_batch_control(model, seqs) -> int:
    """HF's own fp32 forward: each sequence alone vs all in one right-padded batch (must differ)."""
    import torch

    from bitmatch.testing import assert_bitwise_equal
    from bitmatch.testing_models import pad_batch
    from bitmatch.verify import fp32_reference

    hf = fp32_reference(model)
    ids, mask = pad_batch(seqs, "right")
    with torch.no_grad():
        batch = hf(input_ids=ids, attention_mask=mask).logits
        for i, s in enumerate(seqs):
            alone = hf(input_ids=torch.tensor([s])).logits[0]
            assert_bitwise_equal(batch[i, :len(s)], alone, f"HF forward, sequence {i} alone vs in the batch")
    return len(seqs)


# ----------------------------------------------------------------------------- locate

def locate(argv=None) -> int:
    """Run the same tokens through two paths of one model and name the first op whose output bits
    differ (layer, op, position, both values in hex, each op's fingerprint); exit 1 if one does."""
    import json
    import os

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
    if (a.checkpoint is None) == (a.family is None):
        print("bitmatch locate: give a checkpoint path or --family NAME (not both)", file=sys.stderr)
        return 2
    import torch
    if a.pair == "backend" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    from bitmatch import verify
    from bitmatch.testing_models import random_prompts
    dtype = getattr(torch, a.dtype)
    try:
        verify.parse_inject(a.inject)
        if a.family is not None:
            model, what = tiny_model_for(a.family, dtype, a.seed)
            what += f" (random weights, seed {a.seed})"
        else:
            from bitmatch.models import load_model
            model, what = load_model(a.checkpoint, dtype=dtype), a.checkpoint
    except ValueError as e:
        print(f"bitmatch locate: {e}", file=sys.stderr)
        return 2
    import bitmatch
    bitmatch.patch(model, compute_dtype=dtype)   # as a user runs it: the compute dtype set once
    vocab = model.lm_head.weight.shape[0]
    prompts = random_prompts(a.prompts, a.min_len, a.max_len, seed=a.seed + 1, vocab_hi=min(99, vocab))
    try:
        results = verify.locate_pair(a.pair, model, prompts, inject=a.inject, temperature=a.temperature,
                                     tolerance=a.tolerance, max_tokens=a.max_tokens, seed=a.seed,
                                     block_size=a.block_size,
                                     engine_kw=dict(block_size=a.block_size, max_num_batched_tokens=a.step_tokens))
    except (NotImplementedError, RuntimeError, ValueError) as e:   # e.g. an op with no Triton version
        print(f"bitmatch locate --pair {a.pair}: {e}", file=sys.stderr)
        return 2
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
        print(f"model: {what}, {a.dtype}; {len(prompts)} prompts of {a.min_len}-{a.max_len} tokens; T = {a.temperature}")
        print(verify.format_table(results, a.rows))
        print("verdict:", "no divergent op" if report["bitmatched"] else "DIVERGED at " + "; ".join(
            r.first_divergent for r in results if not r.bitmatched))
    return 0 if report["bitmatched"] else 1


USAGE = """usage: bitmatch {check,locate,demo} [options]   (bitmatch COMMAND --help for its options)

  check      run the invariance self-test of every op and print a table
             (--family NAME: every op that family uses, at its shapes, with controls)
  locate     run the same tokens through two paths (--pair engine|hf|schedule|backend) and
             name the first op whose output bits differ (docs/porting.md)
  demo       rollouts with the embedded engine vs trainer logprobs: Diff = 0 with
             bitmatch, the nonzero diff without (tiny model built in code)
  --version  print the versions of bitmatch, torch and transformers"""


def version_string() -> str:
    """'bitmatch X (torch Y, transformers Z)' from the installed distributions (no heavy import)."""
    from importlib import metadata

    def v(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"
    import bitmatch
    return f"bitmatch {bitmatch.__version__} (torch {v('torch')}, transformers {v('transformers')})"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # a bare `bitmatch` did nothing useful: say how to use it, exit as argparse does
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        print(version_string())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "check":
        return check(rest)
    if cmd == "locate":
        return locate(rest)
    if cmd == "demo":
        from bitmatch.demo import main as demo_main
        return demo_main(rest) or 0
    print(f"bitmatch: unknown command {cmd!r} (use check, locate or demo)\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

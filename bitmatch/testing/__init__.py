"""The invariance harness: try to break each axis of the contract, report the first bit.

Public and reused by every test and by users checking their own setup:

* ``assert_batch_invariant``  - a row alone vs inside random batches (size, neighbours,
  position, zero padding left or right);
* ``assert_schedule_invariant`` - attention: full prefill vs random chunked prefill vs
  token-by-token decode, random block sizes and shuffled block tables, mixed batches;
* ``assert_thread_invariant`` - the same call in a subprocess with another thread count;

and the bit comparisons the tests share: ``bits`` (a float tensor's integer view),
``bits_equal``, ``assert_bitwise_equal`` and ``same_outputs`` (two engines' RequestOutputs:
tokens, logprob bits, finish reasons).

Cases come from hypothesis with a fixed, recorded seed (no shrinking, so a control that is
expected to fail stops at its first failing case). A failure raises ``BitMismatch`` naming
the first mismatching element, both values as hex bits, and the case.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import torch
from hypothesis import HealthCheck, Phase, given, seed as hseed, settings, strategies as st

import bitmatch.kernels as K

# the controls' stock attention (torch SDPA per sequence): the op table's, kernels/stock.py
from bitmatch.kernels.stock import sdpa_paged as stock_sdpa_paged, sdpa_prefill as stock_sdpa_prefill


class BitMismatch(AssertionError):
    pass


def _hex(x: torch.Tensor) -> str:
    if x.dtype == torch.bfloat16:
        return f"0x{int(x.view(torch.int16)) & 0xFFFF:04x}"
    if x.dtype == torch.float32:
        return f"0x{int(x.view(torch.int32)) & 0xFFFFFFFF:08x}"
    if x.dtype == torch.float64:
        return float(x).hex()
    return str(x.item())


_INT_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The integer view of a float tensor's bits (contiguous, detached); other dtypes as they are."""
    t = t.detach().contiguous()
    return t.view(_INT_OF[t.element_size()]) if t.is_floating_point() else t


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaNs with equal bits match)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def _output_bits(o):
    c = o.outputs[0]
    return (o.prompt_token_ids, c.token_ids, bits(torch.tensor(c.logprobs, dtype=torch.float32)).tolist(),
            c.finish_reason)


def same_outputs(a, b) -> bool:
    """Two lists of RequestOutput with the same prompts, tokens, fp32 logprob bits and finish reasons."""
    return len(a) == len(b) and all(_output_bits(x) == _output_bits(y) for x, y in zip(a, b))


def assert_bitwise_equal(got: torch.Tensor, want: torch.Tensor, case: str = "") -> None:
    """Raise BitMismatch at the first element whose bits differ (NaNs with equal bits match)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise BitMismatch(f"{case}: shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}")
    g, w = got.detach().cpu().contiguous(), want.detach().cpu().contiguous()
    diff = bits(g) != bits(w)
    if bool(diff.any()):
        idx = tuple(int(i) for i in diff.nonzero()[0])
        raise BitMismatch(f"{case}: {int(diff.sum())} of {diff.numel()} elements differ; first at "
                          f"{idx}: got {g[idx].item()!r} ({_hex(g[idx])}) want {w[idx].item()!r} ({_hex(w[idx])})")


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _run_cases(strategy, check, cases: int, seed: int):
    @hseed(seed)
    @settings(max_examples=cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(strategy)
    def run(case):
        check(case)
    run()


def assert_batch_invariant(fn, rows, *, max_batch: int = 512, cases: int = 20, seed: int = 0,
                           neighbours=None) -> None:
    """Each row of ``rows`` (a tensor or tuple of tensors sharing dim 0) computed alone by
    ``fn`` must have the same bits as inside random batches of 1..max_batch rows.

    ``neighbours(n, generator)`` returns n random rows in the same format (default: rows
    drawn from ``rows`` itself, scaled and shuffled). Zero rows stand in for padding.
    """
    rows = _as_tuple(rows)
    n_rows = rows[0].shape[0]
    alone = [_as_tuple(fn(*(r[i:i + 1] for r in rows))) for i in range(n_rows)]

    def default_neighbours(n, g):
        idx = torch.randint(0, n_rows, (n,), generator=g).to(rows[0].device)
        scale = (torch.rand(n, generator=g) * 4 + 0.25).to(rows[0].device)
        return tuple(r[idx] * scale.view(-1, *([1] * (r.dim() - 1))).to(r.dtype)
                     if r.is_floating_point() else r[idx] for r in rows)
    make = neighbours or default_neighbours

    strategy = st.fixed_dictionaries({
        "row": st.integers(0, n_rows - 1), "size": st.integers(1, max_batch),
        "pos": st.floats(0, 1), "pad": st.sampled_from(["none", "left", "right"]),
        "npad": st.integers(0, 16), "seed": st.integers(0, 2**31 - 1)})

    def check(c):
        g = torch.Generator().manual_seed(c["seed"])
        size = c["size"]
        others = make(size - 1, g) if size > 1 else tuple(r[:0] for r in rows)
        pos = min(int(c["pos"] * size), size - 1)
        parts = [tuple(torch.cat([o[:pos], r[c["row"]:c["row"] + 1], o[pos:]]) for o, r in zip(others, rows))]
        if c["pad"] != "none" and c["npad"]:
            pad = tuple(torch.zeros(c["npad"], *r.shape[1:], dtype=r.dtype, device=r.device) for r in rows)
            parts = [pad, parts[0]] if c["pad"] == "left" else [parts[0], pad]
            if c["pad"] == "left":
                pos += c["npad"]
        batch = tuple(torch.cat(ts) for ts in zip(*parts))
        got = _as_tuple(fn(*batch))
        for k, (o, w) in enumerate(zip(got, alone[c["row"]])):
            assert_bitwise_equal(o[pos:pos + 1], w, f"batch case {c} output {k}")

    # first, the deterministic slice-vs-batch case (batch_invariant_ops' model test): every row alone
    # vs all rows in one batch. Hypothesis's first examples in a fresh process can all be batches of
    # one row, which no stock kernel fails: this case makes a control fail whatever ran before it
    whole = _as_tuple(fn(*rows))
    for i in range(n_rows):
        for k, (o, w) in enumerate(zip(whole, alone[i])):
            assert_bitwise_equal(o[i:i + 1], w, f"row {i} of the whole {n_rows}-row batch, output {k}")
    _run_cases(strategy, check, cases, seed)


def _bitmatch_prefill(q, k, v, cu, scale, window=None):
    return K.attention_prefill(q, k, v, cu, scale, True, window)


def _bitmatch_paged(q, kc, vc, bt, qsl, lens, scale, window=None):
    return K.attention_paged(q, kc, vc, bt, qsl, lens, scale, window)


def _paged_layout(seqs_kv, block_size, g):
    """Scatter each sequence's k/v into a shared paged cache with a shuffled block table."""
    k0 = seqs_kv[0][0]
    need = [(k.shape[0] + block_size - 1) // block_size for k, _ in seqs_kv]
    total = sum(need) + 3
    perm = torch.randperm(total, generator=g).to(torch.int32)
    kc = torch.full((total, block_size, *k0.shape[1:]), float("nan"), dtype=k0.dtype, device=k0.device)
    vc = kc.clone()
    table = torch.zeros(len(seqs_kv), max(need), dtype=torch.int32, device=k0.device)
    at = 0
    for b, (k, v) in enumerate(seqs_kv):
        table[b, :need[b]] = perm[at:at + need[b]].to(table.device)
        at += need[b]
        pos = torch.arange(k.shape[0], device=k.device)
        slots = table[b, pos // block_size].long() * block_size + pos % block_size
        kc.view(-1, *k.shape[1:])[slots] = k
        vc.view(-1, *v.shape[1:])[slots] = v
    return kc, vc, table


def assert_schedule_invariant(seqs, scale: float, *, sliding_window=None, prefill_fn=None,
                              paged_fn=None, cases: int = 8, seed: int = 0,
                              block_sizes=(8, 16, 32, 64)) -> None:
    """Attention rows must not depend on the schedule.

    ``seqs``: list of (q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D]). The reference is each
    sequence's own full prefill; a case runs all sequences together either as one packed
    prefill, as random chunk splits against a paged cache, or token by token (decode), with
    a random block size and a shuffled block table. Stale cache slots hold NaN.
    """
    prefill = prefill_fn or _bitmatch_prefill
    paged = paged_fn or _bitmatch_paged
    dev = seqs[0][0].device
    ref = [prefill(q, k, v, torch.tensor([0, q.shape[0]], dtype=torch.int32, device=dev), scale, sliding_window)
           for q, k, v in seqs]
    strategy = st.fixed_dictionaries({
        "mode": st.sampled_from(["packed", "chunked", "decode"]),
        "block_size": st.sampled_from(list(block_sizes)),
        "order": st.permutations(list(range(len(seqs)))), "seed": st.integers(0, 2**31 - 1)})

    def check(c):
        g = torch.Generator().manual_seed(c["seed"])
        order = c["order"]
        chosen = [seqs[i] for i in order]
        if c["mode"] == "packed":
            lens = [q.shape[0] for q, _, _ in chosen]
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
            out = prefill(*(torch.cat([s[j] for s in chosen]) for j in range(3)), cu, scale, sliding_window)
            for i, (b, n) in enumerate(zip(order, lens)):
                assert_bitwise_equal(out[int(cu[i]):int(cu[i]) + n], ref[b], f"schedule case {c} seq {b}")
            return
        kc, vc, table = _paged_layout([(k, v) for _, k, v in chosen], c["block_size"], g)
        # cut every sequence into chunks (decode: chunks of 1) and run step by step, all
        # sequences that still have work sharing each step
        cuts = []
        for q, _, _ in chosen:
            n = q.shape[0]
            if c["mode"] == "decode":
                pts = list(range(1, n + 1))
            else:
                k_ = int(torch.randint(0, min(4, n), (1,), generator=g))
                pts = sorted(set(torch.randint(1, n + 1, (k_,), generator=g).tolist()) | {n})
            cuts.append(pts)
        outs = [[] for _ in chosen]
        done = [0] * len(chosen)
        step = 0
        while any(step < len(p) for p in cuts):
            qs, qsl, lens, rows, who = [], [0], [], [], []
            for i, (q, _, _) in enumerate(chosen):
                if step < len(cuts[i]):
                    end = cuts[i][step]
                    qs.append(q[done[i]:end])
                    qsl.append(qsl[-1] + end - done[i])
                    lens.append(end)
                    rows.append(table[i])
                    who.append((i, done[i], end))
                    done[i] = end
            out = paged(torch.cat(qs), kc, vc, torch.stack(rows), torch.tensor(qsl, dtype=torch.int32, device=dev),
                        torch.tensor(lens, dtype=torch.int32, device=dev), scale, sliding_window)
            for (i, s, e), a, b in zip(who, qsl[:-1], qsl[1:]):
                outs[i].append(out[a:b])
            step += 1
        for i, b in enumerate(order):
            assert_bitwise_equal(torch.cat(outs[i]), ref[b], f"schedule case {c} seq {b}")

    _run_cases(strategy, check, cases, seed)


def assert_thread_invariant(fn, args, threads=(1, 2)) -> None:
    """``fn(*args)`` run in subprocesses with each ``torch.set_num_threads`` value must give
    the same bits as in this process. ``fn`` must be importable (module-level)."""
    want = _as_tuple(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "case.pt")
        torch.save({"module": fn.__module__, "name": fn.__qualname__, "args": args}, path)
        for n in threads:
            outp = os.path.join(d, f"out{n}.pt")
            code = ("import sys, torch, importlib; torch.set_num_threads(int(sys.argv[3]));"
                    "c = torch.load(sys.argv[1], weights_only=False);"
                    "f = getattr(importlib.import_module(c['module']), c['name']);"
                    "torch.save(f(*c['args']), sys.argv[2])")
            # the parent's sys.path, so fn's module (e.g. a test file pytest put on the path) imports
            env = dict(os.environ, OMP_NUM_THREADS=str(n), MKL_NUM_THREADS=str(n),
                       PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
            res = subprocess.run([sys.executable, "-c", code, path, outp, str(n)], env=env,
                                 capture_output=True, text=True, timeout=600)
            if res.returncode:
                raise RuntimeError(f"thread-invariance subprocess failed: {res.stderr[-2000:]}")
            got = _as_tuple(torch.load(outp, weights_only=False))
            for k, (o, w) in enumerate(zip(got, want)):
                assert_bitwise_equal(o, w, f"threads={n} output {k} of {fn.__module__}.{fn.__qualname__}")


__all__ = ["BitMismatch", "assert_bitwise_equal", "assert_batch_invariant",
           "assert_schedule_invariant", "assert_thread_invariant", "stock_sdpa_prefill", "stock_sdpa_paged"]

"""``bitmatch check --family NAME``: the invariance harness on every kernel op a family calls, at
the family's own (tiny-config) shapes, with controls at the same shapes that must find mismatches.
The op list is not declared per family: it is captured by running the family once (a trainer
forward and an engine step, every op wrapped by ``kernels.override``), so a new family is covered
the day it registers. Which ops get the batch harness alone is declared once, by the ``rows`` axis
of the op table (``kernels/table.py``); the others are covered by the model row along the schedule
axes. The controls are the device's stock controls (``bitmatch.diagnostics.controls``, the same rows as the
plain check) and the family's own HF forward, batch vs alone."""
from __future__ import annotations

import torch

import bitmatch
import bitmatch.kernels as K
from bitmatch.diagnostics import verify
from bitmatch.diagnostics.controls import stock_controls
from bitmatch.kernels.table import OPS
from bitmatch.models import compute_logits, families, forward_hidden, pack
from bitmatch.parallel import allreduce_row_parallel_linear, enable_tensor_parallel
from bitmatch.testing import BitMismatch, assert_batch_invariant, assert_bitwise_equal, assert_schedule_invariant
from bitmatch.testing.models import pad_batch, random_prompts


def tiny_model_for(family: str, dtype=None, seed: int = 0):
    """(tiny random-weight model, what it is) of ``family``: a registered family (its name or a model
    type: its default tiny shape) or one of the families' named tiny shapes, built by the family's
    ``Family.tiny_model``. ValueError naming the registered families otherwise."""
    dtype = dtype or torch.bfloat16
    fams = families()
    fam = next((f for f in fams if family in f.tiny_configs), None)
    if fam is not None:
        return fam.tiny_model(family, dtype=dtype, seed=seed), f"tiny {family}"
    fam = next((f for f in fams if f.name == family or family in f.model_types), None)
    if fam is None:
        raise ValueError(f"unknown family {family!r}; registered: {', '.join(f.name for f in fams)} "
                         f"(or a tiny config: {', '.join(n for f in fams for n in f.tiny_configs)})")
    try:
        model = fam.tiny_model(dtype=dtype, seed=seed)
    except NotImplementedError:
        raise ValueError(f"family {fam.name!r} has no tiny model: declare {type(fam).__name__}.tiny_config "
                         "(see bitmatch/models/registry.py), or pass a checkpoint") from None
    if fam.tiny_configs:
        return model, f"tiny {fam.tiny_name(None)}"
    return model, f"tiny {fam.name} ({type(fam).__name__}.tiny_model)"


def _capture_kernel_calls(model, seqs):
    """Every bitmatch.kernels call one trainer forward (packed prefill + token_logprobs) and one
    engine-style forward (paged, chunked) make, as (op, args, kwargs): the op list of the family,
    at its shapes, derived by running it (no per-family table). Each op of the op table is wrapped
    by a recorder through ``kernels.override``."""
    calls = []

    def recorder(name, fn):
        def record(*a, **k):
            calls.append((name, a, k))
            return fn(*a, **k)
        return record
    with K.override({n: recorder(n, getattr(K, n)) for n in OPS}):
        dev = next(model.parameters()).device
        ids, mask = (t.to(dev) for t in pad_batch(seqs, "right"))
        p = pack(ids, mask)
        with torch.no_grad():
            logits = compute_logits(model, forward_hidden(model, p.input_ids, p.context()))
            src = (~p.seq_end).nonzero(as_tuple=True)[0]
            K.token_logprobs(logits[src], p.input_ids[src + 1], 0.7)
            verify.paged_trace(model, seqs, verify.schedule_steps([len(s) for s in seqs], "chunked"))
    return calls


def _signature(op, args, kwargs):
    sig = lambda a: (tuple(a.shape[1:]), str(a.dtype)) if isinstance(a, torch.Tensor) else repr(a)  # noqa: E731
    return (op, tuple(sig(a) for a in args), tuple((k, sig(v)) for k, v in sorted(kwargs.items())))


def _row_harness(op, args, kwargs, n):
    """assert_batch_invariant on the op's row arguments (tensors whose dim 0 is the first tensor's),
    the rest held fixed; None when the op table does not declare it row-wise (the ``rows`` axis) or
    an int tensor is not rows."""
    if not OPS[op].row_wise:
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
    return lambda: assert_batch_invariant(call, tuple(v for _, v in rows), max_batch=64, cases=n) or n


def family_cases(family: str, device: str, n: int = 6, tp=None):
    """(op, axes, fn, is_control) rows for every kernel op ``family`` calls at its tiny shapes, the
    whole model along the schedule axes, the device's stock controls and the family's HF forward.

    ``tp`` (a ``TPGroup``, on one of its ranks): the model runs tensor-parallel on this rank's share
    (``enable_tensor_parallel``), so the ops are the share's; a row holds the sharded model's
    ``token_logprobs`` to TP 1's bits, and the stock all-reduce row-parallel linear is the layout's
    control (HF's forward, which is not sharded, is not)."""
    model = bitmatch.patch(tiny_model_for(family, torch.bfloat16, seed=0)[0].to(device), compute_dtype=torch.bfloat16)
    # 53 tokens: a prime row count no weight dimension shares, so "rows" are tokens
    seqs = [s[:n_] for s, n_ in zip(random_prompts(3, 23, 23, seed=5), (11, 19, 23))]
    if tp is not None:
        tp1 = _logprobs(model, seqs)   # TP 1's bits, before this rank takes its share
        enable_tensor_parallel(model, tp)
    calls = _capture_kernel_calls(model, seqs)
    groups: dict = {}
    for op, a, k in calls:
        groups.setdefault(_signature(op, a, k), (op, a, k))
    out, seen_seq = [], set()
    for op, a, k in groups.values():
        shapes = [tuple(t.shape) for t in list(a) + list(k.values()) if isinstance(t, torch.Tensor)][:2]
        label = f"{op} " + "x".join(str(list(sh)).replace(" ", "") for sh in shapes)
        if op == "attention_prefill":
            q, kk, v, cu, scale = a[:5]
            win = a[6] if len(a) > 6 else k.get("sliding_window")
            cu_ = cu.tolist()
            sq = [(q[s:e], kk[s:e], v[s:e]) for s, e in zip(cu_[:-1], cu_[1:])]
            axes = f"schedule (prefill/chunked/decode), block size, batch{', window ' + str(win) if win else ''}"
            out.append((label, axes,
                        lambda sq=sq, scale=scale, win=win: assert_schedule_invariant(
                            sq, scale, sliding_window=win, cases=n) or n, False))
        elif op in ("attention_paged", "write_kv_cache", "attention_decode"):
            continue  # the attention_prefill rows run these against paged caches
        else:
            h = _row_harness(op, a, k, n)
            if h is None and op not in seen_seq:
                seen_seq.add(op)
                out.append((f"{op} (every shape)", f"{', '.join(OPS[op].axes)}: covered by the model row",
                            lambda: 0, False))
            elif h is None:
                continue
            else:
                out.append((label, "batch, padding", h, False))
    out.append((f"model ({family})", "schedule: decode, chunk splits, batch composition",
                lambda: _raise_if_diverged(verify.locate_pair("schedule", model, [s[:7] for s in seqs])), False))
    if tp is not None:
        out.append((f"model ({family}), TP {tp.world} vs TP 1", "parallel layout: token_logprobs",
                    lambda: assert_bitwise_equal(_logprobs(model, seqs), tp1, f"TP {tp.world} vs TP 1") or 1, False))
    out += [(c.name, c.axes, c.run, True) for c in stock_controls(device)]
    if tp is None:
        out.append(("control: HF forward", "batch", lambda: _hf_batch_control(model, seqs), True))
    else:
        out.append(("control: all-reduce row-parallel", "parallel layout", lambda: _allreduce_control(tp), True))
    return out


def _logprobs(model, seqs):
    ids, mask = (t.to(next(model.parameters()).device) for t in pad_batch(seqs, "right"))
    with torch.no_grad():
        return bitmatch.token_logprobs(model, ids, mask, temperature=0.7)


def _allreduce_control(tp) -> int:
    """The stock row-parallel linear (each rank's K-slice partial in bf16, summed by all-reduce) vs
    the same layer at TP 1 (must differ: the reason the layout gathers instead)."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(9, 256, generator=g).bfloat16(), (torch.randn(128, 256, generator=g) / 16).bfloat16()
    kk = 256 // tp.world
    mine = slice(tp.rank * kk, (tp.rank + 1) * kk)
    with torch.no_grad():
        assert_bitwise_equal(allreduce_row_parallel_linear(x[:, mine], w[:, mine], None, tp), K.linear(x, w),
                             f"all-reduce row-parallel linear at TP {tp.world} vs TP 1")
    return 1


def _raise_if_diverged(results) -> int:
    bad = [r for r in results if not r.bitmatched]
    if bad:
        raise BitMismatch("; ".join(r.summary() for r in bad))
    return len(results)


def _hf_batch_control(model, seqs) -> int:
    """HF's own fp32 forward: each sequence alone vs all in one right-padded batch (must differ)."""
    hf = verify.fp32_reference(model)
    dev = next(hf.parameters()).device
    ids, mask = (t.to(dev) for t in pad_batch(seqs, "right"))
    with torch.no_grad():
        batch = hf(input_ids=ids, attention_mask=mask).logits
        for i, s in enumerate(seqs):
            alone = hf(input_ids=torch.tensor([s], device=dev)).logits[0]
            assert_bitwise_equal(batch[i, :len(s)], alone, f"HF forward, sequence {i} alone vs in the batch")
    return len(seqs)

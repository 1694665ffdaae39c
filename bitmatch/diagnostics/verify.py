"""Proof and diagnosis: compare rollout vs trainer logprobs; locate the first op whose bits differ
(``locate`` for two models, ``locate_pair`` for the porting pairs: engine, hf, schedule, backend)."""
from __future__ import annotations

import struct
from dataclasses import asdict, dataclass, field

import torch

import bitmatch
from bitmatch.diagnostics.faults import (
    engine_temperature_fault,
    kernel_fault,
    parse_inject,
    perturb_weight,
    reciprocal_temperature_logprobs,
)
from bitmatch.diagnostics.tracing import (
    PAIRS,
    LocateResult,
    Recorder,
    diff_traces,
    merge_pieces,
    merge_traces,
    model_device,
    op_fingerprint,
    packed_trace,
    paged_trace,
    schedule_steps,
    trace_dtype,
)
from bitmatch.engine import Engine, SamplingParams
from bitmatch.kernels import use_backend
from bitmatch.models import unwrap_causal_lm
from bitmatch.testing.models import pad_batch

__all__ = ["compare", "CompareResult", "locate", "locate_pair", "LocateResult", "op_fingerprint", "float_hex",
           "format_table", "parse_inject", "perturb_weight", "kernel_fault", "schedule_steps", "PAIRS"]


def float_hex(x: float) -> str:
    """fp32 bit pattern as hex, e.g. '0xbf800000' for -1.0."""
    return "0x%08x" % struct.unpack("<I", struct.pack("<f", float(x)))[0]


@dataclass
class CompareResult:
    mismatches: int
    total: int
    max_abs_diff: float
    mean_abs_diff: float
    k3_kl: float                      # mean of exp(d) - 1 - d, d = trainer - rollout; inf where d is not finite
    first_divergence: tuple | None    # (sequence, token) or None
    first_rollout_value: float | None = None
    first_trainer_value: float | None = None
    first_rollout_hex: str | None = None
    first_trainer_hex: str | None = None
    abs_diffs: list = field(default_factory=list, repr=False)   # per compared token, in order

    @property
    def bitmatched(self) -> bool:
        """At least one token compared, and every compared token equal: zero tokens prove nothing."""
        return self.total > 0 and self.mismatches == 0

    @property
    def reason(self) -> str | None:
        """Why ``bitmatched`` is False (None when it is True)."""
        if self.total == 0:
            return ("tokens compared 0: the inputs are empty or the mask selects none, so nothing proves the "
                    "logprobs equal")
        return None if self.mismatches == 0 else f"{self.mismatches} of {self.total} tokens differ"

    def summary(self, a: str = "rollout", b: str = "trainer") -> str:
        """One line: counts, differences, KL and the first divergence, the two sides named a and b."""
        if self.total == 0:
            return self.reason
        s = (f"tokens compared {self.total}, mismatches {self.mismatches}, max |diff| {self.max_abs_diff:.3g}, "
             f"mean |diff| {self.mean_abs_diff:.3g}, k3 KL {self.k3_kl:.3g}")
        if self.first_divergence is not None:
            s += (f"; first divergence at (seq {self.first_divergence[0]}, token {self.first_divergence[1]}): "
                  f"{a} {self.first_rollout_value!r} ({self.first_rollout_hex}) vs {b} "
                  f"{self.first_trainer_value!r} ({self.first_trainer_hex})")
        return s

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("abs_diffs")
        d["bitmatched"] = self.bitmatched
        d["reason"] = self.reason
        return d


def value_hex(x: float) -> str:
    """The bit pattern of ``x``: fp32 hex (``float_hex``) when ``x`` is an fp32 value, else float64's."""
    if x != x or float(torch.tensor(x, dtype=torch.float32)) == x:
        return float_hex(x)
    return "0x%016x" % struct.unpack("<Q", struct.pack("<d", float(x)))[0]


def _rows(x, name):
    # widened to float64, exact for every float dtype: values are compared as they were given,
    # never rounded (two float64 logprobs 1e-12 apart are two different values)
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu")
        if x.dim() == 1:
            x = x[None]
        if x.dim() != 2:
            raise ValueError(f"compare: {name} must be 1-D or 2-D, got shape {tuple(x.shape)}")
        return [r for r in x.to(torch.float64)]
    if not isinstance(x, (list, tuple)):
        raise ValueError(f"compare: {name} must be a tensor or a list of lists")
    if len(x) and not isinstance(x[0], (list, tuple, torch.Tensor)):
        x = [x]
    return [(r.detach().cpu() if isinstance(r, torch.Tensor) else torch.as_tensor(r, dtype=torch.float64))
            .to(torch.float64).reshape(-1) for r in x]


def compare(rollout_logprobs, trainer_logprobs, mask=None) -> CompareResult:
    """Exact comparison of per-token logprobs (their bits, never rounded).

    Accepts tensors [B, T] (or [T]) or lists of per-sequence lists (ragged allowed; then the
    sequences must have equal lengths pairwise). ``mask`` (same shape, nonzero = compare)
    selects tokens; default: all. Values are widened to float64 (exact for fp32, bf16, fp16 and
    Python floats) and compared as bit patterns, so float64 inputs are compared in float64, and a
    NaN on either side is a mismatch (even against a NaN of the same bits: a NaN logprob is a
    failed computation, never a match); its |diff| and KL count as inf, as do those of -inf
    against a finite value. Comparing no token (empty inputs, a mask that selects none) gives
    ``bitmatched=False`` with its ``reason``: zero compared tokens prove nothing.
    """
    ra, tr = _rows(rollout_logprobs, "rollout_logprobs"), _rows(trainer_logprobs, "trainer_logprobs")
    if len(ra) != len(tr):
        raise ValueError(f"compare: {len(ra)} rollout sequences vs {len(tr)} trainer sequences")
    ms = None if mask is None else _rows(mask, "mask")
    if ms is not None and len(ms) != len(ra):
        raise ValueError("compare: mask must have one row per sequence")
    total = mism = 0
    max_d = 0.0
    sum_d = 0.0
    sum_k3 = 0.0
    first = None
    fr = ft = None
    diffs: list[float] = []
    for s, (a, b) in enumerate(zip(ra, tr)):
        if a.shape != b.shape:
            raise ValueError(f"compare: sequence {s} has {a.numel()} rollout vs {b.numel()} trainer logprobs")
        sel = torch.ones_like(a, dtype=torch.bool) if ms is None else (ms[s].reshape(-1) != 0)
        if sel.shape != a.shape:
            raise ValueError(f"compare: mask row {s} has the wrong length")
        idx = sel.nonzero(as_tuple=True)[0]
        if idx.numel() == 0:
            continue
        av, bv = a[idx], b[idx]
        nan = torch.isnan(av) | torch.isnan(bv)
        neq = (av.view(torch.int64) != bv.view(torch.int64)) | nan
        d = torch.where(nan, float("inf"), bv - av)
        ad = d.abs()
        total += idx.numel()
        mism += int(neq.sum())
        if neq.any():
            ad_f = torch.where(neq, ad, torch.zeros_like(ad))
            max_d = max(max_d, float(torch.nan_to_num(ad_f, nan=float("inf"), posinf=float("inf")).max()))
            if first is None:
                j = int(neq.nonzero()[0])
                first = (s, int(idx[j]))
                fr, ft = float(av[j]), float(bv[j])
        dd = torch.where(neq, d, torch.zeros_like(d))
        sum_d += float(dd.abs().sum())
        # -inf against a finite logprob: d is infinite and expm1(d) - d is inf - inf; the KL is inf
        sum_k3 += float(torch.where(dd.isfinite(), torch.expm1(dd) - dd, float("inf")).sum())
        diffs.extend(torch.where(neq, ad, torch.zeros_like(ad)).tolist())
    n = max(total, 1)
    return CompareResult(
        mismatches=mism, total=total, max_abs_diff=max_d, mean_abs_diff=sum_d / n, k3_kl=sum_k3 / n,
        first_divergence=first, first_rollout_value=fr, first_trainer_value=ft,
        first_rollout_hex=None if fr is None else value_hex(fr),
        first_trainer_hex=None if ft is None else value_hex(ft), abs_diffs=diffs,
    )


# ----------------------------------------------------------------------------- the paths of each pair

def _hf_candidates(hf, seqs, names, temperature) -> dict:
    """HF's own forward, one sequence at a time, hooked at the modules named like bitmatch's ops:
    each op's candidates are that module's output and the input of the next op's module (the
    attention output is o_proj's input, silu(g) * u is down_proj's input)."""
    lm = unwrap_causal_lm(hf)
    mods = dict(lm.named_modules())

    def mod(n):
        return next((m for p in (f"model.{n}", n) if (m := mods.get(p)) is not None), None)
    want = {}
    for i, n in enumerate(names):
        if (m := mod(n)) is not None:
            want.setdefault(id(m), (m, []))[1].append((n, "output", n))
        # the next op's input is this op's output, unless the next op contains this one (a mixer
        # after its attention): a container's input is its first op's input, so never a candidate
        nxt = names[i + 1] if i + 1 < len(names) else None
        if nxt is not None and not n.startswith(nxt + ".") and (m := mod(nxt)) is not None:
            want.setdefault(id(m), (m, []))[1].append((n, "input", nxt))
    got: dict = {}
    cur: dict = {}

    def hook(uses):
        def fn(module, args, output):
            for n, kind, mname in uses:
                t = args[0] if kind == "input" and args else output
                t = t[0] if isinstance(t, (tuple, list)) else t
                if isinstance(t, torch.Tensor) and t.numel() % cur["L"] == 0:
                    got.setdefault((n, f"HF {mname} {kind}"), []).append(
                        (cur["keys"], (t.detach().reshape(cur["L"], -1).to("cpu", copy=True),)))
        return fn
    handles = [m.register_forward_hook(hook(uses)) for m, uses in want.values()]
    try:
        with torch.no_grad():
            for s, seq in enumerate(seqs):
                cur.update(L=len(seq), keys=[(s, p) for p in range(len(seq))])
                logits = lm(input_ids=torch.tensor([seq], device=model_device(lm))).logits[0].float()
                if len(seq) > 1:
                    lp = torch.log_softmax(logits[:-1] / temperature, -1).gather(
                        1, torch.tensor(seq[1:], device=logits.device)[:, None])
                    got.setdefault(("logprobs", "HF log_softmax(logits / T)"), []).append(
                        (cur["keys"][:-1], (lp.cpu(),)))
    finally:
        for h in handles:
            h.remove()
    out: dict = {}
    for (n, ref), pieces in got.items():
        (_, keys, vals), = merge_pieces([[(n, k, v) for k, v in pieces]])
        out.setdefault(n, []).append((ref, keys, vals))
    return out


def _seq_lists(input_ids, attention_mask=None) -> list:
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids if input_ids.dim() == 2 else input_ids[None]
        m = torch.ones_like(ids) if attention_mask is None else attention_mask.to(ids.device)
        return [row[mr != 0].tolist() for row, mr in zip(ids, m)]
    seqs = [list(s) for s in input_ids]
    return [seqs] if seqs and not isinstance(seqs[0], list) else seqs


def _module(m):
    if not isinstance(m, torch.nn.Module) and isinstance(getattr(m, "model", None), torch.nn.Module):
        return m.model   # a bitmatch.Engine
    return m


def locate(model_a, model_b, input_ids, attention_mask=None, *, compute_dtype_a=None,
           compute_dtype_b=None, paged_b_block_size: int | None = None) -> LocateResult:
    """Run the same tokens through two models (e.g. the trainer's and the engine's model object)
    on bitmatch's forward, hash every op's output, and name the first op whose bits differ.

    ``input_ids``: [B, L] tensor (with ``attention_mask``) or a list of token-id lists.
    ``model_b`` may also be a ``bitmatch.Engine`` (its ``.model`` is used).
    ``paged_b_block_size``: run model_b as the engine does (one step against a paged cache of
    that block size) instead of packed prefill. Guarantee: equal bits on every op <=> None.
    """
    model_a, model_b = _module(model_a), _module(model_b)
    seqs = _seq_lists(input_ids, attention_mask)
    ta = packed_trace(model_a, seqs, compute_dtype_a)
    tb = packed_trace(model_b, seqs, compute_dtype_b) if paged_b_block_size is None else \
        paged_trace(model_b, seqs, schedule_steps([len(s) for s in seqs], "prefill"),
                     block_size=paged_b_block_size, dtype=compute_dtype_b)
    return diff_traces(ta, tb, comparison="model a vs model b (packed prefill)" if paged_b_block_size is None
                 else f"model a (packed prefill) vs model b (paged, block {paged_b_block_size})")


def _engine_pair(model, prompts, temperature, max_tokens, fault, meta, engine_kw):
    kind, arg = fault or (None, None)
    b = perturb_weight(model, arg) if kind == "weight" else model
    kw = dict(max_num_seqs=len(prompts), max_num_batched_tokens=7, block_size=16)
    if kind == "kernel":   # a stock kernel need not be capturable (host syncs): no CUDA graphs, said below
        kw["enforce_eager"] = True
    kw.update(engine_kw or {})
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    rec = Recorder()
    with Engine(b, **kw) as eng, eng.record(rec), kernel_fault(arg if kind == "kernel" else None), \
            engine_temperature_fault(kind == "temperature"):
        outs = eng.generate(prompts, params, use_tqdm=False)
        graphs_off = kind == "kernel" and eng.config.enforce_eager and eng.device.type == "cuda"
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    keys = [(s, len(o.prompt_token_ids) - 1 + j)
            for s, o in enumerate(outs) for j in range(len(o.outputs[0].token_ids))]
    reported = torch.tensor([x for o in outs for x in o.outputs[0].logprobs], dtype=torch.float32)
    tb = rec.trace() + [("logprobs", keys, (reported,))]
    # the trainer: the ops of the packed prefill token_logprobs runs, then token_logprobs itself
    ids, mask = pad_batch(seqs, "right")
    with torch.no_grad():
        lp = bitmatch.token_logprobs(model, ids, mask, temperature=temperature)
    trainer = torch.stack([lp[s, p] for s, p in keys]).float().cpu()
    ta = [e for e in packed_trace(model, seqs, temperature=temperature) if e[0] != "logprobs"]
    ta.append(("logprobs", keys, (trainer,)))
    tb = [e for e in tb if e[0] in {n for n, _, _ in ta}] if len(tb) != len(ta) else tb
    steps = ", ".join(f"{n} {p}" for p, n in sorted(rec.paths.items()))
    res = diff_traces(ta, tb, comparison=f"trainer token_logprobs (packed prefill) vs engine (paged block "
                f"{kw['block_size']}, {kw['max_num_batched_tokens']}-token steps: chunked prefill + decode; "
                f"steps run: {steps}{'; no CUDA graphs while the planted stock kernel runs' if graphs_off else ''})",
                side_a="trainer", side_b="engine", **meta)
    res.logprobs = compare(reported.split([len(o.outputs[0].token_ids) for o in outs]),
                           trainer.split([len(o.outputs[0].token_ids) for o in outs])).to_dict()
    return [res]


def _side_b(model, fault, run):
    """Run ``run(model_b, lp_fn)`` with the fault on side B."""
    kind, arg = fault or (None, None)
    mb = perturb_weight(model, arg) if kind == "weight" else model
    with kernel_fault(arg if kind == "kernel" else None):
        return run(mb, reciprocal_temperature_logprobs if kind == "temperature" else None)


def fp32_reference(model):
    """HF's own model of ``model``'s architecture built in fp32 from its config (unpatched; its
    rotary tables computed in fp32, not cast back from a bf16 copy) with ``model``'s weights."""
    import transformers

    lm = unwrap_causal_lm(model)
    with torch.random.fork_rng():
        ref = transformers.AutoModelForCausalLM.from_config(lm.config, dtype=torch.float32)
    ref.load_state_dict({k: v.detach().float() for k, v in lm.state_dict().items()})
    return ref.to(model_device(lm)).eval()


def locate_pair(pair: str, model, prompts, *, inject: str | None = None, temperature: float = 0.7,
                tolerance: float | None = None, block_size: int = 16, max_tokens: int = 8, seed: int = 0,
                engine_kw: dict | None = None, hf_model=None) -> list:
    """The porting comparisons, each a LocateResult (``pair`` in PAIRS):

    * ``engine``: the embedded engine (paged, chunked prefill, decode; ``engine_kw``) generating
      from ``prompts`` vs the trainer's ``token_logprobs`` over prompt + completion, exact bits;
    * ``hf``: HF's own fp32 forward (``hf_model``, default an unpatched fp32 copy) vs bitmatch's
      fp32 forward, tolerance (default 1e-4 of each op's max |value|): parity, not bits;
    * ``schedule``: packed prefill vs token-by-token decode, two random chunk splits, all sequences
      in one batch vs each alone, exact bits;
    * ``backend``: the CPU reference vs the Triton backend (CUDA, or Triton's interpreter on CPU
      with TRITON_INTERPRET=1), tolerance (default 1e-3 fp32, 3e-2 bf16).

    ``inject`` puts one fault on side B (``parse_inject``) so the report shows where it lands.
    Guarantee: with every op of both paths bit-identical (within tolerance) the result says None.
    """
    import copy

    if pair not in PAIRS:
        raise ValueError(f"locate: pair must be one of {PAIRS}, got {pair!r}")
    fault = parse_inject(inject)
    model = _module(model)
    seqs = _seq_lists(prompts)
    meta = dict(pair=pair, inject=inject)
    if pair == "engine":
        return _engine_pair(model, seqs, temperature, max_tokens, fault, meta, engine_kw)
    lens = [len(s) for s in seqs]
    if pair == "schedule":
        ta = packed_trace(model, seqs, temperature=temperature)

        def paged(mode, sd):
            return lambda m, lp: paged_trace(m, seqs, schedule_steps(lens, mode, sd), block_size=block_size,
                                              temperature=temperature, lp_fn=lp)
        alone = lambda m, lp: merge_traces([packed_trace(m, [s], temperature=temperature, lp_fn=lp,  # noqa: E731
                                                           seq_ids=[i]) for i, s in enumerate(seqs)])
        cases = [("packed prefill vs token-by-token decode", ta, paged("decode", seed)),
                 ("chunk split A vs chunk split B", paged("chunked", seed)(model, None), paged("chunked", seed + 1)),
                 ("all sequences in one batch vs each sequence alone", ta, alone)]
        return [diff_traces(a, _side_b(model, fault, run), comparison=c, side_a=c.split(" vs ")[0],
                      side_b=c.split(" vs ")[1], **meta) for c, a, run in cases]
    if pair == "hf":
        ref = (hf_model if hf_model is not None else fp32_reference(model)).float()
        mine = copy.deepcopy(unwrap_causal_lm(model)).float()
        tb = _side_b(mine, fault, lambda m, lp: packed_trace(m, seqs, torch.float32, temperature, lp))
        cands = _hf_candidates(ref, seqs, [n for n, _, _ in tb], temperature)
        return [diff_traces(cands, tb, 1e-4 if tolerance is None else tolerance, side_a="HF fp32",
                            side_b="bitmatch fp32",
                            comparison="HF reference forward (fp32) vs bitmatch forward (fp32)", **meta)]
    # backend
    import os

    cpu = copy.deepcopy(unwrap_causal_lm(model)).cpu()
    if not torch.cuda.is_available():
        # the interpreter's fp32 -> bf16 cast truncates (1 ulp of bias per rounding point): in fp32 the
        # comparison checks each kernel's structure (tiling, masks, walk order) to a tight tolerance
        cpu = cpu.float()
    dt = torch.float32 if not torch.cuda.is_available() else trace_dtype(cpu, None)
    tol = tolerance if tolerance is not None else (1e-3 if dt == torch.float32 else 3e-2)
    with use_backend("reference"):
        ta = packed_trace(cpu, seqs, dt, temperature=temperature)
    if torch.cuda.is_available():
        dev_model, where = copy.deepcopy(cpu).cuda(), "triton (cuda)"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        dev_model, where = cpu, "triton (interpreter, CPU)"
    else:
        raise RuntimeError("locate --pair backend: no CUDA device; run with TRITON_INTERPRET=1 to compare the "
                           "Triton kernels under Triton's CPU interpreter")
    with use_backend("triton"):
        tb = _side_b(dev_model, fault, lambda m, lp: packed_trace(m, seqs, dt, temperature=temperature, lp_fn=lp))
    return [diff_traces(ta, tb, tol, side_a="reference (cpu)", side_b=where,
                  comparison=f"reference backend (cpu) vs {where}, packed prefill", **meta)]


def format_table(results, max_rows: int = 40) -> str:
    """The report as text: per comparison, the op table (the ops around the first divergence
    when there are more than ``max_rows``) and the verdict line."""
    lines = []
    for r in results:
        tol = f", tolerance {r.tolerance:g}" if r.tolerance is not None else ", exact bits"
        inj = f", injected: {r.inject}" if r.inject else ""
        lines.append(f"== {r.pair}: {r.comparison}{tol}{inj}")
        lines.append(f"  A = {r.side_a}, B = {r.side_b}")
        lines.append(f"  {'op':<40} {'status':<12} {'error':>9}  {'fingerprint A':<25} fingerprint B")
        rows = r.ops
        if len(rows) > max_rows:
            at = next((i for i, o in enumerate(rows) if o["status"] == "DIFFERS"), len(rows) - 3)
            lo = max(0, min(at - max_rows // 2, len(rows) - max_rows))
            keep = set(range(lo, lo + max_rows))
        else:
            keep = set(range(len(rows)))
        skipped = 0
        for i, o in enumerate(rows):
            if i not in keep:
                skipped += 1
                continue
            if skipped:
                lines.append(f"  ... {skipped} ops")
                skipped = 0
            err = "" if o["error"] is None else f"{o['error']:.2e}"
            fa = (o["fingerprint_a"] or "-")[:16]
            lines.append(f"  {o['name']:<40} {o['status']:<12} {err:>9}  {fa:<25} {(o['fingerprint_b'] or '-')[:16]}"
                         + (f"  ({o['ref']})" if o.get("ref") else "") + (f"  [{o['note']}]" if o.get("note") else ""))
        if skipped:
            lines.append(f"  ... {skipped} ops")
        if r.logprobs is not None:
            lp = r.logprobs
            lines.append(f"  reported logprobs: {lp['total']} tokens, {lp['mismatches']} mismatches, "
                         f"max |diff| {lp['max_abs_diff']:.3g}")
        lines.append("  => " + r.verdict())
        lines.append("")
    return "\n".join(lines)

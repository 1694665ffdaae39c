"""Proof and diagnosis: compare rollout vs trainer logprobs; locate the first op whose bits differ
(``locate`` for two models, ``locate_pair`` for the porting pairs: engine, hf, schedule, backend)."""
from __future__ import annotations

import contextlib
import struct
from dataclasses import asdict, dataclass, field

import torch

__all__ = ["compare", "CompareResult", "locate", "locate_pair", "LocateResult", "op_fingerprint", "float_hex",
           "format_table", "parse_inject", "perturb_weight", "kernel_fault", "stock_kernels", "schedule_steps", "PAIRS"]


def float_hex(x: float) -> str:
    """fp32 bit pattern as hex, e.g. '0xbf800000' for -1.0."""
    return "0x%08x" % struct.unpack("<I", struct.pack("<f", float(x)))[0]


@dataclass
class CompareResult:
    mismatches: int
    total: int
    max_abs_diff: float
    mean_abs_diff: float
    k3_kl: float                      # mean of exp(d) - 1 - d, d = trainer - rollout
    first_divergence: tuple | None    # (sequence, token) or None
    first_rollout_value: float | None = None
    first_trainer_value: float | None = None
    first_rollout_hex: str | None = None
    first_trainer_hex: str | None = None
    abs_diffs: list = field(default_factory=list, repr=False)   # per compared token, in order

    @property
    def bitmatched(self) -> bool:
        return self.mismatches == 0

    def summary(self) -> str:
        s = (f"tokens compared {self.total}, mismatches {self.mismatches}, max |diff| {self.max_abs_diff:.3g}, "
             f"mean |diff| {self.mean_abs_diff:.3g}, k3 KL {self.k3_kl:.3g}")
        if self.first_divergence is not None:
            s += (f"; first divergence at (seq {self.first_divergence[0]}, token {self.first_divergence[1]}): "
                  f"rollout {self.first_rollout_value!r} ({self.first_rollout_hex}) vs trainer "
                  f"{self.first_trainer_value!r} ({self.first_trainer_hex})")
        return s

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("abs_diffs")
        d["bitmatched"] = self.bitmatched
        return d


def _rows(x, name):
    if isinstance(x, torch.Tensor):
        x = x.detach().to("cpu")
        if x.dim() == 1:
            x = x[None]
        if x.dim() != 2:
            raise ValueError(f"compare: {name} must be 1-D or 2-D, got shape {tuple(x.shape)}")
        return [r for r in x.to(torch.float32)]
    if not isinstance(x, (list, tuple)):
        raise ValueError(f"compare: {name} must be a tensor or a list of lists")
    if len(x) and not isinstance(x[0], (list, tuple, torch.Tensor)):
        x = [x]
    return [torch.as_tensor(r, dtype=torch.float32).reshape(-1) for r in x]


def compare(rollout_logprobs, trainer_logprobs, mask=None) -> CompareResult:
    """Exact comparison of per-token logprobs (fp32 bits).

    Accepts tensors [B, T] (or [T]) or lists of per-sequence lists (ragged allowed; then the
    sequences must have equal lengths pairwise). ``mask`` (same shape, nonzero = compare)
    selects tokens; default: all. Values are compared as fp32 bit patterns (a NaN equals a
    NaN of the same bits).
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
        neq = av.view(torch.int32) != bv.view(torch.int32)
        d = (bv.double() - av.double())
        ad = d.abs()
        total += idx.numel()
        mism += int(neq.sum())
        if neq.any():
            ad_f = torch.where(neq, ad, torch.zeros_like(ad))
            max_d = max(max_d, float(torch.nan_to_num(ad_f, nan=float("inf")).max()))
            if first is None:
                j = int(neq.nonzero()[0])
                first = (s, int(idx[j]))
                fr, ft = float(av[j]), float(bv[j])
        dd = torch.where(neq, d, torch.zeros_like(d))
        sum_d += float(dd.abs().sum())
        sum_k3 += float((torch.expm1(dd) - dd).sum())
        diffs.extend(torch.where(neq, ad, torch.zeros_like(ad)).tolist())
    n = max(total, 1)
    return CompareResult(
        mismatches=mism, total=total, max_abs_diff=max_d, mean_abs_diff=sum_d / n, k3_kl=sum_k3 / n,
        first_divergence=first, first_rollout_value=fr, first_trainer_value=ft,
        first_rollout_hex=None if fr is None else float_hex(fr),
        first_trainer_hex=None if ft is None else float_hex(ft), abs_diffs=diffs,
    )


# ----------------------------------------------------------------------------- locate
#
# A trace is what one path computed: [(op name, keys, values)] in op order; ``values`` is a tuple
# of CPU tensors whose rows are tokens and ``keys[r]`` = (sequence, position) of row r (None when
# the output is not per token). Two paths are compared row by row on the keys they share, so an
# engine that ran a sequence over five paged steps lines up with the trainer's one packed prefill.

PAIRS = ("engine", "hf", "schedule", "backend")


def op_fingerprint(t) -> str:
    """The fingerprint of an op's output: ``bitmatch.sync``'s hash (xxh3-128 of the exact bytes)
    over the dtype, shape and bytes of a tensor or of each tensor of a tuple."""
    from bitmatch.sync.fingerprint import new_hasher, update_hasher

    h = new_hasher()
    for x in (t if isinstance(t, (tuple, list)) else (t,)):
        x = x.detach()
        h.update(f"{x.dtype}{tuple(x.shape)}".encode())
        update_hasher(h, x.contiguous())
    return h.hexdigest()


_INT_VIEW = {torch.bfloat16: (torch.int16, 4), torch.float16: (torch.int16, 4), torch.float32: (torch.int32, 8),
             torch.float64: (torch.int64, 16)}


def _hex(x: torch.Tensor) -> str:
    """One element's bits in hex (4 digits for bf16, 8 for fp32, 16 for fp64); ints in decimal."""
    if x.dtype in _INT_VIEW:
        it, n = _INT_VIEW[x.dtype]
        return "0x%0*x" % (n, int(x.reshape(1).view(it)[0]) & ((1 << 4 * n) - 1))
    return str(int(x))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(_INT_VIEW[x.dtype][0]) if x.dtype in _INT_VIEW else x


@dataclass
class LocateResult:
    """The first op whose output differs between two paths (``first_divergent`` None: none).

    Exact mode (``tolerance`` None) compares bits; tolerance mode the error
    max|a - b| / max|a| of each op (parity with a reference). ``position`` = (sequence, token
    position), ``element`` = flat index inside that token's output, ``value_*``/``hex_*`` both
    values there. ``ops``: one row per op (name, status, error, fingerprints, ref).
    """
    first_divergent: str | None
    layer: int | None
    op: str | None
    ops_compared: int
    fingerprints_a: list = field(default_factory=list, repr=False)   # [(name, hash)]
    fingerprints_b: list = field(default_factory=list, repr=False)
    pair: str = ""
    comparison: str = ""
    side_a: str = "a"
    side_b: str = "b"
    tolerance: float | None = None
    position: tuple | None = None
    element: int | None = None
    value_a: float | None = None
    value_b: float | None = None
    hex_a: str | None = None
    hex_b: str | None = None
    error: float | None = None
    inject: str | None = None
    ops: list = field(default_factory=list, repr=False)
    logprobs: dict | None = None      # compare() of the reported logprobs (engine pair)

    @property
    def bitmatched(self) -> bool:
        return self.first_divergent is None

    def summary(self) -> str:
        return f"{self.comparison}: {self.verdict()}" if self.comparison else self.verdict()

    def verdict(self) -> str:
        if self.first_divergent is None:
            kind = f"within tolerance {self.tolerance:g}" if self.tolerance is not None else "bit-identical"
            left = len(self.ops) - self.ops_compared
            return f"all {self.ops_compared} op outputs {kind}" + (f" ({left} not compared)" if left else "")
        at = "" if self.position is None else f" at sequence {self.position[0]} position {self.position[1]}"
        el = "" if self.element is None else f" element {self.element}"
        where = f"layer {self.layer}, op {self.op}" if self.layer is not None else f"op {self.op}"
        return (f"first divergent op {self.first_divergent} ({where}){at}{el}: {self.side_a} "
                f"{self.value_a!r} ({self.hex_a}) vs {self.side_b} {self.value_b!r} ({self.hex_b}); "
                f"error {self.error:.3g}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("fingerprints_a")
        d.pop("fingerprints_b")
        d["bitmatched"] = self.bitmatched
        return d


class _Recorder:
    """The ``recorder(name, value)`` of ``forward_hidden``: keeps CPU copies of every op's output
    over one or more steps, with the (sequence, position) of each row set by the caller."""

    def __init__(self):
        self.parts: dict = {}
        self.keys = None

    def __call__(self, name, v):
        vals = tuple(x.detach().to("cpu", copy=True) for x in (v if isinstance(v, (tuple, list)) else (v,)))
        per_token = self.keys is not None and all(x.dim() and x.shape[0] == len(self.keys) for x in vals)
        self.parts.setdefault(name, []).append((list(self.keys) if per_token else None, vals))

    def trace(self) -> list:
        return _merge([[(n, k, v) for k, v in parts] for n, parts in self.parts.items()])


def _merge(per_op) -> list:
    """[(name, keys, values)] from each op's pieces: rows sorted by (sequence, position); a row
    computed twice (a preempted sequence recomputed) keeps its last value."""
    out = []
    for pieces in per_op:
        name = pieces[0][0]
        n = len(pieces[0][2])
        if any(k is None for _, k, _ in pieces):
            out.append((name, None, tuple(torch.cat([p[2][j].reshape(-1) for p in pieces]) for j in range(n))))
            continue
        keys = [k for _, ks, _ in pieces for k in ks]
        vals = tuple(torch.cat([p[2][j] for p in pieces]) for j in range(n))
        last = {k: r for r, k in enumerate(keys)}
        order = sorted(last)
        idx = torch.tensor([last[k] for k in order], dtype=torch.long)
        out.append((name, order, tuple(v[idx] for v in vals)))
    return out


def _merge_traces(traces) -> list:
    names = [n for n, _, _ in traces[0]]
    by = [{n: (n, k, v) for n, k, v in t} for t in traces]
    return _merge([[b[n] for b in by if n in b] for n in names])


def _device(model):
    return next(model.parameters()).device


def _dtype(model, dtype):
    """The compute dtype: given, else the one ``bitmatch.models`` reads (patch state or the
    embedding), else the parameters' (a family whose embedding is not ``embed_tokens``)."""
    if dtype is not None:
        return dtype
    from bitmatch.models import compute_dtype_of
    try:
        return compute_dtype_of(model)
    except AttributeError:
        return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _lp_bitmatch(logits, targets, temperature):
    import bitmatch.kernels as K
    return K.token_logprobs(logits, targets, temperature)


def _lp_reciprocal(logits, targets, temperature):
    """The injected temperature formula: logits * (1/T) (HF/TRL's ``logits / T`` with a float as
    CUDA runs it) instead of the division by T both bitmatch paths use."""
    import bitmatch.kernels as K
    return K.token_logprobs(logits.float() * (1.0 / temperature), targets, 1.0)


def _record_logprobs(rec, logits, seqs: dict, temperature, lp_fn):
    keys = rec.keys
    rows = [r for r, (s, p) in enumerate(keys) if p + 1 < len(seqs[s])]
    if rows:
        tgt = torch.tensor([seqs[keys[r][0]][keys[r][1] + 1] for r in rows], device=logits.device)
        rec.keys = [keys[r] for r in rows]
        rec("logprobs", (lp_fn or _lp_bitmatch)(logits[rows], tgt, temperature))
        rec.keys = keys


def _packed_trace(model, seqs, dtype=None, temperature=1.0, lp_fn=None, seq_ids=None) -> list:
    """The trainer's path: every sequence in one packed prefill (what ``token_logprobs`` runs)."""
    from bitmatch.models import compute_logits, forward_hidden, pack
    from bitmatch.testing_models import pad_batch

    dev, dtype = _device(model), _dtype(model, dtype)
    ids, mask = pad_batch(seqs, "right")
    p = pack(ids.to(dev), mask.to(dev))
    sid = list(seq_ids) if seq_ids is not None else list(range(len(seqs)))
    rec = _Recorder()
    rec.keys = [(sid[r], c) for r, c in zip(p.rows.tolist(), p.cols.tolist())]
    with torch.no_grad():
        h = forward_hidden(model, p.input_ids, p.context(), compute_dtype=dtype, recorder=rec)
        logits = compute_logits(model, h, compute_dtype=dtype)
        rec("lm_head", logits)
        _record_logprobs(rec, logits, dict(zip(sid, seqs)), temperature, lp_fn)
    return rec.trace()


def schedule_steps(lengths, mode: str, seed: int = 0) -> list:
    """Steps [[(sequence, tokens), ...], ...] over sequences of ``lengths``, all sequences sharing
    each step: "prefill" (one step), "decode" (one token per sequence per step), "chunked"
    (each sequence cut at up to 3 random points, seeded)."""
    if mode == "prefill":
        return [[(s, n) for s, n in enumerate(lengths)]]
    g = torch.Generator().manual_seed(seed)
    cuts = []
    for n in lengths:
        if mode == "decode":
            pts = list(range(1, n + 1))
        elif mode == "chunked":
            k = int(torch.randint(1, 4, (1,), generator=g))
            pts = sorted(set(torch.randint(1, n + 1, (k,), generator=g).tolist()) | {n})
        else:
            raise ValueError(f"schedule_steps: mode must be prefill, decode or chunked, got {mode!r}")
        cuts.append([b - a for a, b in zip([0] + pts[:-1], pts)])
    return [[(s, c[i]) for s, c in enumerate(cuts) if i < len(c)] for i in range(max(map(len, cuts)))]


def _paged_trace(model, seqs, steps, *, block_size=16, dtype=None, temperature=1.0, lp_fn=None) -> list:
    """The engine's path: the steps against fresh paged caches (shuffled block table; one
    zero-filled per-sequence state slot per sequence) of the model's cache groups."""
    import dataclasses
    import inspect

    from bitmatch.context import ForwardContext
    from bitmatch.models import allocate_caches, cache_groups, compute_logits, forward_hidden

    dev, dtype = _device(model), _dtype(model, dtype)
    nblk = [-(-len(s) // block_size) for s in seqs]
    perm = torch.randperm(sum(nblk), generator=torch.Generator().manual_seed(0)).tolist()
    tables = [perm[sum(nblk[:i]):sum(nblk[:i + 1])] for i in range(len(seqs))]
    groups = cache_groups(model, compute_dtype=dtype)
    extra = {"num_seqs": len(seqs)} if "num_seqs" in inspect.signature(allocate_caches).parameters else {}
    caches = allocate_caches(groups, max(sum(nblk), 1), block_size, dev, **extra)
    has_slots = "state_slots" in {f.name for f in dataclasses.fields(ForwardContext)}
    done = [0] * len(seqs)
    rec = _Recorder()

    def t(x, dt):
        return torch.tensor(x, dtype=dt, device=dev)
    with torch.no_grad():
        for step in steps:
            toks, pos, slots, qsl, lens, keys = [], [], [], [0], [], []
            for s, n in step:
                a, b = done[s], done[s] + n
                toks += seqs[s][a:b]
                pos += range(a, b)
                slots += [tables[s][q // block_size] * block_size + q % block_size for q in range(a, b)]
                qsl.append(qsl[-1] + n)
                lens.append(b)
                keys += [(s, q) for q in range(a, b)]
                done[s] = b
            width = max(len(tables[s]) for s, _ in step)
            kw = {"state_slots": t([s for s, _ in step], torch.int64)} if has_slots else {}
            ctx = ForwardContext(positions=t(pos, torch.int64), query_start_loc=t(qsl, torch.int32),
                                 seq_lens=t(lens, torch.int32), slot_mapping=t(slots, torch.int64),
                                 block_table=t([tables[s] + [0] * (width - len(tables[s])) for s, _ in step],
                                               torch.int32), caches=caches, **kw)
            rec.keys = keys
            h = forward_hidden(model, t(toks, torch.int64), ctx, compute_dtype=dtype, recorder=rec)
            logits = compute_logits(model, h, compute_dtype=dtype)
            rec("lm_head", logits)
            _record_logprobs(rec, logits, dict(enumerate(seqs)), temperature, lp_fn)
    if done != [len(s) for s in seqs]:
        raise ValueError(f"locate: the schedule ran {done} tokens of sequences of lengths {[len(s) for s in seqs]}")
    return rec.trace()


def _compare_op(ka, va, kb, vb, tol):
    """One op of two traces on their shared rows: a dict (differs, error, fingerprints, and where
    the first / worst element is), or None when the two outputs cannot be lined up."""
    if ka is not None and kb is not None:
        ia = {k: r for r, k in enumerate(ka)}
        common = [(ia[k], j) for j, k in enumerate(kb) if k in ia]
        if not common:
            return None
        ra, rb = (torch.tensor(c, dtype=torch.long) for c in zip(*common))
        keys = [kb[j] for _, j in common]
        va, vb = tuple(v[ra] for v in va), tuple(v[rb] for v in vb)
    elif ka is None and kb is None:
        keys = None
    else:
        return None
    n = min(len(va), len(vb))
    va, vb = va[:n], vb[:n]
    rows = len(keys) if keys is not None else 1
    out = dict(differs=False, error=0.0, fingerprint_a=op_fingerprint(va), fingerprint_b=op_fingerprint(vb))
    for x, y in zip(va, vb):
        if x.numel() != y.numel() or x.numel() % rows:
            if tol is not None or keys is None:   # not per token: nothing to line up
                return None
            out.update(differs=True, error=float("inf"), note=f"shapes {tuple(x.shape)} vs {tuple(y.shape)}")
            return out
        x2, y2 = x.reshape(rows, -1), y.reshape(rows, -1)
        d = (x2.double() - y2.double()).abs().nan_to_num(nan=float("inf"))
        if tol is None:
            bad = (_bits(x2) != _bits(y2)) if x.dtype == y.dtype else torch.ones_like(d, dtype=torch.bool)
            if not bool(bad.any()):
                continue
            r, c = (int(i) for i in bad.nonzero()[0])          # the earliest position
            err = float(d[bad].max())
            if x.dtype != y.dtype:
                out["note"] = f"dtype {x.dtype} vs {y.dtype}"
        else:
            scale = float(x2.double().abs().max()) if x2.numel() else 0.0
            err = float(d.max()) / max(scale, 1e-30) if d.numel() else 0.0
            out["error"] = max(out["error"], err)
            if not err > tol:
                continue
            r, c = divmod(int(d.reshape(-1).argmax()), d.shape[1])  # the worst element
        out.update(differs=True, error=err, position=None if keys is None else tuple(keys[r]), element=c,
                   value_a=x2[r, c].item(), value_b=y2[r, c].item(), hex_a=_hex(x2[r, c]), hex_b=_hex(y2[r, c]))
        return out
    return out


def _diff(ta, tb, tol=None, **meta) -> LocateResult:
    """Walk ``tb``'s ops in order against ``ta`` (a trace, or {name: [(ref, keys, values), ...]}
    candidates, e.g. HF modules' outputs/inputs); the first op that differs is the answer."""
    cands = ta if isinstance(ta, dict) else {n: [("", k, v)] for n, k, v in ta}
    rows, first, fa, fb = [], None, [], []
    for name, kb, vb in tb:
        if name not in cands and not isinstance(ta, dict):
            # a record name that depends on the schedule (or another depth): listed, not compared
            rows.append(dict(name=name, status="only in B", error=None, fingerprint_a=None,
                             fingerprint_b=op_fingerprint(vb), ref=None))
            continue
        best = None
        for ref, ka, va in cands.get(name, ()):
            r = _compare_op(ka, va, kb, vb, tol)
            if r is not None:
                r["ref"] = ref
                if best is None or (best["differs"] and not r["differs"]):
                    best = r
        if best is None:
            rows.append(dict(name=name, status="not compared", error=None, fingerprint_a=None,
                             fingerprint_b=op_fingerprint(vb), ref=None))
            continue
        status = ("DIFFERS" if best["differs"] else ("within tol" if tol is not None else "same"))
        rows.append(dict(name=name, status=status, error=best["error"], fingerprint_a=best["fingerprint_a"],
                         fingerprint_b=best["fingerprint_b"], ref=best["ref"] or None, note=best.get("note")))
        fa.append((name, best["fingerprint_a"]))
        fb.append((name, best["fingerprint_b"]))
        if best["differs"] and first is None:
            first = (name, best)
    if not isinstance(ta, dict):
        names_b = {n for n, _, _ in tb}
        rows += [dict(name=n, status="only in A", error=None, fingerprint_a=op_fingerprint(v),
                      fingerprint_b=None, ref=None) for n, _, v in ta if n not in names_b]
    n = sum(r["status"] in ("same", "within tol", "DIFFERS") for r in rows)
    if first is None:
        return LocateResult(None, None, None, n, fa, fb, tolerance=tol, ops=rows, **meta)
    name, b = first
    parts = name.split(".")
    layer, op = (int(parts[1]), ".".join(parts[2:])) if parts[0] == "layers" and len(parts) > 2 else (None, name)
    return LocateResult(name, layer, op, n, fa, fb, tolerance=tol, position=b.get("position"),
                        element=b.get("element"), value_a=b.get("value_a"), value_b=b.get("value_b"),
                        hex_a=b.get("hex_a"), hex_b=b.get("hex_b"), error=b["error"], ops=rows, **meta)


# ----------------------------------------------------------------------------- faults (demos, tests)

def _stock_rms_norm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _stock_rotary(q, k, cos, sin):
    c, s = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]

    def rot(x):
        h = x.shape[-1] // 2
        return x * c.to(x.dtype) + torch.cat([-x[..., h:], x[..., :h]], -1) * s.to(x.dtype)
    return rot(q), rot(k)


def _stock_moe_route(logits, top_k, *, scoring="softmax", renormalize=False, correction_bias=None, scaling=1.0):
    from bitmatch.kernels.moe import _scores_plain
    p = _scores_plain(logits, scoring)
    _, ids = torch.topk(p if correction_bias is None else p + correction_bias, top_k, dim=-1)
    w = p.gather(1, ids)
    return (w / w.sum(-1, keepdim=True) if renormalize else w) * scaling, ids


def _stock_moe_experts(x, ids, weights, w_in, w_out, *, activation="swiglu", swiglu_limit=None):
    """HF's loop: each hit expert's rows, ``index_add_`` in expert order (in x.dtype)."""
    import torch.nn.functional as F
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, r = torch.where(ids == e)
        h = F.linear(x[tok], w_in[e])
        if activation == "swiglu":
            g, u = h.chunk(2, -1)
            if swiglu_limit is not None:
                g, u = g.clamp(max=swiglu_limit), u.clamp(-swiglu_limit, swiglu_limit)
            a = F.silu(g) * u
        else:
            a = torch.relu(h).square()
        out.index_add_(0, tok, (F.linear(a, w_out[e]) * weights[tok, r, None].to(x.dtype)).to(x.dtype))
    return out


def stock_kernels() -> dict:
    """{op: a stock torch version with the same signature}: what ``--inject kernel:OP`` swaps in
    (HF's formulas, torch's reduction orders; they agree with bitmatch's ops to rounding)."""
    import torch.nn.functional as F

    from bitmatch import testing as T

    def temp_col(t):
        return t.reshape(-1, 1) if isinstance(t, torch.Tensor) else t
    return {
        "linear": lambda x, w, b=None: F.linear(x, w, b),
        "rms_norm": _stock_rms_norm,
        "fused_add_rms_norm": lambda x, r, w, eps: (_stock_rms_norm(x + r, w, eps), x + r),
        "silu_and_mul": lambda x: F.silu(x[..., :x.shape[-1] // 2]) * x[..., x.shape[-1] // 2:],
        "apply_rotary": _stock_rotary,
        "attention_prefill": lambda q, k, v, cu, scale, causal=True, sliding_window=None:
            T.stock_sdpa_prefill(q, k, v, cu, scale, sliding_window),
        "attention_paged": lambda q, kc, vc, bt, qsl, lens, scale, sliding_window=None:
            T.stock_sdpa_paged(q, kc, vc, bt, qsl, lens, scale, sliding_window),
        "token_logprobs": lambda x, tok, temperature=1.0: torch.log_softmax(
            x.float() / temp_col(temperature), -1).gather(1, tok.long()[:, None])[:, 0],
        "moe_route": _stock_moe_route,
        "moe_experts": _stock_moe_experts,
    }


def parse_inject(spec: str | None):
    """``weight:LAYER.PARAM`` | ``kernel:OP`` | ``temperature`` -> (kind, arg); ValueError otherwise."""
    if spec is None:
        return None
    kind, _, arg = spec.partition(":")
    if kind == "temperature" and not arg:
        return ("temperature", None)
    if kind == "kernel" and arg in stock_kernels():
        return ("kernel", arg)
    if kind == "weight" and arg:
        return ("weight", arg)
    raise ValueError(f"locate: --inject must be weight:LAYER.PARAM (e.g. weight:1.mlp.down_proj), kernel:OP "
                     f"(OP one of {', '.join(stock_kernels())}) or temperature; got {spec!r}")


def perturb_weight(model, target: str):
    """A deep copy of ``model`` whose parameter ``target`` ("1.mlp.down_proj" = layer 1's
    module or parameter; "lm_head", "model.norm" outside the layers) is scaled by 1 + 2^-5
    (every nonzero element changes its bits in bf16 and fp32)."""
    import copy

    from bitmatch.models import unwrap_causal_lm

    m = copy.deepcopy(model)
    lm = unwrap_causal_lm(m)
    head, _, rest = target.partition(".")
    paths = [f"model.layers.{head}.{rest}"] if head.isdigit() else [target, f"model.{target}"]
    for path in paths:
        for cand in (path, path + ".weight"):
            try:
                p = lm.get_parameter(cand)
            except AttributeError:
                continue
            with torch.no_grad():
                p.mul_(1 + 2 ** -5)
            return m
    raise ValueError(f"locate: --inject weight:{target}: no parameter {' or '.join(paths)}[.weight] in "
                     f"{type(lm).__name__}")


@contextlib.contextmanager
def kernel_fault(op: str | None):
    """Inside the block ``bitmatch.kernels.<op>`` is the stock torch version (``stock_kernels``)."""
    import bitmatch.kernels as K
    if op is None:
        yield
        return
    orig = getattr(K, op)
    setattr(K, op, stock_kernels()[op])
    try:
        yield
    finally:
        setattr(K, op, orig)


@contextlib.contextmanager
def _engine_temperature_fault(on: bool):
    """The engine's reported logprobs from logits * (1/T) instead of logits / T."""
    import bitmatch.engine.sampling as S
    if not on:
        yield
        return
    orig = S._token_logprobs
    S._token_logprobs = lambda logits, tokens, temps: orig(logits.float() * (1.0 / temps)[:, None], tokens,
                                                           torch.ones_like(temps))
    try:
        yield
    finally:
        S._token_logprobs = orig


# ----------------------------------------------------------------------------- the paths of each pair

@contextlib.contextmanager
def _recording(engine, rec):
    """The real engine's per-op outputs: its runner's scheduled rows give each token's (request,
    position); the family's forward gets ``rec``. Instance attributes, removed on exit (a
    recorder hook on ModelRunner is requested in /work/team/requests.md)."""
    from bitmatch.models import registry, unwrap_causal_lm

    runner = engine.model_runner
    fam, _ = registry.spec_of(unwrap_causal_lm(engine.model))
    prepare, fwd, head = runner.prepare, fam.forward_hidden, fam.compute_logits
    sampled: list = []

    def prep(scheduled):
        rec.keys = [(seq.seq_id, p) for seq, n in scheduled
                    for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n)]
        sampled[:] = [(seq.seq_id, seq.num_computed_tokens + n - 1) for seq, n in scheduled
                      if seq.num_computed_tokens + n == len(seq)]
        return prepare(scheduled)

    def compute_logits(lm, spec, hidden, dt):
        out = head(lm, spec, hidden, dt)
        keys, rec.keys = rec.keys, list(sampled)
        rec("lm_head", out)
        rec.keys = keys
        return out
    def forward_hidden(lm, spec, ids, ctx, dt, recorder=None):
        if rec.keys is None or len(rec.keys) != ids.numel():   # a step the hooked prepare did not see
            raise RuntimeError("locate --pair engine: the engine ran a step without its runner's prepare(); "
                               "the recorder cannot attribute its rows (engine internals changed?)")
        out = fwd(lm, spec, ids, ctx, dt, recorder or rec)
        return out
    runner.prepare = prep
    fam.forward_hidden = forward_hidden
    fam.compute_logits = compute_logits
    try:
        yield
    finally:
        del runner.prepare, fam.forward_hidden, fam.compute_logits


def _hf_candidates(hf, seqs, names, temperature) -> dict:
    """HF's own forward, one sequence at a time, hooked at the modules named like bitmatch's ops:
    each op's candidates are that module's output and the input of the next op's module (the
    attention output is o_proj's input, silu(g) * u is down_proj's input)."""
    from bitmatch.models import unwrap_causal_lm

    lm = unwrap_causal_lm(hf)
    mods = dict(lm.named_modules())

    def mod(n):
        return next((m for p in (f"model.{n}", n) if (m := mods.get(p)) is not None), None)
    want = {}
    for i, n in enumerate(names):
        if (m := mod(n)) is not None:
            want.setdefault(id(m), (m, []))[1].append((n, "output", n))
        if i + 1 < len(names) and (m := mod(names[i + 1])) is not None:
            want.setdefault(id(m), (m, []))[1].append((n, "input", names[i + 1]))
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
                logits = lm(input_ids=torch.tensor([seq], device=_device(lm))).logits[0].float()
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
        (_, keys, vals), = _merge([[(n, k, v) for k, v in pieces]])
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
    ta = _packed_trace(model_a, seqs, compute_dtype_a)
    tb = _packed_trace(model_b, seqs, compute_dtype_b) if paged_b_block_size is None else \
        _paged_trace(model_b, seqs, schedule_steps([len(s) for s in seqs], "prefill"),
                     block_size=paged_b_block_size, dtype=compute_dtype_b)
    return _diff(ta, tb, comparison="model a vs model b (packed prefill)" if paged_b_block_size is None
                 else f"model a (packed prefill) vs model b (paged, block {paged_b_block_size})")


def _engine_pair(model, prompts, temperature, max_tokens, fault, meta, engine_kw):
    import bitmatch
    from bitmatch.engine import Engine, SamplingParams
    from bitmatch.testing_models import pad_batch

    b = perturb_weight(model, fault[1]) if fault and fault[0] == "weight" else model
    kw = dict(max_num_seqs=len(prompts), max_num_batched_tokens=7, block_size=16)
    kw.update(engine_kw or {})
    eng = Engine(b, **kw)
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    rec = _Recorder()
    with _recording(eng, rec), kernel_fault(fault[1] if fault and fault[0] == "kernel" else None), \
            _engine_temperature_fault(bool(fault and fault[0] == "temperature")):
        outs = eng.generate(prompts, params, use_tqdm=False)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    keys = [(s, len(o.prompt_token_ids) - 1 + j) for s, o in enumerate(outs) for j in range(len(o.outputs[0].token_ids))]
    reported = torch.tensor([x for o in outs for x in o.outputs[0].logprobs], dtype=torch.float32)
    tb = rec.trace() + [("logprobs", keys, (reported,))]
    # the trainer: the ops of the packed prefill token_logprobs runs, then token_logprobs itself
    ids, mask = pad_batch(seqs, "right")
    with torch.no_grad():
        lp = bitmatch.token_logprobs(model, ids, mask, temperature=temperature)
    trainer = torch.stack([lp[s, p] for s, p in keys]).float().cpu()
    ta = [e for e in _packed_trace(model, seqs, temperature=temperature) if e[0] != "logprobs"]
    ta.append(("logprobs", keys, (trainer,)))
    tb = [e for e in tb if e[0] in {n for n, _, _ in ta}] if len(tb) != len(ta) else tb
    res = _diff(ta, tb, comparison=f"trainer token_logprobs (packed prefill) vs engine (paged block "
                f"{kw['block_size']}, {kw['max_num_batched_tokens']}-token steps: chunked prefill + decode)",
                side_a="trainer", side_b="engine", **meta)
    res.logprobs = compare(reported.split([len(o.outputs[0].token_ids) for o in outs]),
                           trainer.split([len(o.outputs[0].token_ids) for o in outs])).to_dict()
    return [res]


def _side_b(model, fault, run):
    """Run ``run(model_b, lp_fn)`` with the fault on side B."""
    kind, arg = fault or (None, None)
    mb = perturb_weight(model, arg) if kind == "weight" else model
    with kernel_fault(arg if kind == "kernel" else None):
        return run(mb, _lp_reciprocal if kind == "temperature" else None)


def fp32_reference(model):
    """HF's own model of ``model``'s architecture built in fp32 from its config (unpatched; its
    rotary tables computed in fp32, not cast back from a bf16 copy) with ``model``'s weights."""
    import transformers

    from bitmatch.models import unwrap_causal_lm

    lm = unwrap_causal_lm(model)
    with torch.random.fork_rng():
        ref = transformers.AutoModelForCausalLM.from_config(lm.config, dtype=torch.float32)
    ref.load_state_dict({k: v.detach().float() for k, v in lm.state_dict().items()})
    return ref.to(_device(lm)).eval()


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

    from bitmatch.models import unwrap_causal_lm

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
        ta = _packed_trace(model, seqs, temperature=temperature)

        def paged(mode, sd):
            return lambda m, lp: _paged_trace(m, seqs, schedule_steps(lens, mode, sd), block_size=block_size,
                                              temperature=temperature, lp_fn=lp)
        alone = lambda m, lp: _merge_traces([_packed_trace(m, [s], temperature=temperature, lp_fn=lp,  # noqa: E731
                                                           seq_ids=[i]) for i, s in enumerate(seqs)])
        cases = [("packed prefill vs token-by-token decode", ta, paged("decode", seed)),
                 ("chunk split A vs chunk split B", paged("chunked", seed)(model, None), paged("chunked", seed + 1)),
                 ("all sequences in one batch vs each sequence alone", ta, alone)]
        return [_diff(a, _side_b(model, fault, run), comparison=c, side_a=c.split(" vs ")[0],
                      side_b=c.split(" vs ")[1], **meta) for c, a, run in cases]
    if pair == "hf":
        ref = (hf_model if hf_model is not None else fp32_reference(model)).float()
        mine = copy.deepcopy(unwrap_causal_lm(model)).float()
        tb = _side_b(mine, fault, lambda m, lp: _packed_trace(m, seqs, torch.float32, temperature, lp))
        cands = _hf_candidates(ref, seqs, [n for n, _, _ in tb], temperature)
        return [_diff(cands, tb, 1e-4 if tolerance is None else tolerance, side_a="HF fp32", side_b="bitmatch fp32",
                      comparison="HF reference forward (fp32) vs bitmatch forward (fp32)", **meta)]
    # backend
    import os

    from bitmatch.kernels import use_backend
    cpu = copy.deepcopy(unwrap_causal_lm(model)).cpu()
    if not torch.cuda.is_available():
        # the interpreter's fp32 -> bf16 cast truncates (1 ulp of bias per rounding point): in fp32 the
        # comparison checks each kernel's structure (tiling, masks, walk order) to a tight tolerance
        cpu = cpu.float()
    dt = torch.float32 if not torch.cuda.is_available() else _dtype(cpu, None)
    tol = tolerance if tolerance is not None else (1e-3 if dt == torch.float32 else 3e-2)
    with use_backend("reference"):
        ta = _packed_trace(cpu, seqs, dt, temperature=temperature)
    if torch.cuda.is_available():
        dev_model, where = copy.deepcopy(cpu).cuda(), "triton (cuda)"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        dev_model, where = cpu, "triton (interpreter, CPU)"
    else:
        raise RuntimeError("locate --pair backend: no CUDA device; run with TRITON_INTERPRET=1 to compare the "
                           "Triton kernels under Triton's CPU interpreter")
    with use_backend("triton"):
        tb = _side_b(dev_model, fault, lambda m, lp: _packed_trace(m, seqs, dt, temperature=temperature, lp_fn=lp))
    return [_diff(ta, tb, tol, side_a="reference (cpu)", side_b=where,
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

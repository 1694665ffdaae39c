"""Op traces for ``bitmatch locate``: record every op's output along one path (packed prefill, the
paged engine's schedule), line two traces up by (sequence, position) and name the first op whose
bits (or, with a tolerance, values) differ.

A trace is what one path computed: [(op name, keys, values)] in op order; ``values`` is a tuple
of CPU tensors whose rows are tokens and ``keys[r]`` = (sequence, position) of row r (None when
the output is not per token). Two paths are compared row by row on the keys they share, so an
engine that ran a sequence over five paged steps lines up with the trainer's one packed prefill.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import xxhash

import bitmatch.kernels as K
from bitmatch.context import ForwardContext
from bitmatch.models import allocate_caches, cache_groups, compute_dtype_of, compute_logits, forward_hidden, pack
from bitmatch.sync.hash import fingerprints_of
from bitmatch.testing.models import pad_batch

PAIRS = ("engine", "hf", "schedule", "backend")


def op_fingerprint(t) -> str:
    """The fingerprint of an op's output: ``bitmatch.sync``'s hash (bmh1 of the exact bytes, on
    the tensor's device) with the dtype and shape of a tensor or of each tensor of a tuple."""
    xs = [x.detach() for x in (t if isinstance(t, (tuple, list)) else (t,))]
    fps = fingerprints_of(xs)
    return xxhash.xxh3_128("".join(f"{x.dtype}{tuple(x.shape)}:{fp};" for x, fp in zip(xs, fps)).encode()).hexdigest()


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


class Recorder:
    """Keeps CPU copies of every op output over one or more steps, each row keyed by its
    (sequence, position). Two ways in: as ``forward_hidden``'s ``recorder(name, value)``, rows
    keyed by ``keys`` (set by the caller), and as an engine recorder (``Engine.record``: ``step``
    and ``record``, the rows the engine names; a graph's padded rows are dropped). ``paths``
    counts the engine steps by the path they took."""

    def __init__(self):
        self.parts: dict = {}
        self.keys = None
        self.paths: dict[str, int] = {}

    def __call__(self, name, v):
        self.record(name, v, self.keys)

    def step(self, view) -> None:
        self.paths[view.path] = self.paths.get(view.path, 0) + 1

    def record(self, name, v, rows) -> None:
        vals = tuple(x.detach().to("cpu", copy=True) for x in (v if isinstance(v, (tuple, list)) else (v,)))
        per_token = rows is not None and all(x.dim() and x.shape[0] == len(rows) for x in vals)
        if per_token and None in rows:   # padding of a graph's bucket: no sequence owns these rows
            keep = torch.tensor([r for r, k in enumerate(rows) if k is not None], dtype=torch.long)
            vals, rows = tuple(x[keep] for x in vals), [k for k in rows if k is not None]
        self.parts.setdefault(name, []).append((list(rows) if per_token else None, vals))

    def trace(self) -> list:
        return merge_pieces([[(n, k, v) for k, v in parts] for n, parts in self.parts.items()])


def merge_pieces(per_op) -> list:
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


def merge_traces(traces) -> list:
    names = [n for n, _, _ in traces[0]]
    by = [{n: (n, k, v) for n, k, v in t} for t in traces]
    return merge_pieces([[b[n] for b in by if n in b] for n in names])


def model_device(model):
    return next(model.parameters()).device


def trace_dtype(model, dtype):
    """The compute dtype: given, else the one ``bitmatch.models`` reads (patch state or the
    embedding), else the parameters' (a family whose embedding is not ``embed_tokens``)."""
    if dtype is not None:
        return dtype
    try:
        return compute_dtype_of(model)
    except AttributeError:
        return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _lp_bitmatch(logits, targets, temperature):
    return K.token_logprobs(logits, targets, temperature)


def _record_logprobs(rec, logits, seqs: dict, temperature, lp_fn):
    keys = rec.keys
    rows = [r for r, (s, p) in enumerate(keys) if p + 1 < len(seqs[s])]
    if rows:
        tgt = torch.tensor([seqs[keys[r][0]][keys[r][1] + 1] for r in rows], device=logits.device)
        rec.keys = [keys[r] for r in rows]
        rec("logprobs", (lp_fn or _lp_bitmatch)(logits[rows], tgt, temperature))
        rec.keys = keys


def packed_trace(model, seqs, dtype=None, temperature=1.0, lp_fn=None, seq_ids=None) -> list:
    """The trainer's path: every sequence in one packed prefill (what ``token_logprobs`` runs)."""
    dev, dtype = model_device(model), trace_dtype(model, dtype)
    ids, mask = pad_batch(seqs, "right")
    p = pack(ids.to(dev), mask.to(dev))
    sid = list(seq_ids) if seq_ids is not None else list(range(len(seqs)))
    rec = Recorder()
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


def paged_trace(model, seqs, steps, *, block_size=16, dtype=None, temperature=1.0, lp_fn=None) -> list:
    """The engine's path: the steps against fresh paged caches (shuffled block table; one
    zero-filled per-sequence state slot per sequence) of the model's cache groups."""
    import dataclasses
    import inspect

    dev, dtype = model_device(model), trace_dtype(model, dtype)
    nblk = [-(-len(s) // block_size) for s in seqs]
    perm = torch.randperm(sum(nblk), generator=torch.Generator().manual_seed(0)).tolist()
    tables = [perm[sum(nblk[:i]):sum(nblk[:i + 1])] for i in range(len(seqs))]
    groups = cache_groups(model, compute_dtype=dtype)
    extra = {"num_seqs": len(seqs)} if "num_seqs" in inspect.signature(allocate_caches).parameters else {}
    caches = allocate_caches(groups, max(sum(nblk), 1), block_size, dev, **extra)
    has_slots = "state_slots" in {f.name for f in dataclasses.fields(ForwardContext)}
    done = [0] * len(seqs)
    rec = Recorder()

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


def diff_traces(ta, tb, tol=None, **meta) -> LocateResult:
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


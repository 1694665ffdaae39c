"""Proof and diagnosis: compare rollout vs trainer logprobs; locate the first op whose bits differ."""
from __future__ import annotations

import struct
from dataclasses import asdict, dataclass, field

import torch

__all__ = ["compare", "CompareResult", "locate", "LocateResult", "op_fingerprint", "float_hex"]


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


@dataclass
class LocateResult:
    first_divergent: str | None     # e.g. 'layers.1.mlp.down_proj'; None when all bits agree
    layer: int | None
    op: str | None                  # the op inside the layer, e.g. 'mlp.down_proj'
    ops_compared: int
    fingerprints_a: list = field(default_factory=list, repr=False)   # [(name, hash)]
    fingerprints_b: list = field(default_factory=list, repr=False)

    @property
    def bitmatched(self) -> bool:
        return self.first_divergent is None

    def summary(self) -> str:
        if self.first_divergent is None:
            return f"all {self.ops_compared} op outputs bit-identical"
        return f"first divergent op: {self.first_divergent} (after {self.ops_compared} ops compared)"


def _paged_context(model, packed, compute_dtype, block_size):
    """The same tokens as one chunked-prefill step against a fresh paged KV cache."""
    from bitmatch.context import ForwardContext
    from bitmatch.models import allocate_caches, cache_groups

    groups = cache_groups(model, compute_dtype=compute_dtype)
    dev = packed.input_ids.device
    cu = packed.cu_seqlens.to(torch.long)
    lens = (cu[1:] - cu[:-1])
    nblk = (lens + block_size - 1) // block_size
    maxb = int(nblk.max()) if lens.numel() else 1
    total = int(nblk.sum())
    # blocks handed out in reverse order, so the table is not the identity
    ids = torch.arange(total, device=dev).flip(0)
    table = torch.zeros((lens.numel(), max(maxb, 1)), dtype=torch.int32, device=dev)
    slots = torch.empty(packed.input_ids.numel(), dtype=torch.long, device=dev)
    o = 0
    for b in range(lens.numel()):
        n = int(nblk[b])
        table[b, :n] = ids[o:o + n].to(torch.int32)
        o += n
        pos = torch.arange(int(lens[b]), device=dev)
        slots[int(cu[b]):int(cu[b + 1])] = table[b, pos // block_size].to(torch.long) * block_size + pos % block_size
    return ForwardContext(positions=packed.positions, query_start_loc=packed.cu_seqlens,
                          seq_lens=lens.to(torch.int32), block_table=table, slot_mapping=slots,
                          caches=allocate_caches(groups, total, block_size, dev))


def _record(model, packed, compute_dtype, paged_block_size=None):
    from bitmatch.models import compute_logits, forward_hidden

    recs: list = []
    with torch.no_grad():
        ctx = packed.context() if paged_block_size is None else \
            _paged_context(model, packed, compute_dtype, paged_block_size)
        h = forward_hidden(model, packed.input_ids, ctx, compute_dtype=compute_dtype,
                           recorder=lambda name, v: recs.append((name, op_fingerprint(v))))
        logits = compute_logits(model, h, compute_dtype=compute_dtype)
        recs.append(("lm_head", op_fingerprint(logits)))
    return recs


def _as_batch(input_ids, attention_mask):
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids if input_ids.dim() == 2 else input_ids[None]
        return ids, attention_mask
    from bitmatch.testing_models import pad_batch

    seqs = [list(s) for s in input_ids]
    if seqs and not isinstance(seqs[0], list):
        seqs = [seqs]
    return pad_batch(seqs, "right")


def locate(model_a, model_b, input_ids, attention_mask=None, *, compute_dtype_a=None,
           compute_dtype_b=None, paged_b_block_size: int | None = None) -> LocateResult:
    """Run the same tokens through two models (e.g. the trainer's and the engine's model object)
    on bitmatch's forward, hash every op's output, and name the first op whose bits differ.

    ``input_ids``: [B, L] tensor (with ``attention_mask``) or a list of token-id lists.
    ``model_b`` may also be a ``bitmatch.Engine`` (its ``.model`` is used).
    ``paged_b_block_size``: run model_b's attention as the engine does (k/v written into a
    paged cache of that block size, then attention_paged) instead of packed prefill.
    """
    from bitmatch.models import pack

    if not isinstance(model_b, torch.nn.Module) and isinstance(getattr(model_b, "model", None), torch.nn.Module):
        model_b = model_b.model
    if not isinstance(model_a, torch.nn.Module) and isinstance(getattr(model_a, "model", None), torch.nn.Module):
        model_a = model_a.model
    ids, mask = _as_batch(input_ids, attention_mask)
    dev_a = next(model_a.parameters()).device
    dev_b = next(model_b.parameters()).device
    pa = pack(ids.to(dev_a), None if mask is None else mask.to(dev_a))
    pb = pack(ids.to(dev_b), None if mask is None else mask.to(dev_b))
    ra = _record(model_a, pa, compute_dtype_a)
    rb = _record(model_b, pb, compute_dtype_b, paged_b_block_size)
    n = 0
    for (na, ha), (nb, hb) in zip(ra, rb):
        n += 1
        if na != nb:
            raise ValueError(f"locate: the two models run different op sequences ({na} vs {nb})")
        if ha != hb:
            layer = op = None
            parts = na.split(".")
            if parts[0] == "layers":
                layer = int(parts[1])
                op = ".".join(parts[2:])
            else:
                op = na
            return LocateResult(na, layer, op, n, ra, rb)
    if len(ra) != len(rb):
        raise ValueError(f"locate: the models have different depths ({len(ra)} vs {len(rb)} ops)")
    return LocateResult(None, None, None, n, ra, rb)

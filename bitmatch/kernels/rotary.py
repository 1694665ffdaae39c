"""Rotary embeddings: one cos/sin builder for every side, and its neox-style application.

cos/sin of position p depend on p and the config alone: angles p * inv_freq in float64 and
sin/cos from elementwise IEEE ops (no libm/Sleef tails), so any batch of positions gives
each position the same bits. Scaling follows HF's rope_parameters: default, linear, llama3,
yarn. Dynamic NTK changes frequencies with the sequence length, which no invariant schedule
can reproduce, so it is refused.
"""
from __future__ import annotations

import json
import math

import torch

from . import _exact
from ._backend import backend_for, check_float, check_int, needs_autograd, triton_impl

F64 = torch.float64
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _inv_freq(head_dim: int, base: float, scaling: dict | None, max_pos: int | None):
    dim = head_dim
    inv = 1.0 / (float(base) ** (torch.arange(0, dim, 2, dtype=F64) / dim))
    attn_factor = 1.0
    rope_type = "default"
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rotary_cos_sin: rope type {rope_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)}); dynamic scaling depends "
                         "on sequence length and breaks the invariance contract")
    if scaling and scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("rotary_cos_sin: partial_rotary_factor != 1 is not supported")
    if rope_type == "linear":
        inv = inv / float(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old / low, old / high
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv = torch.where(medium, smoothed, scaled)
    elif rope_type == "yarn":
        factor = float(scaling["factor"])
        old = scaling.get("original_max_position_embeddings") or max_pos
        if old is None:
            raise ValueError("rotary_cos_sin: yarn needs original_max_position_embeddings "
                             "or max_position_embeddings")
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")

        def get_mscale(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0
        attn_factor = scaling.get("attention_factor")
        if attn_factor is None:
            attn_factor = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
                           if mscale and mscale_all else get_mscale(factor))
        beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def corr_dim(rot):
            return (dim * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(base))
        lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, dtype=F64) - lo) / (hi - lo)).clamp(0, 1)
        extrap = 1 - ramp
        inv = (inv / factor) * (1 - extrap) + inv * extrap
    return inv, float(attn_factor)


_TABLES: dict = {}   # (rope config, dtype, device) -> (cos, sin) rows for positions 0..n-1
# tables a larger one replaced: a captured CUDA graph may still read one (it holds addresses, not
# references), so they live as long as the process, at most as many rows as the current table
_RETIRED: list = []
_TABLE_MIN = 4096


def _angles_cos_sin(positions_cpu, inv, attn_factor, dtype):
    ang = positions_cpu.to(F64).reshape(-1, 1) * inv.reshape(1, -1)
    sin, cos = _exact.sincos64(ang)
    if attn_factor != 1.0:
        cos, sin = cos * attn_factor, sin * attn_factor
    return cos.to(dtype), sin.to(dtype)


def _table(key, n, freqs, dtype, device):
    """(cos, sin) rows of positions 0..>=n-1 in ``dtype`` on ``device``, built once per rope
    config (grown by doubling): a row is the same function of its position as a direct
    computation, so a gathered row has its bits; a forward pays no CPU math, one host sync.
    ``freqs()``: (inv_freq, attn_factor), computed only when a table is built."""
    t = _TABLES.get(key)
    if t is None or t[0].shape[0] < n:
        size = max(_TABLE_MIN, 1 << (n - 1).bit_length())
        cos, sin = _angles_cos_sin(torch.arange(size), *freqs(), dtype)
        if t is not None:
            _RETIRED.append(t)
        t = _TABLES[key] = (cos.to(device), sin.to(device))
    return t


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, base: float, scaling: dict | None = None,
                   dtype: torch.dtype = torch.float32, max_position_embeddings: int | None = None,
                   max_seq_len: int | None = None):
    """(cos, sin), each [T, head_dim // 2], for integer ``positions`` [T].

    ``max_seq_len``: a host bound, 0 <= positions < max_seq_len (the engine's step bound): the rows
    are gathered from the table with no read back of the positions, so a CUDA graph can capture
    the call once the table holds max_seq_len rows. Without it the call reads the positions' range
    back (one host sync).

    Invariance: each position's row depends only on that position and the rope config.
    """
    check_int("positions", positions, "rotary_cos_sin")
    if head_dim % 2:
        raise ValueError(f"rotary_cos_sin: head_dim must be even, got {head_dim}")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"rotary_cos_sin: dtype must be bfloat16 or float32, got {dtype}")
    def freqs():
        return _inv_freq(head_dim, base, scaling, max_position_embeddings)
    pos = positions.detach().reshape(-1)
    lo = hi = None
    if max_seq_len is not None and pos.numel():
        lo, hi = 0, max(int(max_seq_len), 1) - 1
    elif pos.numel():
        lo, hi = (int(v) for v in torch.stack(torch.aminmax(pos)).tolist())  # the one host sync
    if pos.numel() == 0 or lo < 0:   # negative positions: direct computation (no table row)
        cos, sin = _angles_cos_sin(pos.cpu(), *freqs(), dtype)
        return cos.to(positions.device), sin.to(positions.device)
    # the rope config is checked when its table is built (_inv_freq refuses what it cannot do)
    key = (head_dim, float(base), json.dumps(scaling, sort_keys=True, default=str), max_position_embeddings,
           dtype, str(positions.device))
    cos_t, sin_t = _table(key, hi + 1, freqs, dtype, positions.device)
    idx = pos.long()
    return cos_t[idx], sin_t[idx]


def _rotate_reference(x, cos, sin):
    # HF: x * cos + rotate_half(x) * sin, each product and the sum rounded to x's dtype
    h = x.shape[-1] // 2
    c = cos.to(x.dtype).unsqueeze(-2).float()
    s = sin.to(x.dtype).unsqueeze(-2).float()
    x1, x2 = x[..., :h].float(), x[..., h:].float()
    d = x.dtype
    o1 = ((x1 * c).to(d).float() + (-(x2 * s)).to(d).float()).to(d)
    o2 = ((x2 * c).to(d).float() + (x1 * s).to(d).float()).to(d)
    return torch.cat([o1, o2], dim=-1)


def _rotate_back_reference(g, cos, sin):
    # the transpose of the rotation (rotate by -angle) in fp32, cos/sin rounded as the forward's
    h = g.shape[-1] // 2
    c = cos.to(g.dtype).unsqueeze(-2).float()
    s = sin.to(g.dtype).unsqueeze(-2).float()
    g1, g2 = g[..., :h].float(), g[..., h:].float()
    return torch.cat([g1 * c + g2 * s, g2 * c - g1 * s], dim=-1).to(g.dtype)


def _forward(q, k, cos, sin):
    if backend_for(q) == "reference":
        return _rotate_reference(q, cos, sin), _rotate_reference(k, cos, sin)
    return triton_impl("rotary", "apply_rotary")(q, k, cos, sin)


class RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.set_materialize_grads(False)
        ctx.backend = backend_for(q)
        ctx.save_for_backward(cos, sin)  # a rotation is linear: the backward needs only cos/sin
        return _forward(q, k, cos, sin)

    @staticmethod
    def backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        gq, gk = (g.contiguous() if g is not None and n else None
                  for g, n in zip((gq, gk), ctx.needs_input_grad[:2]))
        if ctx.backend == "triton":
            gq_, gk_ = triton_impl("rotary", "apply_rotary_backward")(gq, gk, cos, sin)
        else:
            gq_, gk_ = (None if g is None else _rotate_back_reference(g, cos, sin) for g in (gq, gk))
        return gq_, gk_, None, None


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate q [T, Hq, D] and k [T, Hkv, D] by cos/sin [T, D//2] (neox / rotate_half style).

    Invariance: elementwise per token; each token depends on its own q, k and position.
    """
    op = "apply_rotary"
    for n, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_float(n, t, op)
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"{op}: q and k must be [T, H, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    t_, d = q.shape[0], q.shape[-1]
    if k.shape[0] != t_ or k.shape[-1] != d or cos.shape != (t_, d // 2) or sin.shape != cos.shape:
        raise ValueError(f"{op}: shapes do not agree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)} (want cos/sin [T, D//2])")
    fn = RotaryFunction.apply if needs_autograd(q, k) else _forward
    return fn(q.contiguous(), k.contiguous(), cos.contiguous(), sin.contiguous())

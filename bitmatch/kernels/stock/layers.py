"""Stock dense layers, HF's formulas: ``linear``, the RMS norms, ``silu_and_mul``, the rotary embeddings."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._common import F32


def linear(x, weight, bias=None, *, segments=None, rows_of=None):
    """F.linear (cuBLAS / BLAS: the reduction order depends on M); ``segments``, ``rows_of``: the same GEMM."""
    return F.linear(x, weight, bias)


def rms_norm(x, weight, eps):
    """HF's RMSNorm: fp32 mean of squares, rsqrt, back to x.dtype, times the weight."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def fused_add_rms_norm(x, residual, weight, eps):
    s = x + residual
    return rms_norm(s, weight, eps), s


def silu_and_mul(x):
    i = x.shape[-1] // 2
    return F.silu(x[..., :i]) * x[..., i:]


def _rope_inv_freq(head_dim, base, scaling, max_pos):
    """HF's rope init functions in fp32: (inv_freq, attention factor) for default / linear / llama3 / yarn."""
    sc = scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    inv = 1.0 / (float(base) ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "linear":
        return inv / float(sc["factor"]), 1.0
    if kind == "llama3":
        f, lo, hi, old = (float(sc[k]) for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                   "original_max_position_embeddings"))
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > old / lo, inv / f, inv)
        smooth = (old / wl - lo) / (hi - lo)
        medium = ~(wl < old / hi) & ~(wl > old / lo)
        return torch.where(medium, (1 - smooth) * scaled / f + smooth * scaled, scaled), 1.0
    if kind == "yarn":
        f, old = float(sc["factor"]), sc.get("original_max_position_embeddings") or max_pos

        def mscale(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0
        attn = sc.get("attention_factor") or (mscale(f, sc["mscale"]) / mscale(f, sc["mscale_all_dim"])
                                              if sc.get("mscale") and sc.get("mscale_all_dim") else mscale(f))

        def corr(rot):
            return head_dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))
        lo, hi = corr(sc.get("beta_fast") or 32), corr(sc.get("beta_slow") or 1)
        if sc.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        hi = hi + 0.001 if lo == hi else hi
        extrap = 1 - ((torch.arange(head_dim // 2, dtype=F32) - lo) / (hi - lo)).clamp(0, 1)
        return (inv / f) * (1 - extrap) + inv * extrap, float(attn)
    if kind != "default":
        raise NotImplementedError(f"stock rotary_cos_sin: scaling rope_type {kind!r} has no stock version; "
                                  "use default, linear, llama3 or yarn")
    return inv, 1.0


def rotary_cos_sin(positions, head_dim, base, scaling=None, dtype=F32, max_position_embeddings=None, max_seq_len=None):
    """HF's rotary embedding: fp32 frequencies, fp32 angles, torch cos / sin times the attention factor
    (``max_seq_len``, the kernel's host bound, changes nothing here)."""
    inv, attn = _rope_inv_freq(head_dim, base, scaling, max_position_embeddings)
    ang = positions.reshape(-1, 1).float() * inv.to(positions.device)[None]
    return (ang.cos() * attn).to(dtype), (ang.sin() * attn).to(dtype)


def _rotate(x, cos, sin):
    c, s = torch.cat([cos, cos], -1).to(x.dtype)[:, None], torch.cat([sin, sin], -1).to(x.dtype)[:, None]
    h = x.shape[-1] // 2
    return x * c + torch.cat([-x[..., h:], x[..., :h]], -1) * s


def apply_rotary(q, k, cos, sin):
    """HF's ``q * cos + rotate_half(q) * sin`` in q's dtype."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def apply_rotary_interleaved(x, cos, sin, *, inverse=False):
    """The trailing 2 * cos.shape[-1] channels rotated by interleaved pairs as complex products in fp32."""
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(1) if squeeze else x
    r = 2 * cos.shape[-1]
    rope = torch.view_as_complex(x3[..., -r:].float().reshape(*x3.shape[:-1], r // 2, 2).contiguous())
    rot = torch.complex(cos.float(), sin.float())[:, None]
    rope = rope * (rot.conj() if inverse else rot)
    out = torch.cat([x3[..., :-r], torch.view_as_real(rope).flatten(-2).to(x.dtype)], -1)
    return out.squeeze(1) if squeeze else out

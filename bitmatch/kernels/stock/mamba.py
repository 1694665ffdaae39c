"""Stock Mamba2, HF's torch path: ``F.conv1d`` per sequence, the chunked SSD in fp32, the gated RMS norm."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import F32, spans


def causal_conv1d(x, weight, bias, cu_seqlens, *, activation="silu", conv_state=None, state_slots=None):
    """F.conv1d per sequence on [its slot's K-1 inputs (zeros when new), its tokens], in x.dtype."""
    K = weight.shape[1]
    out = torch.empty_like(x)
    w, b_ = weight.to(x.dtype).unsqueeze(1), None if bias is None else bias.to(x.dtype)
    for b, (s, e) in enumerate(spans(cu_seqlens)):
        slot = None if conv_state is None else int(state_slots[b])
        prev = x.new_zeros(K - 1, x.shape[1]) if slot is None else conv_state[slot].to(x.dtype)
        full = torch.cat([prev, x[s:e]])
        o = F.conv1d(full.t().unsqueeze(0), w, b_, groups=x.shape[1])[0].t()
        out[s:e] = F.silu(o) if activation == "silu" else o
        if slot is not None and K > 1:
            conv_state[slot] = full[-(K - 1):].to(conv_state.dtype)
    return out


def mamba_chunk_scan(x, dt, A, B, C, chunk_size, cu_seqlens, *, D=None, dt_bias=None, dt_min=0.0,
                     seq_start=None, cache=None, state_slots=None):
    """HF's chunked SSD in fp32 (cumsum, exp of segment sums, einsums), on the same absolute chunks
    and the same ``cache`` layout as the op (state at the open chunk's start, its earlier x / B / dt)."""
    H, P = x.shape[1:]
    rep, Q = H // B.shape[1], chunk_size
    dtp = F.softplus(dt.float() + (0.0 if dt_bias is None else dt_bias.float())).clamp(min=dt_min)
    y = torch.empty(x.shape, dtype=F32, device=x.device)
    for b, (s, e) in enumerate(spans(cu_seqlens)):
        l0, slot = 0, None
        S = x.new_zeros(H, P, B.shape[2], dtype=F32)
        px, pdt, pB = x[:0], dtp[:0], B[:0]
        if cache is not None:
            slot, l0 = int(state_slots[b]), int(seq_start[b]) % Q
            S = cache[0][slot].float()
            px, pB, pdt = cache[1][slot, :l0].to(x.dtype), cache[2][slot, :l0].to(B.dtype), cache[3][slot, :l0].float()
        i = s
        while i < e:
            take = min(Q - l0, e - i)
            xs, dts = torch.cat([px, x[i:i + take]]).float(), torch.cat([pdt, dtp[i:i + take]])
            Bs = torch.cat([pB, B[i:i + take]]).float().repeat_interleave(rep, 1)
            Cs = C[i:i + take].float().repeat_interleave(rep, 1)
            acum = torch.cumsum(dts * A.float(), 0)                                   # [n, H]
            rows = torch.arange(l0, l0 + take, device=x.device)
            causal = (rows[:, None] >= torch.arange(len(acum), device=x.device)[None]).unsqueeze(-1)
            L = torch.exp((acum[l0:].unsqueeze(1) - acum.unsqueeze(0)).masked_fill(~causal, float("-inf")))
            xdt = xs * dts.unsqueeze(-1)
            yd = torch.einsum("lsh,shp->lhp", torch.einsum("lhn,shn->lsh", Cs, Bs) * L, xdt)
            yo = torch.einsum("lhn,hpn->lhp", Cs, S) * torch.exp(acum[l0:]).unsqueeze(-1)
            y[i:i + take] = yd + yo + (0.0 if D is None else D.float().view(1, -1, 1) * xs[l0:])
            if l0 + take == Q:
                w = torch.exp(acum[-1:] - acum)
                S = torch.exp(acum[-1]).view(-1, 1, 1) * S + torch.einsum("sh,shp,shn->hpn", w, xdt, Bs)
            elif slot is not None:
                cache[1][slot, l0:l0 + take] = x[i:i + take].to(cache[1].dtype)
                cache[2][slot, l0:l0 + take] = B[i:i + take].to(cache[2].dtype)
                cache[3][slot, l0:l0 + take] = dtp[i:i + take]
            i, l0, px, pdt, pB = i + take, 0, x[:0], dtp[:0], B[:0]
        if slot is not None:
            cache[0][slot] = S
    return y


def gated_rms_norm(y, z, weight, group_size, eps):
    h = y.float() * F.silu(z.float())
    hg = h.view(h.shape[0], -1, group_size)
    return weight.float() * (hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + eps)).view_as(h)

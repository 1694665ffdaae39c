"""Stock block FP8, vLLM's torch formulas: group quantization, a dequantized-weight linear, the master round trip."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def quantize_fp8_groups(x, group=128, scale_fmt="float"):
    """vLLM's per_token_group_quant_fp8 in torch: amax per token and 128-group clamped to 1e-10, scale
    amax / 448 (ue8m0: exp2(ceil(log2))), (x / scale) clamped to +-448 and cast by torch (the last
    group zero-padded)."""
    K = x.shape[-1]
    G = -(-K // group)
    xg = F.pad(x.float(), (0, G * group - K)).unflatten(-1, (G, group))
    s = xg.abs().amax(-1).clamp(min=1e-10) / 448.0
    if scale_fmt == "ue8m0":
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (xg / s.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.flatten(-2)[..., :K], s


def _fp8_dequant(q, scale, dtype):
    n, k = q.shape
    return (q.float() * scale.float().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).to(dtype)


def fp8_linear(x, weight_q, weight_scale, bias=None, *, scale_fmt="float"):
    """The weight dequantized to x's dtype and F.linear, activations unquantized: what a stock engine
    runs for an FP8 checkpoint without an FP8 GEMM (cuBLAS / BLAS: the reduction order depends on M)."""
    return F.linear(x, _fp8_dequant(weight_q, weight_scale, x.dtype), bias)


def fp8_linear_master(x, weight, bias=None, *, scale_fmt="float"):
    """The master weight through a torch 128 x 128 block quantize / dequantize round trip, then F.linear."""
    n, k = weight.shape
    wb = F.pad(weight.float(), (0, -k % 128, 0, -n % 128)).unflatten(1, (-1, 128)).unflatten(0, (-1, 128))
    s = wb.abs().amax(dim=(1, 3)).clamp(min=1e-10) / 448.0
    if scale_fmt == "ue8m0":
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (wb / s[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).flatten(2).flatten(0, 1)[:n, :k]
    return fp8_linear(x, q, s, bias)

"""Block-FP8 (W8A8) linear and its quantizers: DeepSeek's format, row-invariant.

Quantizers (one definition, the same bytes on the reference and the Triton backend):
  per block (weights 128 x 128, ``quantize_fp8_blocks``; activations 1 x 128 along K, per token,
  ``quantize_fp8_groups``, as vLLM's per_token_group_quant_fp8): amax = max |x| in fp32 (exact);
  scale = max(amax, ``fp8_amax_floor``) / 448 correctly rounded in fp32 (the floor, 1e-10 as vLLM's
  eps, gives an all-zero block a finite scale and zero codes); ``scale_fmt="ue8m0"``: the next power
  of two at or above that; q = x / scale correctly rounded in fp32, then to the nearest e4m3fn value
  (ties to even, saturated at +-448, the sign of zero kept) by integer operations (``e4m3_code``).
  Partial blocks at the N / K edges are padded with zeros (DeepSeek's ceil-sized scale grids).
  Non-finite inputs are refused: ValueError on host-readable tensors, a device assert on the scales
  otherwise (the Triton quantizers make a block's scale inf when it holds a NaN or an inf).

Linear: x is quantized per token and 128-group inside, then
  out[m, n] = sum over K groups kb, in order, of dot(xq[m, kb], wq[n, kb]) * sx[m, kb] * sw[n // 128, kb].
Reference (CPU): each group's dot in float64 is exact (e4m3 products are multiples of 2**-18 below
2**36, and 128 of them stay below 2**53 units), each scaled partial is one float64 product, the
partials are added in float64 in kb order (elementwise, so an element's bits depend on its own
inputs alone), then + bias and one cast to x's dtype. Triton: fp32 partials of the fp8 tensor core
promoted every 128 K (kernels/triton/fp8.py). As for ``linear``, the two backends' bits differ: the
contract is that each backend is row-invariant and a trainer and its rollout engine run the same one.

Trainer side: ``fp8_linear_master`` quantizes the bf16 / fp32 master weight with
``quantize_fp8_blocks`` (the bytes a weight sync ships to the rollout engine) and runs ``fp8_linear``;
its gradients pass straight through both quantizers (stock matmuls: correct, not invariant).
"""
from __future__ import annotations

import torch

from . import order
from ._backend import (
    backend_for,
    check_float,
    check_on_device,
    check_same_device,
    host_readable,
    needs_autograd,
    triton_impl,
)
from .linear import check_operands

GROUP = 128
BLOCK = (128, 128)
SCALE_FMTS = ("float", "ue8m0")
E4M3 = torch.float8_e4m3fn
F64 = torch.float64
_N_CHUNK = 4096  # bounds the float64 scratch of the reference; output columns are independent


# ---------------------------------------------------------------- the quantizer's arithmetic
def e4m3_code(v: torch.Tensor) -> torch.Tensor:
    """The e4m3fn byte (int32) nearest to each fp32 value: ties to even, saturated at +-448, the
    sign kept. The integer recipe of kernels/triton/fp8.py ``e4m3_code``, operation for operation."""
    b = v.contiguous().view(torch.int32)
    a = b & 0x7FFFFFFF
    e = a >> 23
    m = (a & 0x7FFFFF) | torch.where(e > 0, 0x800000, 0).to(torch.int32)
    e = e.clamp(min=1)
    d = (20 + (121 - e).clamp(min=0)).clamp(max=25)
    r = (m + ((torch.ones_like(d) << (d - 1)) - 1) + ((m >> d) & 1)) >> d
    code = torch.where(e >= 121, ((e - 120) << 3) + r - 8, r).clamp(max=0x7E)
    return torch.where(b < 0, code | 0x80, code)


def code_to_e4m3(code: torch.Tensor) -> torch.Tensor:
    return code.to(torch.uint8).view(E4M3)


def fp8_scale(amax: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    """fp32 dequantization scale of blocks with fp32 ``amax``: max(amax, floor) / 448 (one IEEE
    division); ue8m0: rounded up to a power of two on the bits."""
    floor = torch.tensor(order.current().fp8_amax_floor, dtype=torch.float32, device=amax.device)
    s = torch.maximum(amax, floor) / 448.0
    if ue8m0:
        b = s.view(torch.int32)
        s = torch.where((b & 0x7FFFFF) != 0, (b & 0x7F800000) + 0x800000, b).view(torch.float32)
    return s


def _check_finite(op: str, name: str, t: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    msg = f"{op}: {name} holds inf or NaN; FP8 quantization needs finite values (a block's amax sets its scale)"
    if host_readable(t):
        if t.numel() and not bool(torch.isfinite(t).all()):
            raise ValueError(msg)
    elif scale is not None and scale.numel():
        check_on_device(torch.isfinite(scale).all(), msg)


def _check_fmt(op: str, scale_fmt) -> bool:
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"{op}: scale_fmt={scale_fmt!r} is not supported; use 'float' (fp32 scales) or 'ue8m0' "
                         "(power-of-two scales)")
    return scale_fmt == "ue8m0"


def _blocks_reference(w3d: torch.Tensor, ue8m0: bool):
    E, N, K = w3d.shape
    NB, KB = -(-N // GROUP), -(-K // GROUP)
    x = torch.nn.functional.pad(w3d.float(), (0, KB * GROUP - K, 0, NB * GROUP - N))
    x = x.view(E, NB, GROUP, KB, GROUP)
    s = fp8_scale(x.abs().amax(dim=(2, 4)), ue8m0)                      # [E, NB, KB]
    q = e4m3_code(x / s[:, :, None, :, None]).view(E, NB * GROUP, KB * GROUP)[:, :N, :K]
    return code_to_e4m3(q), s


def _groups_reference(x2d: torch.Tensor, ue8m0: bool):
    M, K = x2d.shape
    G = -(-K // GROUP)
    x = torch.nn.functional.pad(x2d.float(), (0, G * GROUP - K)).view(M, G, GROUP)
    s = fp8_scale(x.abs().amax(dim=-1), ue8m0)                           # [M, G]
    return code_to_e4m3(e4m3_code(x / s[..., None]).view(M, G * GROUP)[:, :K]), s


# ---------------------------------------------------------------- quantizers
def quantize_fp8_blocks(w: torch.Tensor, block=BLOCK, scale_fmt: str = "float"):
    """``w`` [..., N, K] (bf16 / fp32) -> (q float8_e4m3fn [..., N, K], scale fp32
    [..., ceil(N/128), ceil(K/128)]) with ``w ~ q * scale`` per 128 x 128 block.

    Invariance: the bytes depend only on the block's values, the same on every backend and device."""
    op = "quantize_fp8_blocks"
    check_float("w", w, op)
    if tuple(block) != BLOCK:
        raise ValueError(f"{op}: block={tuple(block)} is not supported; only (128, 128) (DeepSeek's FP8 format)")
    ue8m0 = _check_fmt(op, scale_fmt)
    if w.dim() < 2:
        raise ValueError(f"{op}: w must be [..., N, K], got shape {tuple(w.shape)}")
    *lead, N, K = w.shape
    w3d = w.detach().reshape(-1, N, K).contiguous()
    with torch.no_grad():
        if backend_for(w3d) == "reference":
            _check_finite(op, "w", w3d)
            q, s = _blocks_reference(w3d, ue8m0)
        else:
            q, s = triton_impl("fp8", "quantize_blocks")(w3d, ue8m0)
            _check_finite(op, "w", w3d, s)
    return q.reshape(w.shape), s.reshape(*lead, s.shape[-2], s.shape[-1])


def _quantize_rows(x2d, ue8m0, op, name):
    with torch.no_grad():
        if backend_for(x2d) == "reference":
            _check_finite(op, name, x2d)
            return _groups_reference(x2d, ue8m0)
        q, s = triton_impl("fp8", "quantize_groups")(x2d, ue8m0)
        _check_finite(op, name, x2d, s)
        return q, s


def quantize_fp8_groups(x: torch.Tensor, group: int = GROUP, scale_fmt: str = "float"):
    """``x`` [..., K] (bf16 / fp32) -> (q float8_e4m3fn [..., K], scale fp32 [..., ceil(K/128)]):
    one scale per token and 128-wide K group (the activations of W8A8).

    Invariance: each row's codes and scales depend only on that row, on every backend."""
    op = "quantize_fp8_groups"
    check_float("x", x, op)
    if group != GROUP:
        raise ValueError(f"{op}: group={group} is not supported; only 128 (the K width of a weight block)")
    ue8m0 = _check_fmt(op, scale_fmt)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{op}: x must be [..., K] with K >= 1, got shape {tuple(x.shape)}")
    K = x.shape[-1]
    q, s = _quantize_rows(x.detach().reshape(-1, K).contiguous(), ue8m0, op, "x")
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], s.shape[-1])


def dequantize_fp8_blocks(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``q * scale`` per 128 x 128 block in fp32, cast to ``dtype`` (the backward's weight; not invariant)."""
    N, K = q.shape[-2:]
    s = scale.float().repeat_interleave(GROUP, -2)[..., :N, :].repeat_interleave(GROUP, -1)[..., :K]
    return (q.float() * s).to(dtype)


# ---------------------------------------------------------------- linear
def fp8_linear_reference(xq, sx, wq, sw, bias, dtype):
    """The reference order: exact float64 group dots, scaled in float64, added in kb order."""
    M, K = xq.shape
    N, G = wq.shape[0], sx.shape[1]
    pad = G * GROUP - K
    x64 = torch.nn.functional.pad(xq.to(F64), (0, pad)).view(M, G, GROUP)
    sx64 = sx.to(F64)
    outs = []
    for n0 in range(0, N, _N_CHUNK):
        n1 = min(N, n0 + _N_CHUNK)
        w64 = torch.nn.functional.pad(wq[n0:n1].to(F64), (0, pad)).view(n1 - n0, G, GROUP)
        sw64 = sw.to(F64).repeat_interleave(GROUP, 0)[n0:n1]             # [n, G]: row n's block scales
        acc = torch.zeros(M, n1 - n0, dtype=F64, device=xq.device)
        for kb in range(G):
            part = x64[:, kb] @ w64[:, kb].T                              # exact: integers below 2**53 units
            acc = acc + part * (sx64[:, kb, None] * sw64[None, :, kb])
        if bias is not None:
            acc = acc + bias[n0:n1].to(F64)
        outs.append(acc.to(dtype))
    return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]


def _forward(x2d, weight_q, weight_scale, bias, ue8m0):
    xq, sx = _quantize_rows(x2d, ue8m0, "fp8_linear", "x")
    if backend_for(x2d) == "reference":
        return fp8_linear_reference(xq, sx, weight_q, weight_scale, bias, x2d.dtype)
    return triton_impl("fp8", "linear")(xq, sx, weight_q, weight_scale, bias, x2d.dtype)


class FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight_q, weight_scale, bias, master, ue8m0):
        ctx.save_for_backward(x2d, weight_q, weight_scale, master)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _forward(x2d, weight_q, weight_scale, bias, ue8m0)

    @staticmethod
    def backward(ctx, g):
        # straight through both quantizers, stock matmuls (correct, not invariant), in x's dtype
        x2d, wq, sw, master = ctx.saved_tensors
        gc = g.to(x2d.dtype)
        gx = gc @ dequantize_fp8_blocks(wq, sw, x2d.dtype) if ctx.needs_input_grad[0] else None
        gb = g.float().sum(0).to(ctx.bias_dtype) if ctx.bias_dtype is not None and ctx.needs_input_grad[3] else None
        gw = (gc.t() @ x2d).to(master.dtype) if master is not None and ctx.needs_input_grad[4] else None
        return gx, None, None, gb, gw, None


def _check_linear(op, x, weight_q, weight_scale, bias):
    check_float("x", x, op)
    if not isinstance(weight_q, torch.Tensor) or weight_q.dtype != E4M3:
        got = weight_q.dtype if isinstance(weight_q, torch.Tensor) else type(weight_q).__name__
        raise ValueError(f"{op}: weight_q must be a float8_e4m3fn tensor, got {got}; quantize a bf16 / fp32 weight "
                         "with quantize_fp8_blocks, or call fp8_linear_master")
    if weight_q.dim() != 2:
        raise ValueError(f"{op}: weight_q must be 2-D [N, K], got shape {tuple(weight_q.shape)}")
    N, K = weight_q.shape
    want = (-(-N // GROUP), -(-K // GROUP))
    if not isinstance(weight_scale, torch.Tensor) or weight_scale.dtype != torch.float32:
        raise ValueError(f"{op}: weight_scale must be a float32 tensor (e8m0 bytes: convert them to 2**(b - 127) "
                         "in float32 first)")
    if tuple(weight_scale.shape) != want:
        raise ValueError(f"{op}: weight_scale has shape {tuple(weight_scale.shape)}; a {N}x{K} weight in 128x128 "
                         f"blocks needs {want}")
    if x.shape[-1] != K:
        raise ValueError(f"{op}: x's last dim {x.shape[-1]} != weight_q's K {K}")
    if bias is not None:
        check_float("bias", bias, op)
        if bias.shape != (N,):
            raise ValueError(f"{op}: bias must have shape ({N},), got {tuple(bias.shape)}")
    check_same_device(op, x=x, weight_q=weight_q, weight_scale=weight_scale, bias=bias)


def fp8_linear(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, *, scale_fmt: str = "float") -> torch.Tensor:
    """``x [..., K]`` (bf16 / fp32) quantized per token and 128-wide group (``scale_fmt``) times the
    block-FP8 weight ``weight_q [N, K]`` (float8_e4m3fn) with ``weight_scale`` fp32
    [ceil(N/128), ceil(K/128)], + bias, in x's dtype; x's gradient passes straight through.

    Invariance: each output row's bits depend only on that row of x, the weight and the bias."""
    op = "fp8_linear"
    ue8m0 = _check_fmt(op, scale_fmt)
    _check_linear(op, x, weight_q, weight_scale, bias)
    N, K = weight_q.shape
    lead = x.shape[:-1]
    x2d = x.reshape(-1, K).contiguous()
    wq, sw = weight_q.contiguous(), weight_scale.contiguous()
    if needs_autograd(x, bias):
        out = FP8LinearFunction.apply(x2d, wq, sw, bias, None, ue8m0)
    else:
        out = _forward(x2d, wq, sw, bias, ue8m0)
    return out.reshape(*lead, N)


def fp8_linear_master(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                      scale_fmt: str = "float") -> torch.Tensor:
    """The trainer's ``fp8_linear``: the master ``weight [N, K]`` (bf16 / fp32) quantized by
    ``quantize_fp8_blocks`` (the bytes a weight sync ships), then ``fp8_linear``; gradients to x and
    the master weight pass straight through the quantizers (grad_w = g^T x).

    Invariance: each output row's bits depend only on that row of x, the weight and the bias, and
    equal ``fp8_linear`` on ``quantize_fp8_blocks(weight)``'s bytes."""
    op = "fp8_linear_master"
    check_operands(op, x, weight)
    check_same_device(op, x=x, weight=weight)
    ue8m0 = _check_fmt(op, scale_fmt)
    wq, sw = quantize_fp8_blocks(weight, scale_fmt=scale_fmt)
    _check_linear(op, x, wq, sw, bias)
    N, K = wq.shape
    x2d = x.reshape(-1, K).contiguous()
    if needs_autograd(x, weight, bias):
        out = FP8LinearFunction.apply(x2d, wq, sw, bias, weight, ue8m0)
    else:
        out = _forward(x2d, wq, sw, bias, ue8m0)
    return out.reshape(*x.shape[:-1], N)


__all__ = ["quantize_fp8_blocks", "quantize_fp8_groups", "dequantize_fp8_blocks", "fp8_linear",
           "fp8_linear_master", "fp8_linear_reference", "e4m3_code", "fp8_scale", "FP8LinearFunction"]

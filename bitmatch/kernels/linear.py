"""linear: x @ weight^T (+ bias), row-invariant.

Reference: ``exact_matmul`` (rows on integer grids, exact float64 products and sums) then
one rounding to x's dtype, so a row's bits depend on that row and the weight alone.
Triton: sequential fp32 accumulation over fixed K blocks (tile shape free per M).
"""
from __future__ import annotations

import torch

from . import _exact
from ._backend import backend_for, check_float, check_same_device, triton_impl

_N_CHUNK = 8192  # bounds float64 scratch; output columns are independent, so bits do not change


def linear_reference(x2d, weight, bias):
    outs = []
    s_x, s_w = _exact.slices_for(x2d.dtype), _exact.slices_for(weight.dtype)
    for n0 in range(0, weight.shape[0], _N_CHUNK):
        acc = _exact.exact_matmul(x2d, weight[n0:n0 + _N_CHUNK], s_x, s_w)
        if bias is not None:
            acc = acc + bias[n0:n0 + _N_CHUNK].to(torch.float64)
        outs.append(acc.to(x2d.dtype))
    return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]


def _forward(x2d, weight, bias, segments=None, rows_of=None):
    if backend_for(x2d) == "reference":
        # exact products and sums, one rounding per element: any column split gives the same bits
        return linear_reference(x2d, weight, bias)
    if segments is not None:
        return triton_impl("linear", "linear_segments")(x2d, weight, bias, segments)
    if rows_of is not None:  # a row slice runs the whole weight's canonical K split
        split = triton_impl("linear", "split_for")(rows_of, weight.shape[1])
        return triton_impl("linear", "linear")(x2d, weight, bias, split=split)
    return triton_impl("linear", "linear")(x2d, weight, bias)


def check_operands(op: str, x, weight) -> None:
    """x [..., K] and a 2-D float weight [N, K] (a master weight, for ``fp8_linear_master`` too)."""
    check_float("x", x, op)
    check_float("weight", weight, op)
    if weight.dim() != 2:
        raise ValueError(f"{op}: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: x's last dim {x.shape[-1]} != weight's K {weight.shape[1]}")


class LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, segments=None, rows_of=None):
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias = bias is not None
        return _forward(x2d, weight, bias, segments, rows_of)

    @staticmethod
    def backward(ctx, g):
        # gradients need only be correct, not invariant: the stock matmuls. In the operands'
        # own dtype when x and weight share it (bf16 GEMMs accumulate in fp32 and round once,
        # as the fp32 path would; an fp32 upcast made the GPU training step 10x slower)
        x2d, weight = ctx.saved_tensors
        ct = x2d.dtype if x2d.dtype == weight.dtype else torch.float32
        gc = g.to(ct)
        gx = (gc @ weight.to(ct)).to(x2d.dtype) if ctx.needs_input_grad[0] else None
        gw = (gc.t() @ x2d.to(ct)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        gb = g.float().sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           segments: tuple[int, ...] | None = None, rows_of: int | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K]^T + bias`` in x's dtype.

    ``segments``: ``weight`` is the row concatenation of weights of these N sizes (fused q/k/v,
    gate/up); each segment's output columns then get exactly the bits of ``linear`` on that
    segment's weight alone (its own K-split of the canonical order; the Triton kernel accumulates
    K in a fixed order per output element whatever N is: tests/test_fused_proj.py).
    ``rows_of``: ``weight`` is a row slice (a tensor-parallel rank's output rows) of a weight of
    ``rows_of`` rows; its columns get exactly that weight's bits (its K split, not the slice's).
    Invariance: each output row's bits depend only on that row of x, weight and bias.
    """
    op = "linear"
    if segments is not None:
        segments = tuple(int(n) for n in segments)
        if not segments or min(segments) < 1 or sum(segments) != weight.shape[0]:
            raise ValueError(f"{op}: segments {segments} must be positive sizes summing to weight's N "
                             f"{weight.shape[0]}")
    if rows_of is not None and (segments is not None or not isinstance(rows_of, int) or rows_of < weight.shape[0]):
        raise ValueError(f"{op}: rows_of must be an int >= weight's N {weight.shape[0]} (and not with segments), "
                         f"got {rows_of!r}")
    check_operands(op, x, weight)
    if bias is not None:
        check_float("bias", bias, op)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"{op}: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    check_same_device(op, x=x, weight=weight, bias=bias)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1 or backend_for(x2d) != "triton":
        # the Triton kernel reads rows at any row stride (a column slice, e.g. one group of
        # V4's grouped output projection, costs no copy); the bits are the contiguous copy's
        x2d = x2d.contiguous()
    out = LinearFunction.apply(x2d, weight.contiguous(), bias, segments, rows_of)
    return out.reshape(*lead, weight.shape[0])

"""Arithmetic whose bits cannot depend on the launch: the CPU reference's building blocks.

Why this file exists: on CPU, torch's reductions and BLAS pick their summation order by
shape and thread count, and its vectorized transcendental functions take a different code
path for the tail of a buffer than for the body. So the reference backend uses only:

* elementwise IEEE operations (+, -, *, /, sqrt, round), which are correctly rounded on
  every code path, so each element's bits depend on that element's inputs alone;
* ``exp64``/``log64``/``sincos64`` written with those operations (no libm, no Sleef);
* ``tree_sum``: a fixed fold-in-halves tree over a zero-padded power-of-two width. With zero
  padding the first folds add exact zeros, so the bits do not depend on the padded width,
  only on the values and their positions;
* ``exact_matmul``: rows quantized to integers on a per-row power-of-two grid, multiplied in
  float64 where every partial sum is an integer below 2**53, hence exact: BLAS may block,
  thread and order the sum any way it likes and the result is the same.
"""
from __future__ import annotations

import math

import torch

from . import order

F64 = torch.float64

# Cody-Waite constants (fdlibm): the high parts have trailing zero bits so n * HI is exact.
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
_PIO2_1 = 1.57079632673412561417e00
_PIO2_2 = 6.07710050630396597660e-11
_PIO2_3 = 2.02226624871116645580e-21
_TWO_OVER_PI = 6.36619772367581382433e-01

_EXP_COEF = [1.0 / math.factorial(i) for i in range(14)]
_SIN_COEF = [(-1) ** i / math.factorial(2 * i + 1) for i in range(9)]
_COS_COEF = [(-1) ** i / math.factorial(2 * i) for i in range(9)]


def two_pow(n: torch.Tensor) -> torch.Tensor:
    """2**n as float64 for integer tensor n in [-1022, 1023], built from the bits (exact)."""
    n = n.to(torch.int64).clamp(-1022, 1023)
    return ((n + 1023) << 52).view(F64)


def _horner(x: torch.Tensor, coef: list[float]) -> torch.Tensor:
    p = torch.full_like(x, coef[-1])
    for c in reversed(coef[:-1]):
        p = p * x
        p = p + c
    return p


def exp64(x: torch.Tensor) -> torch.Tensor:
    """exp of a float64 tensor, about 1 ulp, from elementwise IEEE ops only."""
    n = torch.round(x.clamp(-745.0, 710.0) * _INV_LN2)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = _horner(r, _EXP_COEF)
    # split the scale so exponents down to -1074 stay representable
    n_i = n.to(torch.int64)
    half = torch.div(n_i, 2, rounding_mode="floor")
    y = p * two_pow(half) * two_pow(n_i - half)
    y = torch.where(x < -745.0, torch.zeros_like(y), y)
    y = torch.where(x > 709.78, torch.full_like(y, math.inf), y)
    return torch.where(torch.isnan(x), x, y)


def log64(y: torch.Tensor) -> torch.Tensor:
    """Natural log of a positive float64 tensor, about 1 ulp, from elementwise IEEE ops."""
    m, e = torch.frexp(y)  # y = m * 2**e, m in [0.5, 1): exact
    small = m < 0.7071067811865476
    m = torch.where(small, m * 2.0, m)
    e = torch.where(small, e - 1, e).to(F64)
    f = (m - 1.0) / (m + 1.0)
    s = f * f
    series = _horner(s, [1.0 / (2 * k + 1) for k in range(13)])
    log_m = (f * 2.0) * series
    out = e * _LN2_HI + (e * _LN2_LO + log_m)
    out = torch.where(y == 0, torch.full_like(out, -math.inf), out)
    out = torch.where(y < 0, torch.full_like(out, math.nan), out)
    return torch.where(torch.isinf(y) & (y > 0), y, out)


def log1p64(y):
    """log(1 + y) for float64 y >= 0, accurate for tiny y (Goldberg's trick, elementwise)."""
    u = 1.0 + y
    return torch.where(u == 1.0, y, log64(u) * (y / (u - 1.0)))


def sincos64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin, cos) of float64 angles |x| < 1.6e6, about 1 ulp, from elementwise IEEE ops."""
    if x.numel() and float(x.abs().max()) >= 1.6e6:
        raise ValueError("rotary angle too large for the exact range reduction (|x| >= 1.6e6)")
    k = torch.round(x * _TWO_OVER_PI)
    r = ((x - k * _PIO2_1) - k * _PIO2_2) - k * _PIO2_3
    r2 = r * r
    s = r * _horner(r2, _SIN_COEF)
    c = _horner(r2, _COS_COEF)
    q = torch.remainder(k.to(torch.int64), 4)
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sin, cos


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` by folding in halves over a zero-padded power-of-two width.

    Entries beyond the real length are exact zeros, so the result is the same for any
    padded width: a token's sum does not depend on how long its neighbours are.
    """
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0] + 0.0  # + 0.0 turns a -0.0 total into +0.0 whatever the fold order


# The integer grid (|integer| <= 2**exact_grid_bits, 20: a product is <= 2**40) and the K chunk
# (exact_k_chunk, 4096: a chunk's sum of products stays below 2**53, exact in float64) are fields
# of the canonical order (kernels/order.py), read at every call so ``order.override`` and the
# stamp agree: ``grid_bits()`` / ``k_chunk()`` for other reference ops.
def grid_bits() -> int:
    return order.current().exact_grid_bits


def k_chunk() -> int:
    return order.current().exact_k_chunk


def quantize_rows(x: torch.Tensor, slices: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Split each row of ``x`` into ``slices`` integer-valued float64 tensors on the grid
    2**(e - 20*(i+1)), e the row's max exponent. Depends on the row alone."""
    bits = order.current().exact_grid_bits
    x = x.to(F64)
    amax = x.abs().amax(dim=-1, keepdim=True)
    _, e = torch.frexp(amax)  # amax < 2**e
    e = torch.where(amax == 0, torch.zeros_like(e), e).to(torch.int64)
    v = x * two_pow(bits - e)
    parts = []
    for i in range(slices):
        q = torch.round(v)
        parts.append(q)
        v = (v - q) * float(2**bits)  # exact: the remainder of a round is representable
    return parts, e


def matmul_exact_ints(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b[..., N, K]^T of integer-valued float64 tensors, K chunks of 4096
    (fixed from k = 0) added in order: each chunk's product is exact."""
    k, chunk = a.shape[-1], order.current().exact_k_chunk
    out = None
    for s in range(0, k, chunk):
        part = torch.matmul(a[..., s:s + chunk], b[..., s:s + chunk].transpose(-1, -2))
        out = part if out is None else out + part
    return out


def exact_matmul(a: torch.Tensor, b: torch.Tensor, a_slices: int = 1, b_slices: int = 1) -> torch.Tensor:
    """float64 a @ b^T where a's rows and b's rows are each quantized on their own grid.

    a: [..., M, K], b: [..., N, K] (leading dims broadcast as in torch.matmul). Each output
    element depends only on its row of a and its row of b, never on M, N, threads or BLAS.
    Exact for bf16 values within 2**-12 of their row's max (1 slice) and for fp32 values
    within 2**-16 (2 slices); smaller values are rounded to the row grid.
    """
    bits = order.current().exact_grid_bits
    qa, ea = quantize_rows(a, a_slices)
    qb, eb = quantize_rows(b, b_slices)
    acc = None
    # combine slice products from the smallest weight up, in a fixed order
    terms = sorted(((i + j, i, j) for i in range(a_slices) for j in range(b_slices)), reverse=True)
    for weight, i, j in terms:
        t = matmul_exact_ints(qa[i], qb[j]) * float(2.0 ** (-bits * weight))
        acc = t if acc is None else acc + t
    scale_a = two_pow(ea - bits)                    # [..., M, 1]
    scale_b = two_pow(eb - bits).transpose(-1, -2)  # [..., 1, N]
    return acc * scale_a * scale_b


def slices_for(dtype: torch.dtype) -> int:
    return 1 if dtype == torch.bfloat16 else 2

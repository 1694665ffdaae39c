"""categorical_sample: the inverse-CDF draw over exact int64 weights, one program per row.

Same tokens, bit for bit, as ``kernels.sampling.categorical_sample_reference`` (torch, any
device) for the same logits, T and uniforms. Why the bits agree:

- ``z = div_rn(float(x), T)``: IEEE division, as torch's ``/`` (Triton's plain fp32 ``/`` is
  not correctly rounded); the row max of fp32 values is exact in any order.
- ``w = round(exp64(z - max) * 2**b)``: ``_exp64`` below is ``_exact.exp64`` op for op in
  float64 (the same Cody-Waite split, Horner steps, power-of-two scaling and edge cases), and
  the kernel is launched with ``enable_fp_fusion=False`` so no multiply-add is contracted into
  an FMA (an FMA rounds once where the reference rounds twice). ``round`` is half-to-even
  (torch.round) by the 1.5 * 2**52 trick, exact for |x| < 2**51 (|x| < 2**45 here).
- The row's total and the prefix sums are int64: exact, so the block walk and the in-block scan
  order cannot matter. ``r = trunc(u * float64(W))`` (u * W >= 0, so trunc = floor), clamped to
  [0, W - 1]; the token is the count of entries whose inclusive prefix sum is <= r (= the
  first whose prefix exceeds r, torch.searchsorted(right=True)).

Passes over the row: (1) max of z (greedy rows: argmax of the raw logits, lowest index on
ties, and stop); (2) the weights' per-block sums, kept in registers; (3) the block holding r,
found from those sums, scanned once more. BLOCK and warps are speed knobs only.
VARIANT != 0 selects deliberately wrong formulas for the tests' controls (1: z = x * (1/T);
2: exp64 with one Horner term fewer); never used by the library.
"""
import torch
import triton
import triton.language as tl

from . import interpreting

BLOCK_V = 2048

# _exact.py's constants (fdlibm Cody-Waite split of ln 2, Taylor coefficients 1/i!), as float64
_LN2_HI = tl.constexpr(6.93147180369123816490e-01)
_LN2_LO = tl.constexpr(1.90821492927058770002e-10)
_INV_LN2 = tl.constexpr(1.44269504088896338700e00)
_RND = tl.constexpr(6755399441055744.0)  # 1.5 * 2**52: x + _RND - _RND rounds x half-to-even
_C2 = tl.constexpr(1.0 / 2)
_C3 = tl.constexpr(1.0 / 6)
_C4 = tl.constexpr(1.0 / 24)
_C5 = tl.constexpr(1.0 / 120)
_C6 = tl.constexpr(1.0 / 720)
_C7 = tl.constexpr(1.0 / 5040)
_C8 = tl.constexpr(1.0 / 40320)
_C9 = tl.constexpr(1.0 / 362880)
_C10 = tl.constexpr(1.0 / 3628800)
_C11 = tl.constexpr(1.0 / 39916800)
_C12 = tl.constexpr(1.0 / 479001600)
_C13 = tl.constexpr(1.0 / 6227020800)


@triton.jit
def _rint(x):
    return (x + _RND) - _RND


@triton.jit
def _two_pow(n):
    n = tl.minimum(tl.maximum(n, -1022), 1023)
    return ((n + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _exp64(x, VARIANT: tl.constexpr):
    """_exact.exp64, op for op (float64 in, float64 out)."""
    n = _rint(tl.minimum(tl.maximum(x, -745.0), 710.0) * _INV_LN2)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    if VARIANT == 2:
        p = tl.full(r.shape, _C12, tl.float64)
    else:
        p = tl.full(r.shape, _C13, tl.float64)
        p = p * r
        p = p + _C12
    p = p * r
    p = p + _C11
    p = p * r
    p = p + _C10
    p = p * r
    p = p + _C9
    p = p * r
    p = p + _C8
    p = p * r
    p = p + _C7
    p = p * r
    p = p + _C6
    p = p * r
    p = p + _C5
    p = p * r
    p = p + _C4
    p = p * r
    p = p + _C3
    p = p * r
    p = p + _C2
    p = p * r
    p = p + 1.0
    p = p * r
    p = p + 1.0
    n_i = n.to(tl.int64)
    half = n_i >> 1  # arithmetic shift: floor(n / 2), as torch.div(..., rounding_mode="floor")
    y = p * _two_pow(half) * _two_pow(n_i - half)
    y = tl.where(x < -745.0, 0.0, y)
    y = tl.where(x > 709.78, float("inf"), y)
    return tl.where(x != x, x, y)


@triton.jit
def _scaled(x_ptr, cols, V, t, VARIANT: tl.constexpr):
    x = tl.load(x_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    if VARIANT == 1:
        return x * (1.0 / t)
    return tl.math.div_rn(x, t)


@triton.jit
def _weights(x_ptr, cols, V, t, m, SCALE: tl.constexpr, VARIANT: tl.constexpr):
    z = _scaled(x_ptr, cols, V, t, VARIANT)
    e = _exp64(z.to(tl.float64) - m.to(tl.float64), VARIANT)
    w = _rint(e * SCALE).to(tl.int64)
    return tl.where(cols < V, w, 0)


@triton.jit
def _categorical_kernel(x_ptr, stride, t_ptr, u_ptr, g_ptr, out_ptr, w_ptr, V,
                        SCALE: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
                        HAS_GREEDY: tl.constexpr, STORE_W: tl.constexpr, VARIANT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride
    offs = tl.arange(0, BLOCK)
    greedy = 0
    if HAS_GREEDY:
        greedy = tl.load(g_ptr + row).to(tl.int32)
    t = tl.load(t_ptr + row)
    t = tl.where(greedy != 0, 1.0, t)  # greedy: argmax of logits.float() itself, whatever T says
    # pass 1: per-lane max and its first column (strict >: each lane keeps its first maximum)
    m_vec = tl.full((BLOCK,), float("-inf"), tl.float32)
    i_vec = tl.zeros((BLOCK,), tl.int64)
    for v0 in range(0, V, BLOCK):
        cols = v0 + offs
        z = _scaled(x_row, cols, V, t, VARIANT)
        better = z > m_vec
        m_vec = tl.where(better, z, m_vec)
        i_vec = tl.where(better, cols.to(tl.int64), i_vec)
    m = tl.max(m_vec, axis=0)
    if greedy != 0:
        # lowest column among the lanes holding the max (a row of -inf: column 0, as argmax)
        tl.store(out_ptr + row, tl.min(tl.where(m_vec == m, i_vec, V), axis=0).to(tl.int64))
    else:
        # pass 2: exact int64 block sums of the weights, kept in a register vector
        bidx = tl.arange(0, NB)
        sums = tl.zeros((NB,), tl.int64)
        for v0 in range(0, V, BLOCK):
            cols = v0 + offs
            w = _weights(x_row, cols, V, t, m, SCALE, VARIANT)
            if STORE_W:  # test hook: the weights themselves, to compare with the reference's
                tl.store(w_ptr + row * V + cols, w, mask=cols < V)
            sums = tl.where(bidx == v0 // BLOCK, tl.sum(w, axis=0), sums)
        total = tl.sum(sums, axis=0)
        u = tl.load(u_ptr + row)
        r = (u * total.to(tl.float64)).to(tl.int64)  # u * W >= 0: truncation is floor
        r = tl.minimum(tl.maximum(r, 0), total - 1)  # u * W may round up to W when W > 2**53
        # pass 3: the block whose inclusive prefix first exceeds r, then the column inside it
        kb = tl.sum((tl.cumsum(sums, axis=0) <= r).to(tl.int32), axis=0)
        carry = tl.sum(tl.where(bidx < kb, sums, 0), axis=0)
        cols = kb * BLOCK + offs
        c = tl.cumsum(_weights(x_row, cols, V, t, m, SCALE, VARIANT), axis=0) + carry
        cnt = tl.sum(((c <= r) & (cols < V)).to(tl.int32), axis=0)
        tl.store(out_ptr + row, (kb * BLOCK + cnt).to(tl.int64))


def categorical_sample(logits, temperature, uniforms, greedy=None, bits=44, *, block=BLOCK_V,
                       return_weights=False, _variant=0, _fp_fusion=False):
    """int64 [N] tokens: ``categorical_sample_reference``'s, bit for bit (module docstring).

    logits [N, V] (bf16/fp32, unit column stride), temperature fp32 [N], uniforms float64 [N],
    greedy bool/int [N] or None, bits = the weight scale's exponent b. ``return_weights`` also
    returns the int64 [N, V] weights (test hook; greedy rows' entries are left unwritten).
    ``_variant`` / ``_fp_fusion``: the controls' wrong kernels (module docstring), tests only.
    """
    N, V = logits.shape
    dev = logits.device
    out = torch.empty((N,), device=dev, dtype=torch.int64)
    w = torch.zeros((N, V) if return_weights else (1,), device=dev, dtype=torch.int64)
    if N:
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        interp = interpreting(logits)
        t = temperature.to(device=dev, dtype=torch.float32).contiguous()
        u = uniforms.to(device=dev, dtype=torch.float64).contiguous()
        g = greedy.to(device=dev, dtype=torch.int8).contiguous() if greedy is not None else out
        nb = triton.next_power_of_2(triton.cdiv(V, block))
        kw = {} if interp else dict(num_warps=8, enable_fp_fusion=_fp_fusion)
        _categorical_kernel[(N,)](logits, logits.stride(0), t, u, g, out, w, V,
                                  SCALE=float(2 ** bits), BLOCK=block, NB=nb,
                                  HAS_GREEDY=greedy is not None, STORE_W=return_weights,
                                  VARIANT=_variant, **kw)
    return (out, w) if return_weights else out

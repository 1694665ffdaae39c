"""categorical_sample: the inverse-CDF draw over exact int64 weights; int_weights for top-p.

Same tokens, bit for bit, as ``kernels.sampling.categorical_sample_reference`` (torch, any
device) for the same logits, T and uniforms. Why the bits agree:

- ``z = div_rn(float(x), T)``: IEEE division, as torch's ``/`` (Triton's plain fp32 ``/`` is
  not correctly rounded); the row max of fp32 values is exact in any order.
- ``w = round(exp64(z - max) * 2**b)``: ``_exp64`` below is ``_exact.exp64`` op for op in
  float64 (the same Cody-Waite split, Horner steps, power-of-two scaling and edge cases), and
  the kernel is launched with ``enable_fp_fusion=False`` so no multiply-add is contracted into
  an FMA (an FMA rounds once where the reference rounds twice). ``round`` is half-to-even
  (torch.round) by adding and subtracting 1.5 * 2**52 (exp64's n, |n| < 1100) or 2**52 (a
  weight, 0 <= w <= 2**61: exact below 2**52, and above it every float64 is an integer).
- The row's total and the prefix sums are int64: exact, so the block walk and the in-block scan
  order cannot matter. ``r = trunc(u * float64(W))`` (u * W >= 0, so trunc = floor), clamped to
  [0, W - 1]; the token is the count of entries whose inclusive prefix sum is <= r (= the
  first whose prefix exceeds r, torch.searchsorted(right=True)).

Three launches, each row cut into S chunks of whole blocks (S chosen so that (row, chunk)
programs fill the GPU; S = 1 at large batch): (1) per chunk, the max of z and its lowest
column (greedy rows: of the raw logits); (2) per chunk, the int64 weight sum of each block,
from the row max (the max over chunks); (3) per row, the block holding r from those sums, then
the column inside it (one block's weights recomputed); greedy rows take the lowest column among
the chunks holding the max (torch.argmax's tie rule). BLOCK, S and warps never change a bit.
Outside the contract (as in the reference, whose int64 cast of NaN is undefined): NaN logits
and rows that are -inf everywhere on sampled rows; their token is unspecified but always in
[0, V) (clamped, as the reference clamps), so nothing downstream indexes past the vocabulary.
VARIANT != 0 selects deliberately wrong formulas for the tests' controls (1: z = x * (1/T);
2: exp64 with two Horner terms fewer, ~1e-14 off); never used by the library.
"""
import torch
import triton
import triton.language as tl

from . import interpreting, sm_count

BLOCK_V = 2048

# _exact.py's constants (fdlibm Cody-Waite split of ln 2, Taylor coefficients 1/i!), as float64
_LN2_HI = tl.constexpr(6.93147180369123816490e-01)
_LN2_LO = tl.constexpr(1.90821492927058770002e-10)
_INV_LN2 = tl.constexpr(1.44269504088896338700e00)
_RND = tl.constexpr(6755399441055744.0)  # 1.5 * 2**52: x + _RND - _RND rounds x half-to-even
_TWO52 = tl.constexpr(4503599627370496.0)
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
    return (x + _RND) - _RND  # |x| < 2**51 (exp64's n)


@triton.jit
def _rint_weight(x):
    # x >= 0, up to 2**61 (b = 62 - ceil(log2 V)): x + 2**52 rounds x half-to-even below 2**52;
    # from 2**52 up every float64 is an integer already
    return tl.where(x < _TWO52, (x + _TWO52) - _TWO52, x)


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
        p = tl.full(r.shape, _C11, tl.float64)
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
    w = _rint_weight(e * SCALE).to(tl.int64)
    return tl.where(cols < V, w, 0)


@triton.jit
def _row_setup(g_ptr, t_ptr, row, HAS_GREEDY: tl.constexpr):
    greedy = 0
    if HAS_GREEDY:
        greedy = tl.load(g_ptr + row).to(tl.int32)
    t = tl.load(t_ptr + row)
    return greedy, tl.where(greedy != 0, 1.0, t)  # greedy: argmax of logits.float(), whatever T


@triton.jit
def _chunk_max_kernel(x_ptr, stride, t_ptr, g_ptr, mx_ptr, ai_ptr, V, S, BPC,
                      BLOCK: tl.constexpr, HAS_GREEDY: tl.constexpr, VARIANT: tl.constexpr):
    # stage 1, program (row, chunk): max of z over the chunk's blocks and its lowest column
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    x_row = x_ptr + row * stride
    offs = tl.arange(0, BLOCK)
    greedy, t = _row_setup(g_ptr, t_ptr, row, HAS_GREEDY)
    m_vec = tl.full((BLOCK,), float("-inf"), tl.float32)
    i_vec = tl.zeros((BLOCK,), tl.int64)
    for b in range(s * BPC, s * BPC + BPC):
        cols = b * BLOCK + offs
        z = _scaled(x_row, cols, V, t, VARIANT)
        better = z > m_vec  # strict: each lane keeps its first maximum
        m_vec = tl.where(better, z, m_vec)
        i_vec = tl.where(better, cols.to(tl.int64), i_vec)
    m = tl.max(m_vec, axis=0)
    tl.store(mx_ptr + row * S + s, m)
    # a chunk of -inf reports column 0 with max -inf: it wins only if the whole row is -inf,
    # and then column 0 is torch.argmax's answer too
    tl.store(ai_ptr + row * S + s, tl.min(tl.where(m_vec == m, i_vec, V), axis=0).to(tl.int64))


@triton.jit
def _row_max(mx_ptr, row, S, SP: tl.constexpr):
    k = tl.arange(0, SP)
    return tl.max(tl.load(mx_ptr + row * S + k, mask=k < S, other=float("-inf")), axis=0)


@triton.jit
def _block_sums_kernel(x_ptr, stride, t_ptr, g_ptr, mx_ptr, bs_ptr, w_ptr, V, S, BPC, NBLK,
                       SCALE: tl.constexpr, BLOCK: tl.constexpr, SP: tl.constexpr,
                       HAS_GREEDY: tl.constexpr, STORE_W: tl.constexpr, VARIANT: tl.constexpr):
    # stage 2, program (row, chunk): the exact int64 weight sum of each block of the chunk
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    greedy, t = _row_setup(g_ptr, t_ptr, row, HAS_GREEDY)
    if greedy == 0:
        x_row = x_ptr + row * stride
        offs = tl.arange(0, BLOCK)
        m = _row_max(mx_ptr, row, S, SP)
        for b in range(s * BPC, tl.minimum(s * BPC + BPC, NBLK)):
            cols = b * BLOCK + offs
            w = _weights(x_row, cols, V, t, m, SCALE, VARIANT)
            if STORE_W:  # test hook: the weights themselves, to compare with the reference's
                tl.store(w_ptr + row * V + cols, w, mask=cols < V)
            tl.store(bs_ptr + row * NBLK + b, tl.sum(w, axis=0))


@triton.jit
def _pick_kernel(x_ptr, stride, t_ptr, u_ptr, g_ptr, mx_ptr, ai_ptr, bs_ptr, out_ptr, V, S, NBLK,
                 SCALE: tl.constexpr, BLOCK: tl.constexpr, SP: tl.constexpr, NB: tl.constexpr,
                 HAS_GREEDY: tl.constexpr, VARIANT: tl.constexpr):
    # stage 3, program per row: the block holding r (from the block sums), then its column
    row = tl.program_id(0).to(tl.int64)
    greedy, t = _row_setup(g_ptr, t_ptr, row, HAS_GREEDY)
    m = _row_max(mx_ptr, row, S, SP)
    if greedy != 0:
        k = tl.arange(0, SP)
        mk = tl.load(mx_ptr + row * S + k, mask=k < S, other=float("-inf"))
        ak = tl.load(ai_ptr + row * S + k, mask=k < S, other=V)
        # NaN max: no chunk equals it and the min is V; clamped into the vocabulary (contract)
        tok = tl.min(tl.where((mk == m) & (k < S), ak, V), axis=0)
        tl.store(out_ptr + row, tl.minimum(tok, V - 1).to(tl.int64))
    else:
        bidx = tl.arange(0, NB)
        sums = tl.load(bs_ptr + row * NBLK + bidx, mask=bidx < NBLK, other=0)
        total = tl.sum(sums, axis=0)
        u = tl.load(u_ptr + row)
        r = (u * total.to(tl.float64)).to(tl.int64)  # u * W >= 0: truncation is floor
        r = tl.minimum(tl.maximum(r, 0), total - 1)  # u * W may round up to W when W > 2**53
        kb = tl.sum((tl.cumsum(sums, axis=0) <= r).to(tl.int32), axis=0)
        carry = tl.sum(tl.where(bidx < kb, sums, 0), axis=0)
        cols = kb * BLOCK + tl.arange(0, BLOCK)
        c = tl.cumsum(_weights(x_ptr + row * stride, cols, V, t, m, SCALE, VARIANT), axis=0) + carry
        cnt = tl.sum(((c <= r) & (cols < V)).to(tl.int32), axis=0)
        # valid weights give r < W, so the token is < V; garbage weights (NaN / +inf in z) may walk
        # past the last block: clamped into the vocabulary as the reference's searchsorted is
        tl.store(out_ptr + row, tl.minimum(kb * BLOCK + cnt, V - 1).to(tl.int64))


@triton.jit
def _int_weights_kernel(z_ptr, zs, m_ptr, ms, w_ptr, V, SCALE: tl.constexpr, BLOCK: tl.constexpr,
                        RAW: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    z = tl.load(z_ptr + row * zs + cols, mask=cols < V, other=float("-inf"))
    e = _exp64(z.to(tl.float64) - tl.load(m_ptr + row * ms).to(tl.float64), 0)
    if RAW:  # test hook: exp64 itself, float64
        tl.store(w_ptr + row * V + cols, e, mask=cols < V)
    else:
        tl.store(w_ptr + row * V + cols, _rint_weight(e * SCALE).to(tl.int64), mask=cols < V)


def int_weights(z, zmax, bits, *, block=1024, _raw_exp=False, _fp_fusion=False):
    """int64 [N, V] ``round(exp64(z - zmax) * 2**bits)`` for fp32 z [N, V] and zmax [N, 1]:
    ``kernels.sampling._int_weights``' bits, elementwise (top-p's weights over sorted rows).
    ``_raw_exp`` returns float64 ``exp64(z - zmax)`` instead and ``_fp_fusion`` compiles with FMA
    contraction (test hooks: the bits of exp64 itself, and the FMA control)."""
    N, V = z.shape
    w = torch.empty((N, V), device=z.device, dtype=torch.float64 if _raw_exp else torch.int64)
    if N and V:
        z = z if z.stride(1) == 1 else z.contiguous()
        interp = interpreting(z)
        _int_weights_kernel[(N, triton.cdiv(V, block))](
            z, z.stride(0), zmax, zmax.stride(0), w, V, SCALE=float(2 ** bits), BLOCK=block, RAW=_raw_exp,
            **({} if interp else dict(num_warps=4, enable_fp_fusion=_fp_fusion)))
    return w


def _chunks(n, nblk, device, split):
    """(S, blocks per chunk): enough (row, chunk) programs to fill the GPU; a speed knob only
    (the max is exact and the sums are integers, so the split never changes a bit)."""
    if split is None:
        split = max(1, -(-2 * sm_count(device) // n))
    bpc = -(-nblk // max(1, min(split, nblk)))
    return -(-nblk // bpc), bpc


def categorical_sample(logits, temperature, uniforms, greedy=None, bits=44, *, block=BLOCK_V,
                       split=None, return_weights=False, _variant=0, _fp_fusion=False):
    """int64 [N] tokens: ``categorical_sample_reference``'s, bit for bit (module docstring).

    logits [N, V] (bf16/fp32), temperature fp32 [N], uniforms float64 [N], greedy bool/int [N]
    or None, bits = the weight scale's exponent b. ``block`` / ``split`` (chunks per row) are
    speed knobs. ``return_weights`` also returns the int64 [N, V] weights (test hook; greedy rows'
    entries stay 0). ``_variant`` / ``_fp_fusion``: the controls' wrong kernels, tests only.
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
        nblk = triton.cdiv(V, block)
        S, bpc = _chunks(N, nblk, dev, split)
        mx = torch.empty((N, S), device=dev, dtype=torch.float32)
        ai = torch.empty((N, S), device=dev, dtype=torch.int64)
        bs = torch.empty((N, nblk), device=dev, dtype=torch.int64)
        kw = {} if interp else dict(num_warps=8, enable_fp_fusion=_fp_fusion)
        common = dict(BLOCK=block, HAS_GREEDY=greedy is not None, VARIANT=_variant, **kw)
        sp = triton.next_power_of_2(S)
        xs = logits.stride(0)
        _chunk_max_kernel[(N, S)](logits, xs, t, g, mx, ai, V, S, bpc, **common)
        _block_sums_kernel[(N, S)](logits, xs, t, g, mx, bs, w, V, S, bpc, nblk, SCALE=float(2 ** bits),
                                   SP=sp, STORE_W=return_weights, **common)
        _pick_kernel[(N,)](logits, xs, t, u, g, mx, ai, bs, out, V, S, nblk, SCALE=float(2 ** bits),
                           SP=sp, NB=triton.next_power_of_2(nblk), **common)
    return (out, w) if return_weights else out

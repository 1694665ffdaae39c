"""Block-FP8 (W8A8) linear and its quantizers: Triton (CUDA; CPU under TRITON_INTERPRET=1).

Quantizers (bit-equal to the reference in kernels/fp8.py on every backend): fp32 amax of a block
(a max: exact in any order), scale = div_rn(max(amax, fp8_amax_floor), 448) (ue8m0: rounded up to a
power of two on the bits), q = div_rn(x, scale) rounded to the e4m3fn byte by integer operations
(``e4m3_code``). No float8 cast is used: the interpreter's fp32 -> float8 cast rounds ties away,
wraps past 448 and drops the sign of zero, and the integer recipe is the same on every device.

Linear (canonical order on the GPU; independent of M and of the tile):
  out[m, n] = sum over 128-wide K groups kb, in increasing kb, of
              acc = fma(P[m, n, kb], sx[m, kb] * sw[n // 128, kb], acc)   (fp32, from 0.0)
  where P is each group's fp8 tensor-core dot from a zero accumulator, in ``fp8_promote_k`` long
  pieces (each piece promoted on its own, same scale): Hopper's fp8 MMA keeps a reduced-precision
  accumulator, so partials are promoted to fp32 every 128 K (DeepSeek-V3's fix), never carried
  across groups. Then + bias (fp32) and one rounding to the output dtype. Tiles have BM >= 64, so
  every M runs the same MMA instruction family (wgmma) and every element the same K sequence.
Interpreter: each piece's dot is exact in float64 and rounded once to fp32 (e4m3 products are
multiples of 2**-18 below 2**36, so a 128-long sum is an integer of <= 43 bits in those units), and
its fma is a multiply then an add: the interpreter checks the structure, not the GPU's bits.
"""
import torch
import triton
import triton.language as tl

from .. import order
from . import interpreting
from ._jit import round_to

GROUP = 128      # the scale group along K (activations 1 x 128, weights 128 x 128)
E4M3_MAX = 448.0


@triton.jit
def e4m3_code(v):
    """The e4m3fn byte (as int32) nearest to fp32 ``v``: ties to even, saturated at +-448 (code
    0x7E), the sign kept (-0.0 -> 0x80). v = m * 2**(e - 150) with e the fp32 biased exponent;
    e4m3 keeps 3 fraction bits (drop 20 of m) down to 2**-6 and a fixed step of 2**-9 below it."""
    b = v.to(tl.int32, bitcast=True)
    a = b & 0x7FFFFFFF
    e = a >> 23
    m = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
    e = tl.maximum(e, 1)                                   # fp32 subnormals: exponent 1, no implicit bit
    d = tl.minimum(20 + tl.maximum(121 - e, 0), 25)        # 25: m < 2**24 rounds to 0
    r = (m + ((1 << (d - 1)) - 1) + ((m >> d) & 1)) >> d   # round half to even on the dropped bits
    # normal: r in [8, 16] at exponent e - 120 (r = 16 carries into the next exponent); below: r steps
    code = tl.where(e >= 121, ((e - 120) << 3) + r - 8, r)
    code = tl.minimum(code, 0x7E)
    return tl.where(b < 0, code | 0x80, code)


@triton.jit
def fp8_scale(amax, floor, UE8M0: tl.constexpr):
    """Dequantization scale of a block from its fp32 amax: max(amax, floor) / 448 correctly
    rounded; UE8M0: the next power of two at or above it (mantissa bits cleared, exponent + 1)."""
    s = tl.math.div_rn(tl.maximum(amax, floor), 448.0)
    if UE8M0:
        b = s.to(tl.int32, bitcast=True)
        b = tl.where((b & 0x7FFFFF) != 0, (b & 0x7F800000) + 0x800000, b)
        s = b.to(tl.float32, bitcast=True)
    return s


@triton.jit
def _abs_or_inf(x):
    # NaN and inf make the block's amax (so its scale) inf: the launcher's finite check sees it
    return tl.where(x == x, tl.abs(x), float("inf"))


@triton.jit
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, M, K, G, stride_xm, floor,
                         UE8M0: tl.constexpr, BM: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    g = tl.program_id(1)
    cols = g * 128 + tl.arange(0, 128)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    r64 = rows[:, None].to(tl.int64)
    x = tl.load(x_ptr + r64 * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = fp8_scale(tl.max(_abs_or_inf(x), axis=1), floor, UE8M0)
    q = e4m3_code(tl.math.div_rn(x, tl.broadcast_to(s[:, None], (BM, 128))))
    tl.store(q_ptr + r64 * K + cols[None, :], q.to(tl.uint8), mask=mask)
    tl.store(s_ptr + rows * G + g, s, mask=rows < M)


@triton.jit
def _quant_blocks_kernel(w_ptr, q_ptr, s_ptr, N, K, NB, KB, floor, UE8M0: tl.constexpr):
    pn, pk, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pn * 128 + tl.arange(0, 128)
    cols = pk * 128 + tl.arange(0, 128)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    off = e.to(tl.int64) * N * K + rows[:, None].to(tl.int64) * K + cols[None, :]
    x = tl.load(w_ptr + off, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(_abs_or_inf(x), axis=1), axis=0)
    s = fp8_scale(amax, floor, UE8M0)
    tl.store(q_ptr + off, e4m3_code(tl.math.div_rn(x, tl.zeros((128, 128), tl.float32) + s)).to(tl.uint8), mask=mask)
    tl.store(s_ptr + (e.to(tl.int64) * NB + pn) * KB + pk, s)


@triton.jit
def _fp8_linear_kernel(xq_ptr, sx_ptr, wq_ptr, sw_ptr, b_ptr, out_ptr, M, N, K, KB, stride_om,
                       HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PK: tl.constexpr,
                       GROUP_M: tl.constexpr, BF16: tl.constexpr, INTERP: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BN)
    # grouped tile order (GROUP_M rows of tiles share weight tiles in L2); the order never changes bits
    pid_m, pid_n = tl.swizzle2d(pid // num_pid_n, pid % num_pid_n, tl.cdiv(M, BM), num_pid_n, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, PK)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_row = xq_ptr + offs_m[:, None].to(tl.int64) * K
    b_col = wq_ptr + offs_n[None, :].to(tl.int64) * K
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, KB):
        sx = tl.load(sx_ptr + offs_m.to(tl.int64) * KB + kb, mask=mask_m, other=0.0)
        sw = tl.load(sw_ptr + (offs_n // 128).to(tl.int64) * KB + kb, mask=mask_n, other=0.0)
        s = sx[:, None] * sw[None, :]  # one fp32 rounding, the same for every piece of the group
        for j in tl.static_range(128 // PK):
            k = kb * 128 + j * PK + offs_k
            a = tl.load(a_row + k[None, :], mask=mask_m[:, None] & (k[None, :] < K), other=0.0)
            b = tl.load(b_col + k[:, None], mask=mask_n[None, :] & (k[:, None] < K), other=0.0)
            if INTERP:
                part = tl.dot(a.to(tl.float32).to(tl.float64), b.to(tl.float32).to(tl.float64)).to(tl.float32)
            else:
                # a fresh accumulator per piece: the tensor core's limited-precision sum spans PK only
                part = tl.dot(a, b, max_num_imprecise_acc=PK)
            acc = tl.fma(part, s, acc)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ty = out_ptr.dtype.element_ty
    out = round_to(acc, out_ty, BF16, INTERP).to(out_ty)
    ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(ptrs, out, mask=mask_m[:, None] & mask_n[None, :])


# (max_M, BM, BN, GROUP_M, warps, stages); first row with M <= max_M. Tiles never change the bits
# (each element is its own fixed sequence of group dots), but BM stays >= 64 so every M runs wgmma:
# BM < 64 would run mma.sync, whose fp8 accumulator rounding is not measured to be wgmma's
# (benchmarks/ops/fp8_linear.py checks the rows of every M against the full batch).
# Two fp32 tiles live at once (the accumulator and the group's partial), so 128 x 128 on 8 warps is the
# largest tile without spills (scripts/sm90_resources.py: 128 x 256 spills 1.2 KB a thread).
CONFIG_TABLE = [
    (64, 64, 64, 8, 4, 4),
    (128, 64, 128, 8, 4, 4),
    (256, 128, 128, 8, 8, 3),
    (1 << 62, 128, 128, 8, 8, 4),
]
QUANT_BM = 16    # activation rows per quantizer program (any: each row's groups are its own)


def config_for(M: int):
    return next(row[1:] for row in CONFIG_TABLE if M <= row[0])


def _floor():
    return float(order.current().fp8_amax_floor)


def quantize_groups(x2d, ue8m0: bool):
    """x [M, K] (bf16 / fp32, unit stride along K) -> (q float8_e4m3fn [M, K], scale fp32 [M, ceil(K/128)])."""
    M, K = x2d.shape
    G = triton.cdiv(K, GROUP)
    q = torch.empty((M, K), device=x2d.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((M, G), device=x2d.device, dtype=torch.float32)
    if M:
        interp = interpreting(x2d)
        _quant_groups_kernel[(triton.cdiv(M, QUANT_BM), G)](
            x2d, q.view(torch.uint8), s, M, K, G, x2d.stride(0), _floor(), UE8M0=ue8m0, BM=QUANT_BM,
            **({} if interp else dict(num_warps=4, enable_fp_fusion=False)))
    return q, s


def quantize_blocks(w3d, ue8m0: bool):
    """w [E, N, K] contiguous -> (q float8_e4m3fn [E, N, K], scale fp32 [E, ceil(N/128), ceil(K/128)])."""
    E, N, K = w3d.shape
    NB, KB = triton.cdiv(N, GROUP), triton.cdiv(K, GROUP)
    q = torch.empty(w3d.shape, device=w3d.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((E, NB, KB), device=w3d.device, dtype=torch.float32)
    if w3d.numel():
        interp = interpreting(w3d)
        _quant_blocks_kernel[(NB, KB, E)](w3d, q.view(torch.uint8), s, N, K, NB, KB, _floor(), UE8M0=ue8m0,
                                          **({} if interp else dict(num_warps=8, enable_fp_fusion=False)))
    return q, s


def linear(xq, sx, wq, sw, bias, out_dtype, out=None, cfg=None):
    """xq [M, K] e4m3 with sx [M, ceil(K/128)], wq [N, K] e4m3 with sw [ceil(N/128), ceil(K/128)]
    (all contiguous), bias [N] or None -> [M, N] in ``out_dtype``, in the canonical order above.
    ``cfg``: a CONFIG_TABLE row's (BM, BN, GROUP_M, warps, stages) instead of M's (a tile sweep)."""
    M, K = xq.shape
    N = wq.shape[0]
    pk = order.current().fp8_promote_k
    if out is None:
        out = torch.empty((M, N), device=xq.device, dtype=out_dtype)
    if M == 0:
        return out
    BM, BN, GROUP_M, warps, stages = config_for(M) if cfg is None else cfg
    interp = interpreting(xq)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    _fp8_linear_kernel[grid](xq, sx, wq, sw, bias if bias is not None else out, out, M, N, K, triton.cdiv(K, GROUP),
                             out.stride(0), HAS_BIAS=bias is not None, BM=BM, BN=BN, PK=pk, GROUP_M=GROUP_M,
                             BF16=out_dtype == torch.bfloat16, INTERP=interp,
                             **({} if interp else dict(num_warps=warps, num_stages=stages, enable_fp_fusion=False)))
    return out


__all__ = ["GROUP", "CONFIG_TABLE", "config_for", "e4m3_code", "fp8_scale", "quantize_groups", "quantize_blocks",
           "linear"]

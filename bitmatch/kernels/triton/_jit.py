"""Triton helpers the kernels share (imported at their top; no kernel module imports another for these).

``dot`` is the interpreter's exact-dot switch: under TRITON_INTERPRET (INTERP) the product is taken
in float64 and rounded once, so the CPU interpreter gives the order the CUDA MMA fixes with no
dependence on numpy's own summation order; on the GPU it is ``tl.dot`` at the given input precision.
``round_to`` rounds fp32 to a kernel's dtype (nearest even) and back: the interpreter truncates
fp32 -> bf16 where the GPU rounds, so under INTERP it rounds on the bits.
"""
import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc, INTERP: tl.constexpr, PREC: tl.constexpr):
    if INTERP:
        return acc + tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def round_to(v, dt: tl.constexpr, BF16: tl.constexpr, INTERP: tl.constexpr):
    """v rounded to the dtype dt (nearest even), back in fp32. The interpreter truncates fp32 ->
    bf16 where the GPU rounds: under INTERP the rounding is done on the bits (finite values), so
    the interpreter computes the GPU's bits."""
    if INTERP and BF16:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    return v.to(dt).to(tl.float32)

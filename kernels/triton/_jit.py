"""Triton helpers the kernels share (imported at their top; no kernel module imports another for these).

``dot`` is the interpreter's exact-dot switch: under TRITON_INTERPRET (INTERP) the product is taken
in float64 and rounded once, so the CPU interpreter gives the order the CUDA MMA fixes with no
dependence on numpy's own summation order; on the GPU it is ``tl.dot`` at the given input precision.
"""
import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc, INTERP: tl.constexpr, PREC: tl.constexpr):
    if INTERP:
        return acc + tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
    else:
        return tl.dot(a, b, acc, input_precision=PREC)

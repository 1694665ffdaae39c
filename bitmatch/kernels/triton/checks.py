"""Device-side input checks in one launch: the flag an ``_assert_async`` reads (kernels/_backend.py
check_in_range), so a range check costs two launches instead of five small torch ops."""
import torch
import triton
import triton.language as tl

from . import interpreting


@triton.jit
def _in_range_kernel(t_ptr, n, lo, hi, out_ptr, BLOCK: tl.constexpr):
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    for s in range(0, n, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        v = tl.load(t_ptr + offs, mask=offs < n, other=lo)
        bad = bad | ((v < lo) | (v >= hi)).to(tl.int32)
    tl.store(out_ptr, tl.max(bad, 0) == 0)


def in_range(t, lo, hi):
    """bool [] on t's device: every element of the integer tensor t is in [lo, hi)."""
    flat = t.reshape(-1)
    out = torch.empty((), device=t.device, dtype=torch.bool)
    kw = {} if interpreting(t) else dict(num_warps=4)
    _in_range_kernel[(1,)](flat, flat.numel(), int(lo), int(hi), out, BLOCK=1024, **kw)
    return out

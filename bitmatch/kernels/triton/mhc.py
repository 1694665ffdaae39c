"""mHC on the Triton backend: hc_pre / hc_head in two launches, hc_post in one (the canonical
order is stated in kernels/mhc.py, "Triton backend").

- ``_mix_kernel`` (grid: token blocks x K chunks x output blocks): for each token, over one K
  chunk of its N*D stream values (``hc_k_chunk`` of the active order): the mix projection
  dot(x, fn) as one sequential fp32 accumulation (``tl.dot`` in IEEE fp32: a chain of fused
  multiply-adds in K order, each row's chain its own), and the squares x^2 in ``hc_block_k``
  lanes (lane j holds the chunk's k = j mod hc_block_k, added in K order), the lanes summed in
  lane order by a dot with ones. Fp32 partials per (chunk, token); neither the token block nor
  the output block changes a value's bits (each output's chain is its own; every output block
  computes the same squares, the first stores them).
- ``_finish_kernel`` (grid: tokens x D blocks): folds the chunk partials in chunk order, the
  gates, the softmax and the Sinkhorn iterations on the token's N x N matrix (every sum over N a
  stream-order fold of exact one-element extractions, not a tl.sum tree), then the collapse of
  its own D block. Every D block recomputes the same gates from the same values: same bits.
- ``_post_kernel`` (grid: tokens x D blocks): hc_post with the reference's rounding points.
- ``_gates_bwd_kernel`` (grid: tokens): hc_pre's backward through the gates and the Sinkhorn
  steps (``hc_pre_backward``); gradients, not bits.
Every kernel is launched with ``enable_fp_fusion=False`` (a product is rounded, then added, as
the reference's torch ops do), divisions and square roots IEEE (div_rn / sqrt_rn), exp is tl.exp.
No host read: launchable inside a CUDA graph.
"""
import torch
import triton
import triton.language as tl

from .. import order
from . import interpreting
from ._jit import round_to

BLOCK_T = 16      # tokens per _mix_kernel program (speed only: each row's dot chain is its own)
BLOCK_D = 1024    # stream channels per _finish / _post program (speed only: elementwise in d)
ONES_N = 16       # width of the lane-sum dot (tl.dot's smallest N); column 0 is read
MIX_UNROLL = 4    # K blocks per _mix_kernel trip (speed only: the blocks still run in K order)
MIX_BM = 16       # mix outputs per _mix_kernel program (speed only; tl.dot's smallest N): hc_pre's
#                   (2 + N) * N outputs over two programs, so a decode step's T = 64 tokens fill more SMs


@triton.jit
def _mix_kernel(x_ptr, fn_ptr, part_ptr, sq_ptr, T, K, M, K_CHUNK,
                BT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, ONES: tl.constexpr,
                UNROLL: tl.constexpr, INTERP: tl.constexpr):
    s = tl.program_id(1)
    pm = tl.program_id(2)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < T
    offs_k = tl.arange(0, BK)
    offs_m = pm * BM + tl.arange(0, BM)
    mmask = offs_m < M
    acc = tl.zeros((BT, BM), tl.float32)
    lanes = tl.zeros((BT, BK), tl.float32)
    k0 = s * K_CHUNK
    # UNROLL blocks per trip, in K order: the same operations in the same order as one block a
    # trip (so the same bits), but one basic block, so the next blocks' loads are issued while
    # this one's multiply-adds run (an IEEE fp32 dot is FMA code, which the pipeliner skips)
    for kk in range(0, K_CHUNK, BK * UNROLL):
        for u in tl.static_range(UNROLL):
            k = k0 + kk + u * BK + offs_k
            kmask = k < K   # the last chunk may be short: masked values are exact zeros
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + k[None, :],
                        mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            b = tl.load(fn_ptr + offs_m[None, :] * K + k[:, None], mask=mmask[None, :] & kmask[:, None],
                        other=0.0).to(tl.float32)
            if INTERP:  # the interpreter's dot: float64, rounded (structure, not the GPU's bits)
                acc += tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
            else:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            lanes += a * a
    ones = tl.full((BK, ONES), 1.0, tl.float32)
    if INTERP:
        ssq = tl.dot(lanes.to(tl.float64), ones.to(tl.float64)).to(tl.float32)
    else:
        ssq = tl.dot(lanes, ones, input_precision="ieee")   # fma(lane, 1, acc): lane order
    ssq = tl.sum(tl.where(tl.arange(0, ONES)[None, :] == 0, ssq, 0.0), 1)  # column 0: exact
    base = (s * T + rows).to(tl.int64)
    tl.store(part_ptr + base[:, None] * M + offs_m[None, :], acc, mask=rmask[:, None] & mmask[None, :])
    tl.store(sq_ptr + base, ssq, mask=rmask & (pm == 0))


@triton.jit
def _pick(v, idx, j):
    """v[j] of a 1-D block as a scalar: one value plus exact zeros (values here are >= 0)."""
    return tl.sum(tl.where(idx == j, v, 0.0), 0)


@triton.jit
def _fold(c, idx, AXIS: tl.constexpr, N: tl.constexpr):
    """Sum of the [BN, BN] block over AXIS in stream order 0..N-1 (c >= 0: extractions exact)."""
    if AXIS == 1:
        acc = tl.sum(tl.where(idx[None, :] == 0, c, 0.0), 1)
        for j in tl.static_range(1, N):
            acc = acc + tl.sum(tl.where(idx[None, :] == j, c, 0.0), 1)
    else:
        acc = tl.sum(tl.where(idx[:, None] == 0, c, 0.0), 0)
        for j in tl.static_range(1, N):
            acc = acc + tl.sum(tl.where(idx[:, None] == j, c, 0.0), 0)
    return acc


@triton.jit
def _sigmoid(z):
    return tl.math.div_rn(1.0, 1.0 + tl.exp(-z))


@triton.jit
def _finish_kernel(x_ptr, part_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr,
                   T, D, K, S, iters, eps, norm_eps,
                   N: tl.constexpr, BN: tl.constexpr, HEAD: tl.constexpr, BD: tl.constexpr,
                   BF16: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pd = tl.program_id(1)
    if HEAD:
        M = N
    else:
        M = (2 + N) * N
    i = tl.arange(0, BN)
    nm = i < N
    # the K chunks' partials, added in chunk order
    ssq = tl.load(sq_ptr + t)
    mpre = tl.load(part_ptr + t * M + i, mask=nm, other=0.0)
    for s in range(1, S):
        ssq = ssq + tl.load(sq_ptr + s * T + t)
        mpre = mpre + tl.load(part_ptr + (s * T + t) * M + i, mask=nm, other=0.0)
    r = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(ssq, K.to(tl.float32)) + norm_eps))
    s0 = tl.load(scale_ptr).to(tl.float32)
    pre = _sigmoid(mpre * r * s0 + tl.load(base_ptr + i, mask=nm, other=0.0).to(tl.float32)) + eps
    if not HEAD:
        cm = nm[:, None] & nm[None, :]
        cidx = 2 * N + i[:, None] * N + i[None, :]
        mpost = tl.load(part_ptr + t * M + N + i, mask=nm, other=0.0)
        mcomb = tl.load(part_ptr + t * M + cidx, mask=cm, other=0.0)
        for s in range(1, S):
            mpost = mpost + tl.load(part_ptr + (s * T + t) * M + N + i, mask=nm, other=0.0)
            mcomb = mcomb + tl.load(part_ptr + (s * T + t) * M + cidx, mask=cm, other=0.0)
        s1 = tl.load(scale_ptr + 1).to(tl.float32)
        s2 = tl.load(scale_ptr + 2).to(tl.float32)
        post = 2.0 * _sigmoid(mpost * r * s1 + tl.load(base_ptr + N + i, mask=nm, other=0.0).to(tl.float32))
        z = mcomb * r * s2 + tl.load(base_ptr + cidx, mask=cm, other=0.0).to(tl.float32)
        z = tl.where(cm, z, -float("inf"))
        e = tl.where(cm, tl.exp(z - tl.max(z, 1)[:, None]), 0.0)
        comb = tl.where(cm, tl.math.div_rn(e, _fold(e, i, 1, N)[:, None]) + eps, 0.0)
        comb = tl.where(cm, tl.math.div_rn(comb, _fold(comb, i, 0, N)[None, :] + eps), 0.0)
        for _ in range(iters - 1):
            comb = tl.where(cm, tl.math.div_rn(comb, _fold(comb, i, 1, N)[:, None] + eps), 0.0)
            comb = tl.where(cm, tl.math.div_rn(comb, _fold(comb, i, 0, N)[None, :] + eps), 0.0)
        if pd == 0:
            tl.store(post_ptr + t * N + i, post, mask=nm)
            tl.store(comb_ptr + t * N * N + i[:, None] * N + i[None, :], comb, mask=cm)
    # the collapse of this program's D block: sum over streams in order, fp32, one rounding
    d = pd * BD + tl.arange(0, BD)
    dm = d < D
    xrow = x_ptr + t * N * D + d
    acc = _pick(pre, i, 0) * tl.load(xrow, mask=dm, other=0.0).to(tl.float32)
    for n in tl.static_range(1, N):
        acc = acc + _pick(pre, i, n) * tl.load(xrow + n * D, mask=dm, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + t * D + d, round_to(acc, dt, BF16, INTERP).to(dt), mask=dm)


@triton.jit
def _post_kernel(x_ptr, y_ptr, post_ptr, comb_ptr, out_ptr, D,
                 N: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BF16: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = d < D
    k = tl.arange(0, BN)
    km = k < N
    dt = out_ptr.dtype.element_ty
    # post and comb rounded to the streams' dtype first (HF multiplies in the model dtype)
    p = round_to(tl.load(post_ptr + t * N + k, mask=km, other=0.0).to(tl.float32), dt, BF16, INTERP)
    xrow = x_ptr + t * N * D + d
    c = round_to(tl.load(comb_ptr + t * N * N + k, mask=km, other=0.0).to(tl.float32), dt, BF16, INTERP)
    mixed = c[:, None] * tl.load(xrow, mask=dm, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(1, N):   # mixed[k] = sum_j comb[j, k] * x[j], stream order
        c = round_to(tl.load(comb_ptr + t * N * N + j * N + k, mask=km, other=0.0).to(tl.float32), dt, BF16, INTERP)
        mixed = mixed + c[:, None] * tl.load(xrow + j * D, mask=dm, other=0.0).to(tl.float32)[None, :]
    y = tl.load(y_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)
    expanded = round_to(p[:, None] * y[None, :], dt, BF16, INTERP)
    out = round_to(expanded + round_to(mixed, dt, BF16, INTERP), dt, BF16, INTERP).to(dt)
    tl.store(out_ptr + t * N * D + k[:, None] * D + d[None, :], out, mask=km[:, None] & dm[None, :])


@triton.jit
def _gates_bwd_kernel(mix_ptr, base_ptr, scale_ptr, gpre_ptr, gpost_ptr, gcomb_ptr, gz_ptr, scratch_ptr, iters, eps,
                      N: tl.constexpr, BN: tl.constexpr):
    """One token: the gradient of hc_pre's gates w.r.t. their logits z = mix * scale + base, from
    the gradients of pre, post and comb. The gates are recomputed in fp32 (sigmoid, softmax, the
    Sinkhorn steps, each step's output kept in the token's scratch rows), then the Sinkhorn steps
    are walked backward: for c' = c / (s + eps), s the sum over the step's axis,
    dc = (dc' - sum_axis(dc' * c')) / (s + eps). A gradient, not bits: tl.sum's order is free."""
    t = tl.program_id(0).to(tl.int64)
    M = (2 + N) * N
    i = tl.arange(0, BN)
    nm = i < N
    cm = nm[:, None] & nm[None, :]
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    sp = 1.0 / (1.0 + tl.exp(-(tl.load(mix_ptr + t * M + i, mask=nm, other=0.0) * s0
                                + tl.load(base_ptr + i, mask=nm, other=0.0))))
    gzp = tl.load(gpre_ptr + t * N + i, mask=nm, other=0.0) * sp * (1.0 - sp)
    sq = 1.0 / (1.0 + tl.exp(-(tl.load(mix_ptr + t * M + N + i, mask=nm, other=0.0) * s1
                                + tl.load(base_ptr + N + i, mask=nm, other=0.0))))
    gzq = 2.0 * tl.load(gpost_ptr + t * N + i, mask=nm, other=0.0) * sq * (1.0 - sq)
    tl.store(gz_ptr + t * M + i, gzp, mask=nm)
    tl.store(gz_ptr + t * M + N + i, gzq, mask=nm)
    cidx = 2 * N + i[:, None] * N + i[None, :]
    z = tl.where(cm, tl.load(mix_ptr + t * M + cidx, mask=cm, other=0.0) * s2
                 + tl.load(base_ptr + cidx, mask=cm, other=0.0), -float("inf"))
    zmax = tl.where(nm, tl.max(z, 1), 0.0)             # padding rows: no -inf - -inf
    e = tl.where(cm, tl.exp(z - zmax[:, None]), 0.0)
    p = e / tl.where(nm, tl.sum(e, 1), 1.0)[:, None]
    c = tl.where(cm, p + eps, 0.0)
    steps = 2 * iters - 1      # step 0 and every even step: columns (sum over axis 0); odd: rows
    tile = i[:, None] * BN + i[None, :]
    sc = scratch_ptr + t * (steps + 1) * BN * BN
    tl.store(sc + tile, c)
    for k in range(steps):
        den = tl.where(k % 2 == 1, tl.sum(c, 1)[:, None], tl.sum(c, 0)[None, :]) + eps
        c = tl.where(cm, c / den, 0.0)
        tl.store(sc + (k + 1) * BN * BN + tile, c)
    tl.debug_barrier()         # the scratch rows, written above, are read back by other threads
    g = tl.load(gcomb_ptr + t * N * N + i[:, None] * N + i[None, :], mask=cm, other=0.0)
    for kk in range(steps):
        k = steps - 1 - kk
        c_in = tl.load(sc + k * BN * BN + tile)
        gc = g * tl.load(sc + (k + 1) * BN * BN + tile)
        row = k % 2 == 1
        den = tl.where(row, tl.sum(c_in, 1)[:, None], tl.sum(c_in, 0)[None, :]) + eps
        g = tl.where(cm, (g - tl.where(row, tl.sum(gc, 1)[:, None], tl.sum(gc, 0)[None, :])) / den, 0.0)
    # c = softmax(z) + eps: the softmax's backward over each row
    gzc = p * (g - tl.sum(g * p, 1)[:, None])
    tl.store(gz_ptr + t * M + cidx, gzc, mask=cm)


_PARTS: dict = {}


def _gate_parts(n, device):
    """Which scale each of the (2 + n) * n gate logits takes (0 pre, 1 post, 2 comb), built once per
    (n, device): a host list copied to the device on every backward would wait for the stream."""
    key = (n, str(device))
    if key not in _PARTS:
        _PARTS[key] = torch.tensor([0] * n + [1] * n + [2] * (n * n), device=device)
    return _PARTS[key]


def hc_pre_backward(x, fn, base, scale, iters, eps, norm_eps, gpost, gcomb, gcol):
    """Gradients (x, fn, base, scale) of hc_pre (the plain fp32 math of kernels/mhc.py's
    ``_hc_pre_plain``) for the output gradients gpost [T, N], gcomb [T, N, N], gcol [T, D]: the
    mix projection and the RMS scaling in a few torch ops, the gates and Sinkhorn steps of every
    token in one launch (``_gates_bwd_kernel``), instead of autograd through 2 x iters torch steps."""
    T, n, d = x.shape
    K = n * d
    f = x.reshape(T, K).float()
    r = torch.rsqrt(f.square().mean(-1, keepdim=True) + norm_eps)
    fr = f * r
    fn32, sc32 = fn.float(), scale.float()
    mix = (fr @ fn32.t()).contiguous()
    b32 = base.float().contiguous()
    pre = torch.sigmoid(mix[:, :n] * sc32[0] + b32[:n]) + eps
    gcol32 = gcol.float()
    gpre = torch.bmm(f.view(T, n, d), gcol32.unsqueeze(2)).squeeze(2).contiguous()
    M = mix.shape[1]
    gz = torch.empty((T, M), device=x.device, dtype=torch.float32)
    if T:
        BN = triton.next_power_of_2(n)
        scratch = torch.empty((T, 2 * iters, BN, BN), device=x.device, dtype=torch.float32)
        _gates_bwd_kernel[(T,)](mix, b32, sc32.contiguous(), gpre, gpost.float().contiguous(),
                                gcomb.float().contiguous(), gz, scratch, iters, float(eps), N=n, BN=BN,
                                **({} if interpreting(x) else dict(num_warps=1)))
    parts = _gate_parts(n, x.device)
    gmix = gz * sc32[parts]
    gscale = torch.zeros(3, device=x.device, dtype=torch.float32).index_add_(0, parts, (gz * mix).sum(0))
    gfr = gmix @ fn32
    # fr = f * r, r = (mean(f^2) + norm_eps)^-1/2: d r / d f = -r^3 f / K
    gf = gfr * r - f * (r ** 3 / K) * (gfr * f).sum(-1, keepdim=True)
    gx = gf.view(T, n, d) + pre.unsqueeze(-1) * gcol32.unsqueeze(1)
    return gx.to(x.dtype), (gmix.t() @ fr).to(fn.dtype), gz.sum(0).to(base.dtype), gscale.to(scale.dtype)


def _kw(interp, warps=4):
    return {} if interp else dict(num_warps=warps, enable_fp_fusion=False)


def _mixes(x, fn, interp):
    """Chunk partials of dot(x, fn) [S, T, M] and of sum(x^2) [S, T] (fp32)."""
    T, n, d = x.shape
    M, K = fn.shape
    o = order.current()
    chunk = o.hc_k_chunk
    S = triton.cdiv(K, chunk)
    part = torch.empty((S, T, M), device=x.device, dtype=torch.float32)
    sq = torch.empty((S, T), device=x.device, dtype=torch.float32)
    blocks = chunk // o.hc_block_k   # the order keeps the chunk a multiple of the block
    unroll = next(u for u in (MIX_UNROLL, 2, 1) if blocks % u == 0)
    grid = (triton.cdiv(T, BLOCK_T), S, triton.cdiv(M, MIX_BM))
    _mix_kernel[grid](x, fn, part, sq, T, K, M, chunk, BT=BLOCK_T, BM=MIX_BM, BK=o.hc_block_k, ONES=ONES_N,
                      UNROLL=unroll, INTERP=interp, **_kw(interp))
    return part, sq, S


def _pre(x, fn, base, scale, iters, eps, norm_eps, head):
    T, n, d = x.shape
    interp = interpreting(x)
    out = torch.empty((T, d), device=x.device, dtype=x.dtype)
    post = torch.empty((T, n), device=x.device, dtype=torch.float32)
    comb = torch.empty((T, n, n), device=x.device, dtype=torch.float32)
    if T == 0:
        return post, comb, out
    part, sq, S = _mixes(x, fn, interp)
    bd = min(BLOCK_D, triton.next_power_of_2(d))
    _finish_kernel[(T, triton.cdiv(d, bd))](x, part, sq, base, scale, post, comb, out, T, d, n * d, S, iters,
                                            float(eps), float(norm_eps), N=n, BN=triton.next_power_of_2(n),
                                            HEAD=head, BD=bd, BF16=x.dtype == torch.bfloat16, INTERP=interp,
                                            **_kw(interp))
    return post, comb, out


def hc_pre(x, fn, base, scale, iters, eps, norm_eps):
    """x [T, N, D] -> (post fp32 [T, N], comb fp32 [T, N, N], block input [T, D] x.dtype)."""
    return _pre(x, fn, base, scale, iters, eps, norm_eps, head=False)


def hc_head(x, fn, base, scale, eps, norm_eps):
    """x [T, N, D] -> [T, D] x.dtype (pre gates of fn [N, N*D] only, then the collapse)."""
    return _pre(x, fn, base, scale, 1, eps, norm_eps, head=True)[2]


def hc_post(x, y, post, comb):
    """x [T, N, D], y [T, D], post [T, N], comb [T, N, N] -> [T, N, D] x.dtype."""
    T, n, d = x.shape
    out = torch.empty_like(x)
    if T == 0:
        return out
    interp = interpreting(x)
    bd = min(BLOCK_D, triton.next_power_of_2(d))
    _post_kernel[(T, triton.cdiv(d, bd))](x, y, post, comb, out, d, N=n, BN=triton.next_power_of_2(n), BD=bd,
                                          BF16=x.dtype == torch.bfloat16, INTERP=interp, **_kw(interp))
    return out

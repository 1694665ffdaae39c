"""The fused Triton mHC kernels (kernels/triton/mhc.py) under TRITON_INTERPRET=1: hc_pre / hc_head
close to the exact reference (their own canonical order, kernels/mhc.py), hc_post the reference's
bits, every token's bits independent of the batch (its size, its other rows, its row order, the
token block and the D block it lands in), several K chunks folded, gradients vs float64.
Controls: a K split chosen by the batch size (cuBLAS-style split-K heuristics) and a changed chunk
length are both caught. HF parity of the reference is in tests/test_dsv4_ops.py."""
from __future__ import annotations

import pytest
import torch

import bitmatch.kernels as K
from bitmatch.kernels import order
from bitmatch.kernels.triton import mhc as TM
from bitmatch.testing import BitMismatch, assert_batch_invariant, assert_bitwise_equal

pytestmark = pytest.mark.interpreter
BF, F32 = torch.bfloat16, torch.float32
KW = dict(iters=7, eps=1e-6, norm_eps=1e-6)


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _params(n, d, seed=0, head=False):
    g = _g(seed)
    m = n if head else (2 + n) * n
    fn = torch.randn(m, n * d, generator=g) * (n * d) ** -0.5 * 2
    base = torch.randn(m, generator=g) * 0.3
    scale = torch.rand(1 if head else 3, generator=g) + 0.5
    return fn, base, scale


def _x(T, n, d, dtype, seed=1):
    return torch.randn(T, n, d, generator=_g(seed)).to(dtype)


def _triton(f, *a, **kw):
    with K.use_backend("triton"), torch.no_grad():
        return f(*a, **kw)


def _head(x, fn, base, scale):
    return K.hc_head(x, fn, base, scale, eps=1e-6, norm_eps=1e-6)


# ---------------------------------------------------------------- close to the reference
@pytest.mark.parametrize("dtype", [BF, F32])
@pytest.mark.parametrize("n,d,chunk", [(3, 16, 1024), (4, 64, 64), (4, 48, 128)])
def test_triton_hc_pre_and_head_close_to_reference(dtype, n, d, chunk):
    # chunk 64 / 128 with K = 256 / 192: four / two K chunks (one of them short) folded in order
    x = _x(9, n, d, dtype)
    fn, base, scale = _params(n, d)
    hfn, hbase, hscale = _params(n, d, seed=2, head=True)
    with torch.no_grad():
        ref = K.hc_pre(x, fn, base, scale, **KW)
        ref_h = _head(x, hfn, hbase, hscale)
    with order.override(hc_k_chunk=chunk):
        got = _triton(K.hc_pre, x, fn, base, scale, **KW)
        got_h = _triton(_head, x, hfn, hbase, hscale)
    tol = 2e-2 if dtype == BF else 1e-5  # collapse: one bf16 ulp where the gates differ in fp32
    for name, a, b, t in (("post", got[0], ref[0], 1e-5), ("comb", got[1], ref[1], 1e-5),
                          ("collapse", got[2], ref[2], tol), ("head", got_h, ref_h, tol)):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        err = ((a.float() - b.float()).abs() / (1 + b.float().abs())).max()
        assert err < t, f"{name}: {err}"
    assert (got[1].sum(-2) - 1).abs().max() < 1e-3  # doubly stochastic (columns exact-ish)


@pytest.mark.parametrize("dtype", [BF, F32])
def test_triton_hc_post_is_the_reference_bit_for_bit(dtype):
    x, y = _x(7, 4, 40, dtype), torch.randn(7, 40, generator=_g(3)).to(dtype)
    post, comb = torch.rand(7, 4, generator=_g(4)) * 2, torch.rand(7, 4, 4, generator=_g(5))
    with torch.no_grad():
        ref = K.hc_post(x, y, post, comb)
    assert_bitwise_equal(_triton(K.hc_post, x, y, post, comb), ref, "triton hc_post vs reference")


# ---------------------------------------------------------------- invariance
def _pre_fn(fn, base, scale):
    return lambda a: K.hc_pre(a, fn, base, scale, **KW)


@pytest.mark.parametrize("dtype", [BF, F32])
def test_triton_mhc_token_alone_equals_batched(dtype):
    n, d = 4, 48
    x = _x(6, n, d, dtype, seed=6)
    fn, base, scale = _params(n, d, seed=7)
    hp = _params(n, d, seed=8, head=True)
    y = torch.randn(6, d, generator=_g(9)).to(dtype)
    # 40 rows > BLOCK_T: a token lands in different token blocks and block positions
    with K.use_backend("triton"), torch.no_grad(), order.override(hc_k_chunk=64):
        assert_batch_invariant(_pre_fn(fn, base, scale), x, max_batch=40, cases=4, seed=1)
        assert_batch_invariant(lambda a: _head(a, *hp), x, max_batch=40, cases=3, seed=2)
        post, comb, _ = K.hc_pre(x, fn, base, scale, **KW)
        assert_batch_invariant(K.hc_post, (x, y, post, comb), max_batch=40, cases=3, seed=3)


def test_triton_hc_pre_row_order_and_d_blocks_do_not_change_bits(monkeypatch):
    n, d = 2, 96
    x = _x(21, n, d, BF, seed=10)
    fn, base, scale = _params(n, d, seed=11)
    want = _triton(K.hc_pre, x, fn, base, scale, **KW)
    perm = torch.randperm(21, generator=_g(12))
    got = _triton(K.hc_pre, x[perm], fn, base, scale, **KW)
    for a, b in zip(got, want):
        assert_bitwise_equal(a, b[perm], "permuted rows")
    # speed knobs: token block and D block sizes move no bit
    monkeypatch.setattr(TM, "BLOCK_T", 32)
    monkeypatch.setattr(TM, "BLOCK_D", 32)
    for a, b in zip(_triton(K.hc_pre, x, fn, base, scale, **KW), want):
        assert_bitwise_equal(a, b, "BLOCK_T 32, BLOCK_D 32")


def test_triton_mix_unroll_does_not_change_bits(monkeypatch):
    """The mix kernel's K blocks per trip (MIX_UNROLL) is speed only: several chunks, trips over
    full and short (masked) blocks, the same bits at 1, 2 and 4 blocks a trip."""
    n, d = 4, 600   # K = 2400: chunks of 1024, 1024 and 352 (the last trip partly masked)
    x = _x(5, n, d, BF, seed=16)
    fn, base, scale = _params(n, d, seed=17)
    outs = {}
    for u in (1, 2, 4):
        monkeypatch.setattr(TM, "MIX_UNROLL", u)
        with order.override(hc_k_chunk=1024, hc_block_k=64):
            outs[u] = _triton(K.hc_pre, x, fn, base, scale, **KW)
    for u in (2, 4):
        for a, b in zip(outs[u], outs[1]):
            assert_bitwise_equal(a, b, f"MIX_UNROLL {u}")


def test_control_batch_dependent_k_split_is_caught():
    """The harness on a split chosen by the batch size (what a split-K heuristic does): a row
    alone and the same row in a larger batch fold different chunks and differ."""
    n, d = 4, 64
    x = _x(8, n, d, F32, seed=13) * 3
    fn, base, scale = _params(n, d, seed=14)

    def heuristic(a):
        split = dict(hc_k_chunk=64, hc_block_k=16) if a.shape[0] > 4 else {}
        with order.override(**split):
            return K.hc_pre(a, fn, base, scale, **KW)
    with K.use_backend("triton"), torch.no_grad(), pytest.raises(BitMismatch):
        assert_batch_invariant(heuristic, x, max_batch=16, cases=6, seed=4)


def test_control_chunk_length_is_part_of_the_bits():
    # why hc_k_chunk / hc_block_k are stamped: other chunks and lanes are another fold, other
    # bits (the interpreter's dots are float64 per block: its chunks show through the lanes)
    n, d = 4, 64
    x = _x(16, n, d, F32, seed=15) * 3
    fn, base, scale = _params(n, d, seed=16)
    with order.override(hc_k_chunk=64, hc_block_k=16):
        a = _triton(K.hc_pre, x, fn, base, scale, **KW)
    b = _triton(K.hc_pre, x, fn, base, scale, **KW)
    assert not all(torch.equal(u, v) for u, v in zip(a, b))
    assert order.stamp("triton")["hc_k_chunk"] == 256 and "hc_k_chunk" not in order.stamp("reference")


# ---------------------------------------------------------------- gradients, errors
def _pre64(x, fn, base, scale):
    """HF's hc_pre formulas in the inputs' dtype: (post, comb, the collapsed block input)."""
    T, n, d = x.shape
    f = x.reshape(T, n * d)
    mix = (f * torch.rsqrt(f.square().mean(-1, keepdim=True) + 1e-6)) @ fn.t()
    pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + 1e-6
    post = 2 * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = torch.softmax((mix[:, 2 * n:] * scale[2] + base[2 * n:]).view(T, n, n), -1) + 1e-6
    comb = comb / (comb.sum(-2, keepdim=True) + 1e-6)
    for _ in range(KW["iters"] - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + 1e-6)
        comb = comb / (comb.sum(-2, keepdim=True) + 1e-6)
    return post, comb, (pre.unsqueeze(-1) * x).sum(1)


def _plain64(x, fn, base, scale, y):
    """HF's formulas in float64: hc_pre, then hc_post of y, then hc_head of the result."""
    post, comb, col = _pre64(x, fn, base, scale)
    return post.unsqueeze(-1) * (col + y).unsqueeze(1) + torch.einsum("tjk,tjd->tkd", comb, x)


def test_triton_mhc_grads_match_float64():
    n, d = 3, 32
    x0 = _x(5, n, d, F32, seed=17)
    p0 = _params(n, d, seed=18)
    y0 = torch.randn(5, d, generator=_g(19))
    w = torch.randn(5, n, d, generator=_g(20))
    x, y = x0.clone().requires_grad_(), y0.clone().requires_grad_()
    fn, base, scale = (t.clone().requires_grad_() for t in p0)
    with K.use_backend("triton"):
        post, comb, col = K.hc_pre(x, fn, base, scale, **KW)
        (K.hc_post(x, col + y, post, comb) * w).sum().backward()
    leaves64 = [t.detach().double().requires_grad_() for t in (x0, *p0, y0)]
    (_plain64(*leaves64) * w.double()).sum().backward()
    for name, a, b in zip(("x", "fn", "base", "scale", "y"), (x, fn, base, scale, y), leaves64):
        rel = (a.grad.double() - b.grad).norm() / b.grad.norm()
        assert rel < 1e-5, f"d{name}: {rel}"


def _pre_grads64(x, fn, base, scale, gpost, gcomb, gcol):
    leaves = [t.detach().double().requires_grad_() for t in (x, fn, base, scale)]
    post, comb, col = _pre64(*leaves)
    ((post * gpost.double()).sum() + (comb * gcomb.double()).sum() + (col * gcol.double()).sum()).backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("n,d", [(4, 16), (3, 24), (2, 8)])
@pytest.mark.parametrize("which", ["post", "comb", "col", "all"])
def test_triton_hc_pre_backward_each_output_vs_float64(n, d, which):
    """hc_pre's Triton backward (the gates and Sinkhorn steps of every token in one launch) for a
    gradient on each output alone and on all three: within 1e-5 of float64 autograd, at stream
    counts that fill the power-of-two tile (4) and that leave masked rows (3)."""
    T = 6
    x = _x(T, n, d, F32, seed=21) * 2
    fn, base, scale = _params(n, d, seed=22)
    g = _g(23)
    outs = {"post": torch.randn(T, n, generator=g), "comb": torch.randn(T, n, n, generator=g) * 3,
            "col": torch.randn(T, d, generator=g)}
    gs = [outs[k] if which in (k, "all") else torch.zeros_like(outs[k]) for k in ("post", "comb", "col")]
    got = TM.hc_pre_backward(x, fn, base, scale, KW["iters"], KW["eps"], KW["norm_eps"], *gs)
    want = _pre_grads64(x, fn, base, scale, *gs)
    for name, a, b in zip(("x", "fn", "base", "scale"), got, want):
        rel = (a.double() - b).norm() / b.norm().clamp_min(1e-30)
        assert rel < 1e-5, f"d{name} ({which}, n={n}): {rel}"


def test_control_backward_with_one_sinkhorn_step_less_fails():
    # the float64 check sees the Sinkhorn walk: one iteration fewer in the backward moves dcomb's path
    n, d, T = 4, 16, 6
    x = _x(T, n, d, F32, seed=24) * 2
    fn, base, scale = _params(n, d, seed=25)
    gcomb = torch.randn(T, n, n, generator=_g(26)) * 3
    gs = (torch.zeros(T, n), gcomb, torch.zeros(T, d))
    got = TM.hc_pre_backward(x, fn, base, scale, KW["iters"] - 1, KW["eps"], KW["norm_eps"], *gs)
    want = _pre_grads64(x, fn, base, scale, *gs)
    rel = (got[0].double() - want[0]).norm() / want[0].norm()
    assert rel > 1e-3, rel


def test_bad_inputs_name_the_argument():
    fn, base, scale = _params(2, 8)
    x = _x(3, 2, 8, F32)
    with pytest.raises(ValueError, match="fn must be"):
        K.hc_pre(x, fn[:, :8], base, scale, **KW)
    with pytest.raises(ValueError, match="x must be"):
        K.hc_post(x[0], x[0, 0], x[:, 0], x[:, :, :2])
    with pytest.raises(ValueError, match="post"):
        K.hc_post(x, x[:, 0], x[:, 0, :1], x[:, :, :2])
    with pytest.raises(ValueError, match="hc_block_k"):
        order.CanonicalOrder(hc_k_chunk=100)

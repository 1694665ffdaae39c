"""Triton backward kernels (rms_norm, fused_add_rms_norm, silu_and_mul, apply_rotary,
token_logprobs) under Triton's CPU interpreter, through the public ops' autograd, against float64
autograd of the same math.

Gradients need not be batch-invariant, only correct: fp32 operands within the tolerances of the
CPU gradient tests (rtol 1e-4 / atol 1e-5), bf16 within bf16 tolerance (relative error 0.02; the
interpreter's fp32 -> bf16 cast truncates). A mutation check shows each comparison can fail.
The same kernels' GPU gradients and timings are in benchmarks/engine/gpu_e2e.py's `backward` section.
"""
import pytest
import torch
import torch.nn.functional as F

import bitmatch.kernels as K
from bitmatch.kernels._backend import use_backend

pytest.importorskip("triton")
pytestmark = pytest.mark.interpreter

BF, F32 = torch.bfloat16, torch.float32


def _randn(*shape, seed, scale=1.0, dtype=F32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _leaves(*ts):
    return [t.clone().requires_grad_() for t in ts]


def _leaves64(*ts):
    return [t.detach().double().requires_grad_() for t in ts]


def _assert_close(got, want, dtype, what):
    assert got is not None and got.dtype == dtype and got.shape == want.shape, what
    if dtype == F32:
        ok = torch.allclose(got.double(), want, rtol=1e-4, atol=1e-5)
    else:
        ok = ((got.double() - want).abs().max() / want.abs().max()).item() < 0.02
    assert ok, f"{what}: max |diff| {(got.double() - want).abs().max().item():.3g}"


def _rms64(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("dtype", [F32, BF])
@pytest.mark.parametrize("M,H", [(37, 96), (300, 16), (5, 2048)])  # tails, many tiles, 1 row/tile
def test_rms_norm_backward(dtype, M, H):
    x, w = _randn(M, H, seed=1, dtype=dtype), (1 + 0.3 * _randn(H, seed=2)).to(dtype)
    g = _randn(M, H, seed=3, dtype=dtype)
    xl, wl = _leaves(x, w)
    with use_backend("triton"):
        y = K.rms_norm(xl.view(M // 1, H), wl, 1e-6)
    torch.autograd.backward(y, g)
    x64, w64 = _leaves64(x, w)
    torch.autograd.backward(_rms64(x64, w64, 1e-6), g.double())
    _assert_close(xl.grad, x64.grad, dtype, "dx")
    _assert_close(wl.grad, w64.grad, dtype, "dw")


def test_rms_norm_backward_heads_and_frozen_weight():
    """q_norm's layout ([T, H, D] normed over D) with a weight that takes no gradient."""
    x, w, g = _randn(9, 6, 32, seed=4), 1 + 0.3 * _randn(32, seed=5), _randn(9, 6, 32, seed=6)
    xl = _leaves(x)[0]
    with use_backend("triton"):
        y = K.rms_norm(xl, w, 1e-5)
    torch.autograd.backward(y, g)
    x64 = _leaves64(x)[0]
    torch.autograd.backward(_rms64(x64, w.double(), 1e-5), g.double())
    _assert_close(xl.grad, x64.grad, F32, "dx")


@pytest.mark.parametrize("dtype", [F32, BF])
@pytest.mark.parametrize("use", ["both", "out", "res"])
def test_fused_add_rms_norm_backward(dtype, use):
    M, H = 23, 80
    x, r = _randn(M, H, seed=7, dtype=dtype), _randn(M, H, seed=8, dtype=dtype)
    w = (1 + 0.3 * _randn(H, seed=9)).to(dtype)
    go, gr = _randn(M, H, seed=10, dtype=dtype), _randn(M, H, seed=11, dtype=dtype)
    leaves = _leaves(x, r, w)
    with use_backend("triton"):
        out, res = K.fused_add_rms_norm(*leaves, 1e-5)
    l64 = _leaves64(x, r, w)
    s64 = l64[0] + l64[1]
    o64 = _rms64(s64, l64[2], 1e-5)
    pairs = {"both": [(out, go, o64), (res, gr, s64)], "out": [(out, go, o64)], "res": [(res, gr, s64)]}[use]
    torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
    torch.autograd.backward([p[2] for p in pairs], [p[1].double() for p in pairs])
    _assert_close(leaves[0].grad, l64[0].grad, dtype, "dx")
    _assert_close(leaves[1].grad, l64[1].grad, dtype, "dresidual")
    if use == "res":
        assert leaves[2].grad is None or not leaves[2].grad.any()
    else:
        _assert_close(leaves[2].grad, l64[2].grad, dtype, "dw")


@pytest.mark.parametrize("dtype", [F32, BF])
def test_silu_and_mul_backward(dtype):
    x, g = _randn(7, 2 * 1100, seed=12, dtype=dtype), _randn(7, 1100, seed=13, dtype=dtype)  # 2 blocks
    xl = _leaves(x)[0]
    with use_backend("triton"):
        y = K.silu_and_mul(xl)
    torch.autograd.backward(y, g)
    x64 = _leaves64(x)[0]
    torch.autograd.backward(F.silu(x64[:, :1100]) * x64[:, 1100:], g.double())
    _assert_close(xl.grad, x64.grad, dtype, "dx")


def _cos_sin(T, D, dtype):
    return K.rotary_cos_sin(torch.arange(T) * 7 + 3, D, 10000.0, dtype=dtype)


@pytest.mark.parametrize("dtype", [F32, BF])
@pytest.mark.parametrize("use", ["both", "q"])
def test_apply_rotary_backward(dtype, use):
    T, D = 11, 64
    q, k = _randn(T, 4, D, seed=14, dtype=dtype), _randn(T, 2, D, seed=15, dtype=dtype)
    gq, gk = _randn(T, 4, D, seed=16, dtype=dtype), _randn(T, 2, D, seed=17, dtype=dtype)
    cos, sin = _cos_sin(T, D, F32)
    ql, kl = _leaves(q, k)
    with use_backend("triton"):
        qo, ko = K.apply_rotary(ql, kl, cos, sin)
    # float64 math with cos/sin rounded to the operand dtype, as the forward uses them
    c = cos.to(dtype).double().repeat(1, 2)[:, None, :]
    s = sin.to(dtype).double().repeat(1, 2)[:, None, :]
    q64, k64 = _leaves64(q, k)

    def rot(x):
        h = D // 2
        return x * c + torch.cat([-x[..., h:], x[..., :h]], -1) * s
    if use == "both":
        torch.autograd.backward([qo, ko], [gq, gk])
        torch.autograd.backward([rot(q64), rot(k64)], [gq.double(), gk.double()])
        _assert_close(kl.grad, k64.grad, dtype, "dk")
    else:
        torch.autograd.backward(qo, gq)
        torch.autograd.backward(rot(q64), gq.double())
        assert kl.grad is None
    _assert_close(ql.grad, q64.grad, dtype, "dq")


@pytest.mark.parametrize("dtype", [F32, BF])
def test_token_logprobs_backward(dtype):
    N, V = 6, 5000                                   # two 4096-wide column blocks, ragged tail
    x = _randn(N, V, seed=18, scale=3.0, dtype=dtype)
    tok = torch.tensor([0, 4999, 17, 4096, 123, 4095])
    temp = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 2.0])
    g = _randn(N, seed=19)
    xl = _leaves(x)[0]
    with use_backend("triton"):
        lp = K.token_logprobs(xl, tok, temp)
    torch.autograd.backward(lp, g)
    x64 = _leaves64(x)[0]
    lp64 = torch.log_softmax(x64 / temp.double()[:, None], -1)[torch.arange(N), tok]
    torch.autograd.backward(lp64, g.double())
    _assert_close(xl.grad, x64.grad, dtype, "dlogits")
    with use_backend("triton"):   # the autograd forward keeps the no-grad forward's bits
        assert torch.equal(lp.detach(), K.token_logprobs(x, tok, temp))


def test_comparison_can_fail():
    """Mutation: the same comparison rejects a gradient off by one temperature factor."""
    x, tok, temp = _randn(3, 300, seed=20, scale=2.0), torch.tensor([1, 2, 3]), torch.tensor([0.7] * 3)
    xl = _leaves(x)[0]
    with use_backend("triton"):
        K.token_logprobs(xl, tok, temp).sum().backward()
    x64 = _leaves64(x)[0]
    torch.log_softmax(x64 / 0.7, -1)[torch.arange(3), tok].sum().backward()
    _assert_close(xl.grad, x64.grad, F32, "dlogits")
    with pytest.raises(AssertionError):
        _assert_close(xl.grad * 0.7, x64.grad, F32, "mutated")

import pytest
import torch
import torch.nn.functional as F

import bitmatch.kernels as K
from bitmatch.testing import BitMismatch, assert_batch_invariant, assert_thread_invariant

torch.manual_seed(0)
W = (torch.randn(1024, 1024) * 0.03).bfloat16()
B = torch.randn(1024).bfloat16()
ROWS = torch.randn(6, 1024).bfloat16()


def _ours(x):
    return K.linear(x, W, B)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_batch_invariant(dtype):
    w, b, rows = W.to(dtype), B.to(dtype), ROWS.to(dtype)
    assert_batch_invariant(lambda x: K.linear(x, w, b), rows, cases=8, seed=1)


def test_linear_random_shapes_batch_invariant():
    g = torch.Generator().manual_seed(3)
    for k, n in [(7, 5), (300, 130), (4100, 33)]:  # K crosses the 4096 exact chunk
        w = torch.randn(n, k, generator=g).bfloat16()
        rows = (torch.randn(4, k, generator=g) * torch.logspace(-3, 3, k)).bfloat16()
        assert_batch_invariant(lambda x: K.linear(x, w), rows, max_batch=64, cases=5, seed=k)


def test_linear_control_stock_fails():
    # fp32: stock CPU BLAS takes a GEMV path for one row and a GEMM for many on every CPU
    # measured here (bf16 was batch-variant on some CPUs only, so it would be a weak control)
    w, b, rows = W.float(), B.float(), ROWS.float()
    with pytest.raises(BitMismatch):
        assert_batch_invariant(lambda x: F.linear(x, w, b), rows, cases=30, seed=1)


def test_linear_thread_invariant():
    assert_thread_invariant(_ours, (torch.randn(70, 1024).bfloat16(),), threads=(1, 2))


def test_linear_accuracy_and_leading_dims():
    x = torch.randn(2, 3, 1024).bfloat16()
    out = K.linear(x, W, B)
    ref = (x.double() @ W.double().T + B.double())
    assert out.shape == (2, 3, 1024) and out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() <= 2 ** -7 * ref.abs().max()


def test_linear_grad_matches_float64():
    x = torch.randn(5, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    b = torch.randn(32, requires_grad=True)
    (K.linear(x, w, b) ** 2).sum().backward()
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    (F.linear(x64, w64, b64) ** 2).sum().backward()
    for t, r in ((x, x64), (w, w64), (b, b64)):
        assert torch.allclose(t.grad.double(), r.grad, rtol=1e-4, atol=1e-4)  # fp32 backward


def test_linear_bad_inputs():
    with pytest.raises(ValueError, match="dtype"):
        K.linear(torch.randn(2, 4).half(), torch.randn(3, 4).half())
    with pytest.raises(ValueError, match="weight's K"):
        K.linear(torch.randn(2, 4), torch.randn(3, 5))
    with pytest.raises(ValueError, match="bias"):
        K.linear(torch.randn(2, 4), torch.randn(3, 4), torch.randn(4))


@pytest.mark.interpreter
def test_triton_linear_rows_do_not_depend_on_m_in_the_interpreter(monkeypatch):
    """The Triton linear under TRITON_INTERPRET=1 across the M where the table's tile (and block)
    size changes (M <= 64: 128-wide K blocks; larger: 64): a row's bits are the same, as on the GPU.
    The interpreter rounds each K block's exact dot once, so it runs one block size for every M
    (kernels/triton/linear.py INTERP_BK). Control: the table's block size per M changes bits there."""
    import bitmatch.kernels.triton.linear as TL
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(130, 320, generator=g)   # fp32 out: a block's rounding is not hidden by bf16's
    w = torch.randn(96, 320, generator=g)

    def rows(m):
        with K.use_backend("triton"):
            return K.linear(x[:m], w)
    small, large = rows(8), rows(130)
    assert torch.equal(small, large[:8])
    monkeypatch.setattr(TL, "INTERP_BK", None)
    orig = TL._launch

    def table_block(x_, weight, bias, cfg, split, out=None):  # the control: BK as the table says
        bk = cfg[2]
        monkeypatch.setattr(TL, "INTERP_BK", bk)
        return orig(x_, weight, bias, cfg, split, out)
    monkeypatch.setattr(TL, "_launch", table_block)
    assert not torch.equal(rows(8), rows(130)[:8])


@pytest.mark.interpreter
def test_triton_linear_reads_strided_rows_without_a_copy():
    """A column slice (one group of V4's grouped output projection) goes to the Triton kernel at
    its row stride: the contiguous copy's bits, forward and backward, and no copy op (a kernel
    launch on the GPU). Control: the same count with a forced copy sees the clone."""
    from host_reads import dispatched_ops
    g = torch.Generator().manual_seed(8)
    x = torch.randn(7, 4, 48, generator=g).bfloat16()
    w = (torch.randn(40, 48, generator=g) * 0.1).bfloat16()
    gy = torch.randn(7, 40, generator=g).bfloat16()
    with K.use_backend("triton"):
        for i in (0, 3):
            a = x.clone().requires_grad_()
            b = x[:, i].clone().requires_grad_()
            y = K.linear(a[:, i], w)
            want = K.linear(b, w)
            assert torch.equal(y.view(torch.int16), want.view(torch.int16))
            y.backward(gy)
            want.backward(gy)
            assert torch.equal(a.grad[:, i], b.grad)
        with torch.no_grad():
            strided = dispatched_ops(lambda: K.linear(x[:, 1], w))
            copied = dispatched_ops(lambda: K.linear(x[:, 1].contiguous(), w))
    assert copied == strided + 1

"""Block-FP8 W8A8 (kernels/fp8.py, kernels/triton/fp8.py): the quantizers' bytes against an
independent float64 definition, the reference and the Triton quantizers bit-equal in the
interpreter, fp8_linear's rows independent of the batch on both backends (with controls that
fail or differ: a per-tensor activation scale, another K-group order, the stock dequant + matmul),
the straight-through gradients, and errors that name the argument."""
import pytest
import torch
import triton
import triton.language as tl

import bitmatch.kernels as K
from bitmatch.kernels import order, stock
from bitmatch.kernels.fp8 import (
    dequantize_fp8_blocks,
    e4m3_code,
    fp8_linear_reference,
    quantize_fp8_blocks,
    quantize_fp8_groups,
)
from bitmatch.kernels.triton import fp8 as TF
from bitmatch.testing import BitMismatch, assert_batch_invariant, assert_bitwise_equal

F64, F32, BF = torch.float64, torch.float32, torch.bfloat16
FLOOR = float(torch.tensor(1e-10, dtype=F32))

# ---------------------------------------------------------------- the independent definition
# e4m3fn's finite non-negative values by code 0x00..0x7E: 8 subnormals m * 2**-9, then (1 + m/8) * 2**(e-7)
GRID = torch.tensor([m * 2.0 ** -9 for m in range(8)]
                    + [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)][:-1], dtype=F64)


def e4m3_nearest_even(v: torch.Tensor) -> torch.Tensor:
    """uint8 codes of float64 ``v``: the nearest e4m3fn value, ties to the even code, |v| clamped to 448."""
    a = v.abs().clamp(max=448.0)
    hi = torch.searchsorted(GRID, a).clamp(1, 126)
    lo = hi - 1
    d_lo, d_hi = a - GRID[lo], GRID[hi] - a
    code = torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    code = torch.where(a == 0, 0, code)
    return (code | torch.where(torch.signbit(v), 0x80, 0)).to(torch.uint8)


def scale64(amax: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    s = (torch.clamp(amax, min=FLOOR) / 448.0).to(F32).to(F64)  # float64 division then one rounding
    return torch.exp2(torch.ceil(torch.log2(s))) if ue8m0 else s


def groups64(x: torch.Tensor, ue8m0: bool):
    M, Kd = x.shape
    G = -(-Kd // 128)
    xg = torch.nn.functional.pad(x.to(F64), (0, G * 128 - Kd)).view(M, G, 128)
    s = scale64(xg.abs().amax(-1), ue8m0)
    q = (xg / s[..., None]).to(F32).to(F64)  # the correctly rounded fp32 quotient
    return e4m3_nearest_even(q).view(M, -1)[:, :Kd], s.to(F32)


def _rand(shape, seed, lo=-8, hi=3, dtype=BF):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * torch.logspace(lo, hi, shape[-1])[torch.randperm(shape[-1], generator=g)]
            ).to(dtype)


def _u8(q):
    return q.view(torch.uint8)


def test_e4m3_code_matches_the_definition_and_torch():
    """Random fp32 bit patterns (every exponent, subnormals, zeros, huge values) and every tie."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    v = bits.view(F32)
    v = v[torch.isfinite(v)]
    mids = (GRID[1:] + GRID[:-1]) / 2  # every tie between neighbours (exact in fp32)
    ties = torch.cat([mids, -mids, torch.tensor([0.0, -0.0, 2.0 ** -10, 3 * 2.0 ** -10, 448.0, 464.0, 480.0, 1e30])])
    v = torch.cat([v, ties.to(F32), torch.nextafter(ties.to(F32), torch.tensor(1e38))])
    got = e4m3_code(v).to(torch.uint8)
    assert torch.equal(got, e4m3_nearest_even(v.to(F64)))
    assert torch.equal(got, _u8(v.clamp(-448, 448).to(torch.float8_e4m3fn)))  # torch's own cast agrees
    assert int(e4m3_code(torch.tensor([2.0 ** -10]))) == 0 and int(e4m3_code(torch.tensor([3 * 2.0 ** -10]))) == 2
    assert int(e4m3_code(torch.tensor([1e30]))) == 0x7E and int(e4m3_code(torch.tensor([-0.0]))) == 0x80


@pytest.mark.parametrize("fmt", ["float", "ue8m0"])
@pytest.mark.parametrize("dtype", [BF, F32])
def test_quantizers_match_the_float64_definition(fmt, dtype):
    x = _rand((9, 300), seed=1, dtype=dtype)
    x[2] = 0.0                                         # amax 0: the floor's scale, zero codes
    x[3, :128] = torch.tensor([448.0] + [1.0625, 1.1875, 3 * 2.0 ** -10, -2.0 ** -10, 432.0, -0.0] * 22)[:128]
    q, s = quantize_fp8_groups(x, scale_fmt=fmt)
    wq, ws = groups64(x, fmt == "ue8m0")
    assert torch.equal(_u8(q), wq) and torch.equal(s, ws)
    assert float(s[2, 0]) == float(scale64(torch.tensor([0.0], dtype=F64), fmt == "ue8m0")[0]) and not _u8(q[2]).any()
    if fmt == "float":  # amax 448 -> scale 1: the values themselves, ties to even
        assert float(s[3, 0]) == 1.0
        assert q[3, 1:7].float().tolist() == [1.0, 1.25, 2.0 ** -8, -0.0, 448.0, -0.0]
    w = _rand((200, 260), seed=2, dtype=dtype)
    qb, sb = quantize_fp8_blocks(w, scale_fmt=fmt)
    assert sb.shape == (2, 3) and qb.shape == w.shape
    padded = torch.nn.functional.pad(w.to(F64), (0, 124, 0, 56)).view(2, 128, 3, 128)
    sd = scale64(padded.abs().amax(dim=(1, 3)), fmt == "ue8m0")
    qd = e4m3_nearest_even((padded / sd[:, None, :, None]).to(F32).to(F64)).view(256, 384)[:200, :260]
    assert torch.equal(_u8(qb), qd) and torch.equal(sb, sd.to(F32))
    # leading dims: each [N, K] slice quantized alone
    q3, s3 = quantize_fp8_blocks(torch.stack([w, w * 2]), scale_fmt=fmt)
    assert torch.equal(_u8(q3[0]), qd) and torch.equal(s3[1], (sd * 2).to(F32))


@pytest.mark.interpreter
@pytest.mark.parametrize("fmt", ["float", "ue8m0"])
def test_triton_quantizers_equal_the_reference(fmt):
    x = _rand((21, 300), seed=3)
    x[4] = 0.0
    w = _rand((2, 130, 260), seed=4, dtype=F32)
    want = quantize_fp8_groups(x, scale_fmt=fmt), quantize_fp8_blocks(w, scale_fmt=fmt)
    with K.use_backend("triton"):
        got = quantize_fp8_groups(x, scale_fmt=fmt), quantize_fp8_blocks(w, scale_fmt=fmt)
    for (gq, gs), (wq, ws) in zip(got, want):
        assert torch.equal(_u8(gq), _u8(wq)) and torch.equal(gs, ws)


@triton.jit
def _code_kernel(v_ptr, c_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(c_ptr + offs, TF.e4m3_code(tl.load(v_ptr + offs)))


@pytest.mark.interpreter
def test_triton_e4m3_code_equals_the_reference():
    g = torch.Generator().manual_seed(5)
    v = torch.randint(-2 ** 31, 2 ** 31 - 1, (4096,), generator=g, dtype=torch.int64).to(torch.int32).view(F32)
    v = torch.where(torch.isfinite(v), v, 1.0)
    v[:252] = torch.cat([(GRID[1:] + GRID[:-1]) / 2, -(GRID[1:] + GRID[:-1]) / 2]).to(F32)
    c = torch.empty(4096, dtype=torch.int32)
    _code_kernel[(1,)](v, c, N=4096)
    assert torch.equal(c, e4m3_code(v))


def test_non_finite_inputs_and_bad_options_are_refused():
    bad = torch.ones(2, 256)
    bad[1, 7] = float("nan")
    with pytest.raises(ValueError, match="quantize_fp8_groups: x holds inf or NaN"):
        quantize_fp8_groups(bad)
    with pytest.raises(ValueError, match="quantize_fp8_blocks: w holds inf or NaN"):
        quantize_fp8_blocks(bad * float("inf"))
    wq, ws = quantize_fp8_blocks(torch.ones(8, 256))
    with pytest.raises(ValueError, match="fp8_linear: x holds inf or NaN"):
        K.fp8_linear(bad, wq, ws)
    with pytest.raises(ValueError, match="block=.64, 64.*only .128, 128."):
        quantize_fp8_blocks(torch.ones(8, 256), block=(64, 64))
    with pytest.raises(ValueError, match="group=64"):
        quantize_fp8_groups(bad, group=64)
    with pytest.raises(ValueError, match="scale_fmt='e8m0'"):
        quantize_fp8_groups(bad, scale_fmt="e8m0")
    with pytest.raises(ValueError, match="weight_q must be a float8_e4m3fn tensor"):
        K.fp8_linear(bad, torch.ones(8, 256), ws)
    with pytest.raises(ValueError, match="weight_q must be 2-D"):
        K.fp8_linear(bad, wq[None], ws)
    with pytest.raises(ValueError, match=r"weight_scale has shape \(1, 1\).*needs \(1, 2\)"):
        K.fp8_linear(bad, wq, ws[:, :1])
    with pytest.raises(ValueError, match="weight_scale must be a float32"):
        K.fp8_linear(bad, wq, ws.bfloat16())
    with pytest.raises(ValueError, match="x's last dim 255 != weight_q's K 256"):
        K.fp8_linear(bad[:, :255], wq, ws)
    with pytest.raises(ValueError, match="bias must have shape"):
        K.fp8_linear(bad, wq, ws, torch.ones(7))
    with pytest.raises(ValueError, match="fp8_linear_master: weight must be 2-D"):
        K.fp8_linear_master(bad, torch.ones(2, 8, 256))
    with pytest.raises(ValueError, match="fp8_linear_master: x's last dim 256 != weight's K 200"):
        K.fp8_linear_master(bad, torch.ones(8, 200))


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's inf / inf, then the assert
def test_triton_refuses_non_finite_on_the_device():
    bad = torch.ones(3, 200)
    bad[2, 150] = float("inf")
    with K.use_backend("triton"), pytest.raises(RuntimeError, match="quantize_fp8_groups: x holds inf or NaN"):
        quantize_fp8_groups(bad)


# ---------------------------------------------------------------- the linear
W = _rand((48, 300), seed=6, lo=-3, hi=0, dtype=F32)
WQ, WS = quantize_fp8_blocks(W)
BIAS = torch.randn(48, generator=torch.Generator().manual_seed(7)).bfloat16()


def test_fp8_linear_is_the_dequantized_product_and_batch_invariant():
    rows = _rand((6, 300), seed=8, lo=-4, hi=1)
    out = K.fp8_linear(rows, WQ, WS, BIAS)
    xq, sx = quantize_fp8_groups(rows)
    xd = xq.to(F64) * sx.to(F64).repeat_interleave(128, 1)[:, :300]
    exact = xd @ dequantize_fp8_blocks(WQ, WS, F64).T + BIAS.to(F64)
    assert out.dtype == BF and ((out.to(F64) - exact).abs() <= exact.abs() * 2 ** -8 + 1e-30).all()
    assert_batch_invariant(lambda x: K.fp8_linear(x, WQ, WS, BIAS), rows, max_batch=64, cases=6, seed=1)
    assert K.fp8_linear(rows[:0], WQ, WS).shape == (0, 48)
    assert_bitwise_equal(K.fp8_linear(rows.view(2, 3, 300), WQ, WS, BIAS).view(6, 48), out, "leading dims")


@pytest.mark.interpreter
def test_triton_fp8_linear_batch_invariant_across_tiles():
    """Batches up to 150 rows cross the config table's BM / BN changes (64 -> 128)."""
    rows = _rand((4, 300), seed=9, lo=-4, hi=1)
    with K.use_backend("triton"):
        assert_batch_invariant(lambda x: K.fp8_linear(x, WQ, WS, BIAS), rows, max_batch=150, cases=3, seed=2)


def _emulated_triton_order(x, reverse=False):
    """The interpreter's order in torch: per group an exact dot rounded to fp32, times fp32(sx * sw),
    added to the fp32 accumulator (the interpreter's fma is a multiply, then an add)."""
    xq, sx = quantize_fp8_groups(x)
    G = sx.shape[1]
    xg = torch.nn.functional.pad(xq.to(F64), (0, G * 128 - 300)).view(-1, G, 128)
    wg = torch.nn.functional.pad(WQ.to(F64), (0, G * 128 - 300)).view(48, G, 128)
    sw = WS.repeat_interleave(128, 0)[:48]
    acc = torch.zeros(x.shape[0], 48, dtype=F32)
    for kb in (reversed(range(G)) if reverse else range(G)):
        part = (xg[:, kb] @ wg[:, kb].T).to(F32)
        acc = acc + part * (sx[:, kb, None] * sw[None, :, kb])
    return acc


@pytest.mark.interpreter
def test_controls_another_group_order_and_promotion_change_the_bits():
    x = _rand((16, 300), seed=10, lo=-2, hi=1, dtype=F32)
    with K.use_backend("triton"):
        got = K.fp8_linear(x, WQ, WS)
        stamp = order.stamp("triton")
        with order.override(fp8_promote_k=64):  # two promoted pieces per group: other bits, other stamp
            assert order.stamp("triton")["fingerprint"] != stamp["fingerprint"]
            other = K.fp8_linear(x, WQ, WS)
    assert_bitwise_equal(got, _emulated_triton_order(x), "the interpreter's group order")
    assert not torch.equal(_emulated_triton_order(x, reverse=True), got)
    assert not torch.equal(other, got)


def test_control_per_tensor_activation_scale_is_batch_variant():
    """One activation scale for the whole batch (per-tensor W8A8): a row's codes follow its neighbours."""
    def per_tensor(x):
        s = torch.clamp(x.float().abs().amax(), min=FLOOR) / 448.0
        xq = e4m3_code(x.float() / s).to(torch.uint8).view(torch.float8_e4m3fn)
        return fp8_linear_reference(xq, s.expand(x.shape[0], 3).contiguous(), WQ, WS, BIAS, x.dtype)
    rows = _rand((6, 300), seed=11, lo=-4, hi=1)
    with pytest.raises(BitMismatch):
        assert_batch_invariant(per_tensor, rows, max_batch=64, cases=10, seed=3)


def test_control_stock_dequant_matmul_is_batch_variant_and_differs():
    # fp32: CPU BLAS takes one path for a row alone and another for many (tests/test_linear.py)
    w = _rand((256, 1024), seed=12, lo=-3, hi=0, dtype=F32)
    wq, ws = quantize_fp8_blocks(w)
    rows = _rand((6, 1024), seed=13, lo=-3, hi=1, dtype=F32)
    with pytest.raises(BitMismatch):
        assert_batch_invariant(lambda x: stock.fp8_linear(x, wq, ws), rows, cases=30, seed=1)
    assert not torch.equal(stock.fp8_linear(rows, wq, ws), K.fp8_linear(rows, wq, ws))


@pytest.mark.interpreter
def test_triton_gpu_branch_traces_in_the_interpreter():
    """The GPU branch (fp8 tl.dot with max_num_imprecise_acc) run by the interpreter, which emulates
    the fp8 dot through fp16 and numpy: the code path is valid and the values are right; its bits
    are the GPU's business (benchmarks/ops/fp8_linear.py)."""
    x = _rand((5, 300), seed=14, lo=-2, hi=1)
    xq, sx = quantize_fp8_groups(x)
    out = torch.empty(5, 48, dtype=BF)
    TF._fp8_linear_kernel[(1,)](xq, sx, WQ, WS, BIAS, out, 5, 48, 300, 3, out.stride(0), HAS_BIAS=True, BM=64,
                                BN=64, PK=128, GROUP_M=8, BF16=True, INTERP=False)
    want = fp8_linear_reference(xq, sx, WQ, WS, BIAS, BF)
    assert torch.allclose(out.float(), want.float(), rtol=2 ** -7, atol=1e-3)


# ---------------------------------------------------------------- the trainer side
@pytest.mark.parametrize("dtype", [BF, F32])
def test_master_forward_is_fp8_linear_on_the_synced_bytes_and_grads_pass_straight_through(dtype):
    g = torch.Generator().manual_seed(15)
    w = (torch.randn(40, 260, generator=g) * 0.05).to(dtype).requires_grad_()
    b = (torch.randn(40, generator=g) * 0.1).to(dtype).requires_grad_()
    x = torch.randn(2, 3, 260, generator=g).to(dtype).requires_grad_()
    y = K.fp8_linear_master(x, w, b, scale_fmt="ue8m0")
    wq, ws = quantize_fp8_blocks(w, scale_fmt="ue8m0")
    assert_bitwise_equal(y, K.fp8_linear(x, wq, ws, b, scale_fmt="ue8m0"), "master vs the synced bytes")
    gy = torch.randn(y.shape, generator=g).to(dtype)
    y.backward(gy)
    g2, x2 = gy.reshape(6, 40), x.detach().reshape(6, 260)
    assert_bitwise_equal(x.grad.reshape(6, 260), g2 @ dequantize_fp8_blocks(wq, ws, dtype), "grad x")
    assert_bitwise_equal(w.grad, g2.t() @ x2, "grad w: straight through the quantizer")
    assert torch.allclose(b.grad.float(), g2.float().sum(0), rtol=1e-2, atol=1e-2)
    # fp8_linear: x's gradient only (the fp8 weight is not trained)
    x.grad = None
    K.fp8_linear(x, wq, ws).sum().backward()
    assert torch.allclose(x.grad.reshape(6, 260).double(), torch.ones(6, 40, dtype=F64) @ dequantize_fp8_blocks(
        wq, ws, F64), rtol=2e-2, atol=2e-2)

import pytest
import torch
import torch.nn.functional as F

import bitmatch.kernels as K
from bitmatch.testing import BitMismatch, assert_batch_invariant, assert_bitwise_equal

SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "linear", "llama3", "yarn"])
def test_cos_sin_position_invariant_and_close_to_hf(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    pos = torch.randint(0, 40000, (300,))
    cos, sin = K.rotary_cos_sin(pos, 128, 500000.0, scaling, max_position_embeddings=32768)
    for i in (0, 17, 299):  # a position alone gets the same bits as inside any batch
        c1, s1 = K.rotary_cos_sin(pos[i:i + 1], 128, 500000.0, scaling, max_position_embeddings=32768)
        assert_bitwise_equal(c1[0], cos[i], "cos")
        assert_bitwise_equal(s1[0], sin[i], "sin")
    rp = dict(scaling or {"rope_type": "default"}, rope_theta=500000.0)
    cfg = LlamaConfig(hidden_size=128 * 4, num_attention_heads=4, max_position_embeddings=32768, rope_parameters=rp)
    inv, factor = ROPE_INIT_FUNCTIONS[rp["rope_type"]](cfg, "cpu") if rp["rope_type"] != "default" else (
        1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128)), 1.0)
    ang = pos.double()[:, None] * inv.double()[None]
    assert (cos.double() - torch.cos(ang) * factor).abs().max() < 2e-3
    assert (sin.double() - torch.sin(ang) * factor).abs().max() < 2e-3


def test_dynamic_rope_refused():
    with pytest.raises(ValueError, match="dynamic"):
        K.rotary_cos_sin(torch.arange(4), 64, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


def test_apply_rotary_batch_invariant_and_hf_order():
    q, k = torch.randn(20, 4, 64).bfloat16(), torch.randn(20, 2, 64).bfloat16()
    pos = torch.randint(0, 5000, (20,))
    cos, sin = K.rotary_cos_sin(pos, 64, 10000.0, dtype=torch.bfloat16)
    assert_batch_invariant(lambda a, b, c, s: K.apply_rotary(a, b, c, s), (q, k, cos, sin),
                           max_batch=64, cases=8, seed=5)
    # HF's apply_rotary_pos_emb in bf16 gives the same bits (same rounding points)
    c2, s2 = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    rot = torch.cat([-q[..., 32:], q[..., :32]], -1)
    assert_bitwise_equal(K.apply_rotary(q, k, cos, sin)[0], q * c2 + rot * s2, "hf rotary")


def test_rotary_grad():
    q = torch.randn(5, 2, 8, requires_grad=True)
    k = torch.randn(5, 1, 8, requires_grad=True)
    cos, sin = K.rotary_cos_sin(torch.arange(5), 8, 10000.0)
    a, b = K.apply_rotary(q, k, cos, sin)
    (a.sum() + (b ** 2).sum()).backward()
    c, s = torch.cat([cos, cos], -1)[:, None].double(), torch.cat([sin, sin], -1)[:, None].double()
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    rot = lambda x: torch.cat([-x[..., 4:], x[..., :4]], -1)  # noqa: E731
    ((q64 * c + rot(q64) * s).sum() + ((k64 * c + rot(k64) * s) ** 2).sum()).backward()
    assert torch.allclose(q.grad.double(), q64.grad, atol=1e-5) and torch.allclose(k.grad.double(), k64.grad, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_and_mul_batch_invariant(dtype):
    rows = (torch.randn(6, 2 * 333) * 4).to(dtype)
    assert_batch_invariant(K.silu_and_mul, rows, cases=10, seed=6)
    ref = F.silu(rows[:, :333].double()) * rows[:, 333:].double()
    assert (K.silu_and_mul(rows).double() - ref).abs().max() <= 0.02 * ref.abs().max()


def test_silu_grad_and_errors():
    x = torch.randn(3, 8, requires_grad=True)
    K.silu_and_mul(x).sum().backward()
    x64 = x.detach().double().requires_grad_()
    (F.silu(x64[:, :4]) * x64[:, 4:]).sum().backward()
    assert torch.allclose(x.grad.double(), x64.grad, atol=1e-5)
    with pytest.raises(ValueError, match="even"):
        K.silu_and_mul(torch.randn(2, 5))


def test_elementwise_control_harness_can_fail():
    # elementwise stock ops are batch-invariant on this CPU; this shows the harness fails an
    # op whose rounding depends on the batch (a batch-wide scale, as fp8 quantization does)
    def batch_scaled(x):
        s = x.abs().max()
        return (F.silu(x[..., :333] / s) * s).to(x.dtype)
    with pytest.raises(BitMismatch):
        assert_batch_invariant(batch_scaled, torch.randn(6, 666).bfloat16(), cases=10, seed=7)


def test_rotary_table_rows_equal_direct_computation():
    """rotary_cos_sin gathers rows of a per-config table (no CPU math per forward): every row, also
    after the table grows and for yarn/llama3 scaling, has the bits of the direct float64 computation."""
    from bitmatch.kernels import _exact, rotary as R

    def direct(p, sc, dt):
        inv, af = R._inv_freq(64, 1e4, sc, None)
        s, c = _exact.sincos64(p.double()[:, None] * inv[None])
        return (c * af).to(dt), (s * af).to(dt)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    for sc in (None, yarn):
        for dt in (torch.float32, torch.bfloat16):
            for hi in (100, 9000):                                # 9000: the table doubles past 4096
                p = torch.randint(0, hi, (257,))
                got, want = K.rotary_cos_sin(p, 64, 1e4, sc, dtype=dt), direct(p, sc, dt)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                # a host bound (the engine's step): the same rows, no read back of the positions
                got = K.rotary_cos_sin(p, 64, 1e4, sc, dtype=dt, max_seq_len=hi)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_rotary_table_outlives_its_growth():
    """A captured CUDA graph holds the table's address: a grown table replaces it in the cache, but
    the old one stays alive (its storage is not reused while a graph may read it)."""
    from bitmatch.kernels import rotary as R
    K.rotary_cos_sin(torch.arange(3), 48, 1234.5, max_seq_len=3)
    key = next(k for k in R._TABLES if k[:2] == (48, 1234.5))
    old = R._TABLES[key]
    K.rotary_cos_sin(torch.arange(3), 48, 1234.5, max_seq_len=5000)
    assert R._TABLES[key][0].shape[0] == 8192 and any(t is old for t in R._RETIRED)

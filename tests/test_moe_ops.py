"""moe_route / moe_experts: batch invariance (a token alone vs random batches of 1..512, experts
with zero tokens or crowded by neighbours, top-k 1/2/8, swiglu and relu2, bf16 and fp32), the
tie rule, parity with HF's Qwen3-MoE / DeepSeek-V4 / Nemotron-H modules, gradients vs float64,
a control that fails on HF's stock experts, and the Triton kernels under the interpreter.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import bitmatch.kernels as K
from bitmatch.kernels import order
from bitmatch.testing import BitMismatch, assert_batch_invariant, assert_bitwise_equal

BF = torch.bfloat16
E, H, I = 16, 64, 32


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _experts(dtype, activation="swiglu", seed=0, e=E):
    n_in = 2 * I if activation == "swiglu" else I
    w_in = (torch.randn(e, n_in, H, generator=_g(seed)) * 0.2).to(dtype)
    w_out = (torch.randn(e, H, I, generator=_g(seed + 1)) * 0.2).to(dtype)
    return w_in, w_out


def _tokens(n, k, dtype, seed=0, e=E):
    g = _g(seed)
    x = torch.randn(n, H, generator=g).to(dtype)
    logits = torch.randn(n, e, generator=g) * 2
    w, ids = K.moe_route(logits, k, renormalize=True)
    return x, ids, w


def _hf_experts(kind, w_in, w_out, limit=None):
    """HF's own expert modules, eager implementation, holding our weights."""
    cfg = SimpleNamespace(num_experts=w_in.shape[0], num_local_experts=w_in.shape[0],
                          n_routed_experts=w_in.shape[0], hidden_size=H, moe_intermediate_size=I,
                          intermediate_size=I, hidden_act="silu", mlp_hidden_act="relu2",
                          moe_latent_size=None, swiglu_limit=limit, _experts_implementation="eager")
    if kind == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as Cls
    elif kind == "deepseek_v4":
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts as Cls
    else:
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts as Cls
    m = Cls(cfg)
    with torch.no_grad():
        if kind == "nemotron_h":
            m.up_proj.copy_(w_in)
        else:
            m.gate_up_proj.copy_(w_in)
        m.down_proj.copy_(w_out)
    return m.to(w_in.dtype)


# ---------------------------------------------------------------- routing
@pytest.mark.parametrize("scoring,k", [("softmax", 1), ("softmax", 8), ("sigmoid", 2), ("sqrtsoftplus", 8)])
def test_route_batch_invariant(scoring, k):
    rows = torch.randn(6, E, generator=_g(1)) * 3
    bias = torch.randn(E, generator=_g(2)) * 0.1 if scoring != "softmax" else None
    assert_batch_invariant(lambda z: K.moe_route(z, k, scoring=scoring, renormalize=True, correction_bias=bias,
                                                 scaling=1.5), rows, cases=6, seed=k)


def _rank_order(sel, k):
    return [sorted(range(sel.shape[1]), key=lambda e: (-float(sel[t, e]), e))[:k] for t in range(sel.shape[0])]


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_route_ties_go_to_lowest_index(scoring):
    z = torch.randn(40, E, generator=_g(3))
    z[:, 9] = z[:, 2]          # duplicated router columns: equal scores, 2 must rank before 9
    z[:, 12] = z[:, 4]
    z[:5] = 0.25               # all logits equal: ids 0..k-1
    z[5:8, :6] = z[5:8, :6].amax(1, keepdim=True) + 1  # six-way tie at the top
    w, ids = K.moe_route(z, 8, scoring=scoring)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert ids.tolist() == _rank_order(K.moe.scores_reference(z, scoring), 8)
    assert ids[:5].tolist() == [list(range(8))] * 5
    assert ids[5:8, :6].tolist() == [list(range(6))] * 3
    # the bias ranks experts but weights stay unbiased scores
    bias = torch.zeros(E)
    bias[15] = 10.0
    wb, ib = K.moe_route(z, 2, scoring=scoring, correction_bias=bias)
    assert (ib[:, 0] == 15).all()
    assert_bitwise_equal(wb[:, 0], K.moe.scores_reference(z, scoring)[:, 15], "unbiased weight")


def test_route_matches_hf_routers():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    x = torch.randn(64, H, generator=_g(4))
    bias = torch.randn(E, generator=_g(5)) * 0.05
    cases = []
    for norm in (False, True):
        r = Qwen3MoeTopKRouter(SimpleNamespace(num_experts_per_tok=4, num_experts=E, norm_topk_prob=norm,
                                               hidden_size=H))
        cases.append((r, dict(scoring="softmax", renormalize=norm), 4))
    r = DeepseekV4TopKRouter(SimpleNamespace(num_experts_per_tok=6, num_local_experts=E, hidden_size=H,
                                             scoring_func="sqrtsoftplus", routed_scaling_factor=1.5))
    cases.append((r, dict(scoring="sqrtsoftplus", renormalize=True, scaling=1.5, correction_bias=bias), 6))
    r = NemotronHTopkRouter(SimpleNamespace(num_experts_per_tok=6, num_local_experts=E, hidden_size=H, n_group=1,
                                            topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5))
    cases.append((r, dict(scoring="sigmoid", renormalize=True, scaling=2.5, correction_bias=bias), 6))
    for router, kw, k in cases:
        with torch.no_grad():
            router.weight.normal_(generator=_g(6))
            if hasattr(router, "e_score_correction_bias"):
                router.e_score_correction_bias.copy_(bias)
            logits, hw, hid = router(x)
        w, ids = K.moe_route(logits, k, **kw)          # HF's own logits: compare the routing only
        hs, order = hid.sort(-1)
        assert torch.equal(ids.sort(-1).values, hs), type(router).__name__
        err = (w.gather(1, ids.sort(-1).indices) - hw.gather(1, order)).abs().max()
        assert err < 1e-6 * kw.get("scaling", 1.0), type(router).__name__


def test_route_grad_matches_float64():
    z = torch.randn(7, E, generator=_g(7), requires_grad=True)
    gw = torch.randn(7, 3, generator=_g(8))
    for scoring in ("softmax", "sigmoid", "sqrtsoftplus"):
        w, ids = K.moe_route(z, 3, scoring=scoring, renormalize=True, scaling=1.5)
        (gl,) = torch.autograd.grad((w * gw).sum(), z)
        z64 = z.detach().double().requires_grad_()
        s = {"softmax": lambda a: a.softmax(-1), "sigmoid": torch.sigmoid,
             "sqrtsoftplus": lambda a: F.softplus(a).sqrt()}[scoring](z64).gather(1, ids)
        ((s / s.sum(-1, keepdim=True) * 1.5) * gw.double()).sum().backward()
        assert torch.allclose(gl.double(), z64.grad, rtol=1e-4, atol=1e-6), scoring


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=pytest.mark.interpreter)])
def test_combine_batch_invariant_and_the_experts_own(backend):
    """moe_combine: each token's bits from its own rows alone, and moe_experts(x, ...) ==
    moe_combine(each slot's expert output at weight 1, w): the combine expert parallelism runs."""
    if backend == "triton":
        pytest.importorskip("triton")
    rows = (torch.randn(6, 3, 64, generator=_g(60)).to(BF), torch.rand(6, 3, generator=_g(61)))
    with K.use_backend(backend):
        assert_batch_invariant(K.moe_combine, rows, cases=4, seed=3, max_batch=64)
        w_in, w_out = _experts(BF)
        x, ids, w = _tokens(5, 3, BF, seed=9)
        y = torch.stack([K.moe_experts(x, ids[:, r:r + 1], torch.ones(x.shape[0], 1), w_in, w_out)
                         for r in range(ids.shape[1])], 1)
        assert_bitwise_equal(K.moe_combine(y, w), K.moe_experts(x, ids, w, w_in, w_out), "experts == combine(rows)")


def test_combine_grads_match_float64_and_control():
    y = torch.randn(7, 4, 32, generator=_g(80), requires_grad=True)
    w = torch.rand(7, 4, generator=_g(81), requires_grad=True)
    g = torch.randn(7, 32, generator=_g(82))
    got = torch.autograd.grad(K.moe_combine(y, w), (y, w), g)
    y64, w64 = y.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = torch.autograd.grad((w64.unsqueeze(-1) * y64).sum(1), (y64, w64), g.double())
    for a, b in zip(got, want):
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-6
    # control: the stock combine (torch's sum over k, in the model dtype) is not the rank-order fp32 sum
    yb, wb = y.detach().to(BF), w.detach()
    assert not torch.equal(K.moe_combine(yb, wb), K.stock.moe_combine(yb, wb))


# ---------------------------------------------------------------- experts
@pytest.mark.parametrize("dtype,activation,k", [(BF, "swiglu", 8), (torch.float32, "swiglu", 2),
                                                (BF, "relu2", 1), (torch.float32, "relu2", 8)])
def test_experts_batch_invariant(dtype, activation, k):
    w_in, w_out = _experts(dtype, activation)
    limit = 0.5 if activation == "swiglu" and k == 2 else None  # DeepSeek's clamp really clamps
    rows = _tokens(5, k, dtype, seed=k)
    assert_batch_invariant(lambda x, i, w: K.moe_experts(x, i, w, w_in, w_out, activation=activation,
                                                         swiglu_limit=limit), rows, cases=5, seed=k,
                           max_batch=512 if dtype == BF else 128)  # fp32 rows cost four exact slice products


def test_experts_zero_token_and_crowded_experts():
    w_in, w_out = _experts(BF)
    x, ids, w = _tokens(1, 2, BF, seed=9)
    alone = K.moe_experts(x, ids, w, w_in, w_out)                     # 14 of 16 experts get nothing
    xs = torch.randn(300, H, generator=_g(10)).to(BF)
    crowd = K.moe_experts(torch.cat([xs, x]), torch.cat([ids.expand(300, 2), ids]),
                          torch.cat([torch.rand(300, 2, generator=_g(11)), w]), w_in, w_out)
    assert_bitwise_equal(crowd[-1:], alone, "token among 300 on the same experts")
    other = (ids + 3) % E                                             # neighbours avoid its experts
    mixed = K.moe_experts(torch.cat([x, xs[:50]]), torch.cat([ids, other.expand(50, 2)]),
                          torch.cat([w, w.expand(50, 2)]), w_in, w_out)
    assert_bitwise_equal(mixed[:1], alone, "token with neighbours elsewhere")


@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_experts_row_is_linear_act_linear(activation):
    """k = 1, weight 1.0: the output is exactly linear -> activation -> linear of that row."""
    w_in, w_out = _experts(BF, activation)
    x = torch.randn(3, H, generator=_g(12)).to(BF)
    ids = torch.tensor([[5], [0], [5]])
    out = K.moe_experts(x, ids, torch.ones(3, 1), w_in, w_out, activation=activation)
    for t, e in enumerate(ids[:, 0].tolist()):
        h = K.linear(x[t:t + 1], w_in[e])
        a = K.silu_and_mul(h) if activation == "swiglu" else (torch.relu(h).double() ** 2).to(BF)
        assert_bitwise_equal(out[t:t + 1], K.linear(a, w_out[e]), f"row {t}")


def test_experts_match_hf_fp32():
    x, ids, w = _tokens(40, 4, torch.float32, seed=13)
    for kind, act, limit in [("qwen3_moe", "swiglu", None), ("deepseek_v4", "swiglu", 0.4),
                             ("nemotron_h", "relu2", None)]:
        w_in, w_out = _experts(torch.float32, act, seed=14)
        with torch.no_grad():
            ref = _hf_experts(kind, w_in, w_out, limit)(x, ids, w)
        out = K.moe_experts(x, ids, w, w_in, w_out, activation=act, swiglu_limit=limit)
        assert (out - ref).abs().max() < 1e-5 * max(1.0, float(ref.abs().max())), kind


def test_block_matches_hf_qwen3_moe_sparse_block_fp32():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    for norm in (True, False):
        cfg = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=4, moe_intermediate_size=I,
                             norm_topk_prob=norm)
        cfg._experts_implementation = "eager"
        blk = Qwen3MoeSparseMoeBlock(cfg)
        with torch.no_grad():
            blk.gate.weight.normal_(generator=_g(15))
            blk.experts.gate_up_proj.normal_(0, 0.2, generator=_g(16))
            blk.experts.down_proj.normal_(0, 0.2, generator=_g(17))
            x = torch.randn(2, 30, H, generator=_g(18))
            ref = blk(x).reshape(-1, H)
            flat = x.reshape(-1, H)
            w, ids = K.moe_route(K.linear(flat, blk.gate.weight), 4, renormalize=norm)
            out = K.moe_experts(flat, ids, w, blk.experts.gate_up_proj, blk.experts.down_proj)
        assert (out - ref).abs().max() < 1e-5 * float(ref.abs().max())  # relative to the output scale


@pytest.mark.parametrize("activation,limit", [("swiglu", None), ("swiglu", 0.3), ("relu2", None)])
def test_experts_grads_match_float64(activation, limit):
    w_in, w_out = _experts(torch.float32, activation, seed=19, e=6)
    x, ids, w = _tokens(9, 3, torch.float32, seed=20, e=6)
    leaves = [t.clone().requires_grad_() for t in (x, w, w_in, w_out)]
    g = torch.randn(9, H, generator=_g(21))
    (K.moe_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3], activation=activation,
                   swiglu_limit=limit) * g).sum().backward()
    l64 = [t.detach().double().requires_grad_() for t in (x, w, w_in, w_out)]
    kind = {"relu2": "nemotron_h"}.get(activation, "deepseek_v4" if limit else "qwen3_moe")
    m = _hf_experts(kind, l64[2], l64[3], limit)                     # float64 oracle, our leaves
    params = (m.up_proj if kind == "nemotron_h" else m.gate_up_proj, m.down_proj)
    (m(l64[0], ids, l64[1]) * g.double()).sum().backward()
    for name, ours, ref in zip(("x", "weights", "w_in", "w_out"), leaves,
                               (l64[0].grad, l64[1].grad, params[0].grad, params[1].grad)):
        assert torch.allclose(ours.grad.double(), ref, rtol=1e-4, atol=1e-5), name


def test_experts_bf16_grads_flow():
    w_in, w_out = (t.requires_grad_() for t in _experts(BF))
    x, ids, w = _tokens(8, 2, BF, seed=22)
    x.requires_grad_()
    z = torch.randn(8, E, generator=_g(23), requires_grad=True)
    w, ids = K.moe_route(z, 2, renormalize=True)
    K.moe_experts(x, ids, w, w_in, w_out).float().pow(2).sum().backward()
    for t in (x, w_in, w_out, z):
        assert t.grad is not None and t.grad.dtype == t.dtype and bool(t.grad.abs().sum() > 0)


def test_control_hf_experts_are_batch_variant():
    """The same harness on HF's stock Qwen3MoeExperts (fp32: CPU BLAS takes another path for an
    expert with one row than for one with many, and index_add sums in expert order) fails."""
    w_in, w_out = _experts(torch.float32, seed=26)
    hf = _hf_experts("qwen3_moe", w_in, w_out)
    rows = _tokens(5, 8, torch.float32, seed=27)
    with torch.no_grad(), pytest.raises(BitMismatch):
        assert_batch_invariant(lambda x, i, w: hf(x, i, w), rows, cases=30, seed=3)
    # ours on the same rows and cases passes
    assert_batch_invariant(lambda x, i, w: K.moe_experts(x, i, w, w_in, w_out), rows, max_batch=128, cases=3,
                           seed=3)


def test_zero_tokens():
    w_in, w_out = (t.requires_grad_() for t in _experts(torch.float32, e=4))
    z = torch.randn(0, 4, requires_grad=True)
    x = torch.randn(0, H, requires_grad=True)
    w, ids = K.moe_route(z, 2, renormalize=True)
    out = K.moe_experts(x, ids, w, w_in, w_out)
    assert out.shape == (0, H) and ids.shape == (0, 2)
    out.sum().backward()  # runs; nothing flows (None or zero gradients)
    assert all(t.grad is None or float(t.grad.abs().sum()) == 0.0 for t in (x, z, w_in, w_out))


def test_bad_inputs():
    w_in, w_out = _experts(BF)
    x, ids, w = _tokens(3, 2, BF)
    z = torch.randn(3, E)
    for kw, name in [(dict(top_k=E + 1), "top_k"), (dict(top_k=0), "top_k"), (dict(scoring="tanh"), "scoring"),
                     (dict(correction_bias=torch.zeros(E - 1)), "correction_bias")]:
        with pytest.raises(ValueError, match=name):
            K.moe_route(z, **{"top_k": 2, **kw})
    with pytest.raises(ValueError, match="router_logits"):
        K.moe_route(z.half(), 2)
    bad = [((x, ids + E, w, w_in, w_out), {}, "ids out of range"), ((x, -ids, w, w_in, w_out), {}, "ids"),
           ((x, ids.float(), w, w_in, w_out), {}, "ids"), ((x, ids, w[:, :1], w_in, w_out), {}, "weights"),
           ((x.half(), ids, w, w_in, w_out), {}, "x"), ((x, ids, w, w_in.float(), w_out), {}, "w_in"),
           ((x, ids, w, w_in[:, :, :8], w_out), {}, "w_in"), ((x, ids, w, w_in, w_out[:, :, :8]), {}, "w_out"),
           ((x, ids, w, w_in, w_out), dict(activation="gelu"), "activation"),
           ((x, ids, w, w_in, w_out), dict(activation="relu2"), "w_out"),
           ((x, ids, w, w_in, w_out), dict(swiglu_limit=-1.0), "swiglu_limit"),
           ((x[:2], ids, w, w_in, w_out), {}, "ids")]
    for args, kw, name in bad:
        with pytest.raises(ValueError, match=name):
            K.moe_experts(*args, **kw)


# ---------------------------------------------------------------- Triton (interpreter)
triton_only = pytest.mark.interpreter


def _tm():
    pytest.importorskip("triton")
    import bitmatch.kernels.triton.moe as tm
    return tm


@triton_only
def test_triton_route_ties_and_row_invariance():
    tm = _tm()
    z = torch.randn(13, 24, generator=_g(30)) * 2
    z[:, 17] = z[:, 3]
    z[:4] = -1.5
    bias = torch.randn(24, generator=_g(31)) * 0.1
    for scoring, b in (("softmax", None), ("sigmoid", bias), ("sqrtsoftplus", bias)):
        w, ids = tm.moe_route(z, b, 8, scoring, True, 1.5)
        rw, rids = K.moe.route_reference(z, b, 8, scoring, True, 1.5)
        sel = K.moe.scores_reference(z, scoring) + (0 if b is None else b)
        assert ids.tolist() == _rank_order(sel, 8) == rids.tolist(), scoring
        assert (w - rw).abs().max() < 1e-5, scoring
        for t in (0, 5, 12):
            w1, i1 = tm.moe_route(z[t:t + 1].contiguous(), b, 8, scoring, True, 1.5)
            assert_bitwise_equal(w1, w[t:t + 1], f"{scoring} row {t}")
            assert torch.equal(i1, ids[t:t + 1])


def _tri_case(activation, dtype, T=40, k=2, e=6, h=160, i=48, seed=32):
    n_in = 2 * i if activation == "swiglu" else i
    w_in = (torch.randn(e, n_in, h, generator=_g(seed)) * 0.1).to(dtype)
    w_out = (torch.randn(e, h, i, generator=_g(seed + 1)) * 0.1).to(dtype)
    x = torch.randn(T, h, generator=_g(seed + 2)).to(dtype)
    w, ids = K.moe_route(torch.randn(T, e, generator=_g(seed + 3)), k, renormalize=True)
    if k == 2:  # expert 4 only ever at rank 1, expert 1 only at rank 0, ranks distinct
        ids[:, 0] = torch.where(ids[:, 0] == 4, 5, ids[:, 0])
        ids[:, 1] = torch.where(ids[:, 1] == 1, 4, ids[:, 1])
        same = ids[:, 0] == ids[:, 1]
        ids[same, 1] = torch.where(ids[same, 0] == 5, 0, 5)
    return x, ids, w, w_in, w_out


@triton_only
@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_triton_experts_row_is_triton_linear(activation):
    """k = 1, weight 1.0, fp32 (no interpreter bf16 cast issue): the grouped GEMM's row equals
    Triton linear -> activation -> Triton linear of that row, bit for bit, also with SPLIT = 2."""
    tm = _tm()
    import bitmatch.kernels.triton.activation as ta
    import bitmatch.kernels.triton.linear as tl_
    for h, split in ((160, 1), (512, 2)) if activation == "swiglu" else ((160, 1),):
        x, ids, _, w_in, w_out = _tri_case(activation, torch.float32, T=4, k=1, h=h, i=32)
        with order.override(linear_split_table=(((w_in.shape[1], h), split),)):
            # the interpreter rounds each K block's float64 dot to fp32, so there the block size is
            # part of the bits (not on the GPU, DESIGN section 4): linear and the experts both run
            # INTERP_BK under it, whatever the config says
            out = tm.moe_experts(x, ids, torch.ones(4, 1), w_in, w_out, activation, None,
                                 config=(16, 32, 32, 128, 4, 4))
            for t in range(4):
                e = int(ids[t, 0])
                hrow = tl_.linear(x[t:t + 1].contiguous(), w_in[e].contiguous())
                a = ta.silu_and_mul(hrow) if activation == "swiglu" else torch.relu(hrow) ** 2
                want = tl_.linear(a, w_out[e].contiguous())
                assert_bitwise_equal(out[t:t + 1], want, f"{activation} h={h} row {t}")


_TRI_CONFIGS = [(16, 32, 64, 128, 4, 4), (64, 16, 32, 128, 4, 4)]


@triton_only
@pytest.mark.parametrize("activation,dtype,limit", [("swiglu", BF, None), ("swiglu", torch.float32, 0.2),
                                                    ("relu2", BF, None)])
def test_triton_experts_invariant_and_close(activation, dtype, limit):
    tm = _tm()
    x, ids, w, w_in, w_out = _tri_case(activation, dtype, T=24, h=136, i=32)
    outs = [tm.moe_experts(x, ids, w, w_in, w_out, activation, limit, config=c) for c in _TRI_CONFIGS]
    for o in outs[1:]:                                  # row tiles of 16/32/64, other BN: same bits
        assert_bitwise_equal(o, outs[0], "tile configs")
    ref = K.moe.experts_reference(x, ids, w, w_in, w_out, activation, limit)
    tol = 0.03 if dtype == BF else 1e-5                 # the interpreter truncates fp32 -> bf16
    assert (outs[0].double() - ref.double()).abs().max() <= tol * ref.double().abs().max()
    for t in (0, 23):                                   # a token alone: 4 of 6 experts get nothing
        one = tm.moe_experts(x[t:t + 1].contiguous(), ids[t:t + 1].contiguous(), w[t:t + 1].contiguous(),
                             w_in, w_out, activation, limit, config=_TRI_CONFIGS[0])
        assert_bitwise_equal(one, outs[0][t:t + 1], f"token {t} alone")
    perm = torch.randperm(24, generator=_g(40))          # shuffled batch, other expert loads
    shuf = tm.moe_experts(x[perm].contiguous(), ids[perm].contiguous(), w[perm].contiguous(), w_in, w_out,
                          activation, limit, config=_TRI_CONFIGS[1])
    assert_bitwise_equal(shuf, outs[0][perm], "shuffled batch")


@triton_only
def test_triton_combine_rank_order_equals_reference():
    """fp32 y: the combine kernel's sum is the reference's rank-order sum bit for bit (and the
    order matters: reversing the ranks changes some bits)."""
    T, k, h = 9, 8, 200
    y = torch.randn(T, k, h, generator=_g(41)) * torch.logspace(-3, 3, k)[None, :, None]
    w = torch.rand(T, k, generator=_g(42))
    with K.use_backend("triton"):
        out = K.moe_combine(y, w)  # the kernel moe_experts ends with, as a public op
    assert_bitwise_equal(out, K.moe.combine_reference(y, w), "combine")
    rev = K.moe.combine_reference(y.flip(1).contiguous(), w.flip(1).contiguous())
    assert not torch.equal(rev, out)


@triton_only
def test_triton_layout_rank_launch_is_the_stable_sort(monkeypatch):
    """A decode step's expert sort (one rank launch) is torch.sort(stable=True)'s permutation, ties
    (one expert's rows) in row order; the experts' output is bit-equal to the torch.sort path's.
    Control: the same check catches an unstable order of the tied rows."""
    tm = _tm()
    for T, k, e in ((1, 1, 3), (64, 6, 64), (341, 6, 8)):   # 341 x 6 = 2046 rows: tied in long runs
        ids = torch.randint(0, e, (T, k), generator=_g(50 + T))
        order_, tok, counts, row_start, *_ = tm.expert_layout(ids, e, 16)
        want = torch.sort(ids.reshape(-1), stable=True).indices
        assert torch.equal(order_, want) and torch.equal(tok, want // k), (T, k, e)
        assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=e))
        if (counts > 1).any():                              # control: an unstable tie order fails
            assert not torch.equal(torch.cat([g.flip(0) for g in want.split(counts.tolist())]), want)
    x, ids, w, w_in, w_out = _tri_case("swiglu", BF, T=24, h=136, i=32)
    fast = tm.moe_experts(x, ids, w, w_in, w_out, "swiglu", None, config=_TRI_CONFIGS[0])
    monkeypatch.setattr(tm, "RANK_MAX_S", 0)                 # every row count takes torch.sort
    assert_bitwise_equal(tm.moe_experts(x, ids, w, w_in, w_out, "swiglu", None, config=_TRI_CONFIGS[0]), fast,
                         "rank launch vs torch.sort")


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_moe_scores_are_route_weights_in_expert_order(scoring):
    """Every expert's score (hash routing): moe_route's unnormalized weights scattered to expert
    order, row-invariant, with a gradient to the logits; bad input named."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(13, 16, generator=g, requires_grad=True)
    s = K.moe_scores(logits, scoring)
    w, ids = K.moe_route(logits.detach(), 16, scoring=scoring)
    assert torch.equal(s.detach().gather(1, ids), w) and s.dtype == torch.float32
    assert torch.equal(K.moe_scores(logits.detach()[5:6], scoring), s.detach()[5:6])
    (s * torch.arange(16.0)).sum().backward()   # (a plain sum of softmax scores has no gradient)
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="scoring"):
        K.moe_scores(logits.detach(), "tanh")

"""DeepSeek-V4's new ops (kernels.sink_attention, compress_windows, indexer_topk, hc_pre / hc_post /
hc_head, apply_rotary_interleaved): each against HF's own formula in fp32 (parity), each along
its invariance axis (a query alone vs with others / with more keys and entries present, a window
alone vs with others, a token alone vs in a batch) with a control where a stock path can fail,
ties in the indexer to the lowest index, gradients vs float64, and the Triton-backend versions
under TRITON_INTERPRET=1."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import bitmatch.kernels as K
from bitmatch.testing import BitMismatch, assert_batch_invariant, assert_bitwise_equal

hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _attn_case(dtype, seed=0, L=24, C=6, H=4, D=32):
    g = _g(seed)
    q = torch.randn(L, H, D, generator=g).to(dtype)
    kv = torch.randn(L, D, generator=g).to(dtype)
    ent = torch.randn(C, D, generator=g).to(dtype)
    # entry c complete at position (c+1)*4 - 1; a random subset of the complete ones selected
    pos = torch.arange(L)
    visible = torch.arange(C).view(1, -1) < ((pos + 1) // 4).view(-1, 1)
    mask = visible & (torch.rand(L, C, generator=g) < 0.7)
    sinks = torch.randn(H, generator=g)
    return q, pos, kv, ent, mask, sinks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sink_attention_matches_hf_eager_fp32_formula(dtype):
    q, pos, kv, ent, mask, sinks = _attn_case(dtype, seed=1)
    got = K.sink_attention(q, pos, kv, ent, mask, sinks, scale=32 ** -0.5, window=6)
    # HF eager_attention_forward: one softmax over [scores, sink], the sink dropped after it
    keys = torch.cat([kv, ent]).float()
    j = torch.arange(kv.shape[0])
    local = (j.view(1, -1) <= pos.view(-1, 1)) & (j.view(1, -1) > pos.view(-1, 1) - 6)
    bias = torch.zeros(local.shape[0], keys.shape[0]).masked_fill(~torch.cat([local, mask], 1), float("-inf"))
    sc = q.float().transpose(0, 1) @ keys.t() * 32 ** -0.5 + bias
    logits = torch.cat([sc, sinks.view(-1, 1, 1).expand(-1, sc.shape[1], 1)], -1)
    ref = (torch.softmax(logits - logits.amax(-1, keepdim=True), -1)[..., :-1] @ keys).transpose(0, 1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (got.float() - ref).abs().max() < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sink_attention_query_alone_equals_full_prefill(dtype):
    """Decode (one query, keys up to t, only the entries complete at t) == the full prefill row,
    and any chunk of queries == the same rows of the full call: keys and entries past t are never
    in a query's sums."""
    q, pos, kv, ent, mask, sinks = _attn_case(dtype, seed=2)
    kw = dict(scale=32 ** -0.5, window=6)
    full = K.sink_attention(q, pos, kv, ent, mask, sinks, **kw)
    for t in range(q.shape[0]):
        c = (t + 1) // 4
        one = K.sink_attention(q[t:t + 1], pos[t:t + 1], kv[:t + 1], ent[:c], mask[t:t + 1, :c], sinks, **kw)
        assert_bitwise_equal(one, full[t:t + 1], f"decode at t={t}")
    for s, e in ((0, 5), (5, 13), (13, 24)):
        c = e // 4
        chunk = K.sink_attention(q[s:e], pos[s:e], kv[:e], ent[:c], mask[s:e, :c], sinks, **kw)
        assert_bitwise_equal(chunk, full[s:e], f"chunk {s}:{e}")


def test_control_hf_eager_attention_is_not_prefix_invariant():
    """The same check on HF's eager formula (fp32 matmuls over all keys of the call) fails."""
    q, pos, kv, ent, mask, sinks = _attn_case(torch.float32, seed=3, L=96, C=24, H=8, D=64)

    def eager(q, pos, kv, ent, mask):
        keys = torch.cat([kv, ent])
        j = torch.arange(kv.shape[0])
        local = (j.view(1, -1) <= pos.view(-1, 1)) & (j.view(1, -1) > pos.view(-1, 1) - 48)
        bias = torch.zeros(local.shape[0], keys.shape[0]).masked_fill(~torch.cat([local, mask], 1), float("-inf"))
        sc = torch.matmul(q.transpose(0, 1), keys.t()) * 0.125 + bias
        logits = torch.cat([sc, sinks.view(-1, 1, 1).expand(-1, sc.shape[1], 1)], -1)
        return torch.matmul(F.softmax(logits - logits.amax(-1, keepdim=True), -1)[..., :-1], keys).transpose(0, 1)
    full = eager(q, pos, kv, ent, mask)
    with pytest.raises(BitMismatch):
        for t in range(q.shape[0]):
            c = (t + 1) // 4
            assert_bitwise_equal(eager(q[t:t + 1], pos[t:t + 1], kv[:t + 1], ent[:c], mask[t:t + 1, :c]),
                                 full[t:t + 1], f"t={t}")


def test_sink_attention_grads_match_float64():
    q, pos, kv, ent, mask, sinks = _attn_case(torch.float32, seed=4)
    leaves = [t.clone().requires_grad_() for t in (q, kv, ent, sinks)]
    out = K.sink_attention(leaves[0], pos, leaves[1], leaves[2], mask, leaves[3], scale=0.2, window=5)
    w = torch.randn(out.shape, generator=_g(0))
    (out * w).sum().backward()
    from bitmatch.kernels.compressed_attention import _sink_plain
    l64 = [t.detach().double().requires_grad_() for t in (q, kv, ent, sinks)]
    (_sink_plain(l64[0], l64[1], l64[2], l64[3], pos, mask, 0.2, 5).double() * w.double()).sum().backward()
    for a, b in zip(leaves, l64):
        assert ((a.grad.double() - b.grad).norm() / b.grad.norm()) < 1e-5


# ---------------------------------------------------------------- compressor

def _hf_compressor(kind, D=16, m=4, seed=0):
    cfg_kw = dict(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=D,
                  q_lora_rank=16, compress_rates={"compressed_sparse_attention": m, "heavily_compressed_attention": m},
                  layer_types=["compressed_sparse_attention", "heavily_compressed_attention"], index_head_dim=8,
                  index_n_heads=2, partial_rotary_factor=0.5, max_position_embeddings=256)
    from transformers import DeepseekV4Config
    cfg = DeepseekV4Config(**cfg_kw)
    torch.manual_seed(seed)
    mod = (hf.DeepseekV4CSACompressor if kind == "csa" else hf.DeepseekV4HCACompressor)(cfg).float()
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
    return mod


@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_compress_windows_matches_hf_pooling_fp32(kind):
    """HF's pooled entries before norm/rope: softmax(gate + bias) over the window (CSA: window w-1's
    Ca slots then window w's Cb slots, none for w = 0), weighted sum of kv."""
    m, D, W = 4, 16, 5
    c = 2 * D if kind == "csa" else D
    g = _g(5)
    kv, gate = torch.randn(W, m, c, generator=g), torch.randn(W, m, c, generator=g)
    bias = torch.randn(m, c, generator=g)
    if kind == "hca":
        got = K.compress_windows(kv, gate, bias)
        ref = (kv * (gate + bias).softmax(1)).sum(1)
    else:
        has_prev = torch.arange(W) > 0
        prev = torch.cat([torch.zeros(1, m, D), kv[:-1, :, :D]])
        prev_g = torch.cat([torch.zeros(1, m, D), gate[:-1, :, :D]])
        got = K.compress_windows(kv, gate, bias, prev_kv=prev, prev_gate=prev_g, has_prev=has_prev)
        new_kv = torch.zeros(W, 2 * m, D)
        new_g = torch.full((W, 2 * m, D), float("-inf"))
        z = gate + bias
        new_kv[:, m:], new_g[:, m:] = kv[..., D:], z[..., D:]
        new_kv[1:, :m], new_g[1:, :m] = kv[:-1, :, :D], z[:-1, :, :D]
        ref = (new_kv * new_g.softmax(1)).sum(1)
    assert (got - ref).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compress_windows_entry_alone_equals_batched(dtype):
    """An entry computed alone (its window closing in a decode step) == the same entry among all
    windows of a prefill; the rows of other windows never enter it."""
    m, D, W = 4, 8, 7
    g = _g(6)
    kv, gate = (torch.randn(W, m, 2 * D, generator=g).to(dtype) for _ in range(2))
    bias = torch.randn(m, 2 * D, generator=g)
    prev, prev_g = torch.cat([torch.zeros(1, m, D, dtype=dtype), kv[:-1, :, :D]]), \
        torch.cat([torch.zeros(1, m, D, dtype=dtype), gate[:-1, :, :D]])
    has = torch.arange(W) > 0
    allw = K.compress_windows(kv, gate, bias, prev_kv=prev, prev_gate=prev_g, has_prev=has)
    for w in range(W):
        s = slice(w, w + 1)
        one = K.compress_windows(kv[s], gate[s], bias, prev_kv=prev[s], prev_gate=prev_g[s], has_prev=has[s])
        assert_bitwise_equal(one, allw[s], f"window {w}")
    assert allw.dtype == dtype


def test_compress_windows_grads_match_float64():
    g = _g(7)
    kv, gate = (torch.randn(3, 4, 8, generator=g, requires_grad=True) for _ in range(2))
    bias = torch.randn(4, 8, generator=g, requires_grad=True)
    w = torch.randn(3, 8, generator=g)
    (K.compress_windows(kv, gate, bias) * w).sum().backward()
    l64 = [t.detach().double().requires_grad_() for t in (kv, gate, bias)]
    ((l64[0] * (l64[1] + l64[2]).softmax(1)).sum(1) * w.double()).sum().backward()
    for a, b in zip((kv, gate, bias), l64):
        assert ((a.grad.double() - b.grad).norm() / b.grad.norm()) < 1e-5


# ---------------------------------------------------------------- indexer

def _idx_case(dtype, seed=0, T=20, C=5, H=4, Di=16):
    g = _g(seed)
    return (torch.randn(T, H, Di, generator=g).to(dtype), torch.arange(T), torch.randn(C, Di, generator=g).to(dtype),
            torch.randn(T, H, generator=g))


def test_indexer_matches_hf_scorer_and_topk_fp32():
    from transformers import DeepseekV4Config
    q, pos, keys, w = _idx_case(torch.float32, seed=8)
    cfg = DeepseekV4Config(vocab_size=32, hidden_size=16, num_hidden_layers=1, index_n_heads=4, index_head_dim=16)
    scorer = hf.DeepseekV4IndexerScorer(cfg)
    with torch.no_grad():
        # HF: weights = weights_proj(h) * H^-0.5; feed that through an identity projection
        scorer.weights_proj.weight.copy_(torch.eye(4, 16))
        h = torch.cat([w, torch.zeros(20, 12)], 1) * 2.0  # * 2 = (H=4)^0.5 undone by weights_scaling
        ref = scorer(q[None], keys[None], h[None])[0]
    got = K.indexer_topk(q, pos, keys, w, rate=4, top_k=2, softmax_scale=16 ** -0.5)
    from bitmatch.kernels.indexer import indexer_scores_reference
    ours = indexer_scores_reference(q, keys, w, 16 ** -0.5)
    assert (ours - ref).abs().max() < 1e-5
    future = torch.arange(5).view(1, -1) >= ((pos + 1) // 4).view(-1, 1)
    masked = ref.masked_fill(future, float("-inf"))
    want = torch.zeros_like(got).scatter(1, masked.topk(2, -1).indices, True) & ~future
    assert torch.equal(got, want)
    assert int(got.sum(1).max()) == 2 and not bool((got & future).any())


def test_indexer_ties_go_to_the_lowest_index_and_rows_are_invariant():
    q, pos, keys, w = _idx_case(torch.bfloat16, seed=9, T=24, C=6)
    keys[4] = keys[1]
    keys[5] = keys[1]  # entries 1, 4, 5 score the same for every query
    sel = K.indexer_topk(q, pos, keys, w, rate=4, top_k=2, softmax_scale=0.25)
    for t in range(24):
        rows = set(sel[t].nonzero()[:, 0].tolist())
        assert (4 not in rows or 1 in rows) and (5 not in rows or 4 in rows), (t, rows)
        # alone, with only the entries that exist at t: the same selection
        c = (t + 1) // 4
        one = K.indexer_topk(q[t:t + 1], pos[t:t + 1], keys[:max(c, 1)], w[t:t + 1], rate=4, top_k=2,
                             softmax_scale=0.25)
        assert torch.equal(one[0, :c], sel[t, :c]) and not bool(sel[t, c:].any())
    assert any(len(set(r.nonzero()[:, 0].tolist()) & {1, 4, 5}) for r in sel)


# ---------------------------------------------------------------- mHC

def _hc_module(n=3, d=16, seed=0):
    from transformers import DeepseekV4Config
    cfg = DeepseekV4Config(vocab_size=32, hidden_size=d, num_hidden_layers=1, hc_mult=n, hc_sinkhorn_iters=7)
    torch.manual_seed(seed)
    mod = hf.DeepseekV4HyperConnection(cfg)
    head = hf.DeepseekV4HyperHead(cfg)
    with torch.no_grad():
        for p in list(mod.parameters()) + list(head.parameters()):
            p.copy_(torch.randn(p.shape) * 0.5)
    return mod, head, cfg


def _pre(mod, x):
    return K.hc_pre(x, mod.fn, mod.base, mod.scale, iters=mod.hc_sinkhorn_iters, eps=mod.hc_eps,
                    norm_eps=mod.input_norm.eps)


def test_mhc_matches_hf_fp32_and_is_doubly_stochastic():
    mod, head, _ = _hc_module()
    x = torch.randn(2, 5, 3, 16, generator=_g(10))
    with torch.no_grad():
        post_r, comb_r, col_r = mod(x)
        head_r = head(x)
        post, comb, col = _pre(mod, x.view(10, 3, 16))
        y = torch.randn(10, 16, generator=_g(11))
        mixed_r = post_r.view(10, 3, 1) * y.view(10, 1, 16) + torch.matmul(comb_r.view(10, 3, 3).transpose(-1, -2),
                                                                           x.view(10, 3, 16))
        mixed = K.hc_post(x.view(10, 3, 16), y, post, comb)
        hd = K.hc_head(x.view(10, 3, 16), head.hc_fn, head.hc_base, head.hc_scale, eps=head.eps,
                       norm_eps=head.input_norm.eps)
    for a, b in ((post, post_r), (comb, comb_r), (col, col_r), (mixed, mixed_r), (hd, head_r)):
        assert (a - b.reshape(a.shape)).abs().max() < 1e-5
    assert (comb.sum(-2) - 1).abs().max() < 1e-3 and (comb.sum(-1) - 1).abs().max() < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mhc_token_alone_equals_batched(dtype):
    mod, head, _ = _hc_module(seed=1)
    x = torch.randn(9, 3, 16, generator=_g(12)).to(dtype)
    y = torch.randn(9, 16, generator=_g(13)).to(dtype)
    with torch.no_grad():
        assert_batch_invariant(lambda a: _pre(mod, a), x, max_batch=64, cases=6, seed=1)
        assert_batch_invariant(lambda a: K.hc_head(a, head.hc_fn, head.hc_base, head.hc_scale, eps=head.eps,
                                                   norm_eps=head.input_norm.eps), x, max_batch=64, cases=6, seed=2)
        post, comb, _ = _pre(mod, x)
        assert_batch_invariant(lambda a, b, c, d: K.hc_post(a, b, c, d), (x, y, post, comb), max_batch=64, cases=6,
                               seed=3)


def test_control_hf_hyper_connection_is_batch_variant():
    """The same harness on HF's own DeepseekV4HyperConnection (F.linear over the batch's rows,
    torch's reductions) finds a row whose bits change with the batch."""
    from transformers import DeepseekV4Config
    cfg = DeepseekV4Config(vocab_size=32, hidden_size=256, num_hidden_layers=1, hc_mult=4, hc_sinkhorn_iters=7)
    torch.manual_seed(2)
    mod = hf.DeepseekV4HyperConnection(cfg)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape) * 0.1)
        x = torch.randn(16, 4, 256, generator=_g(14))
        with pytest.raises(BitMismatch):
            assert_batch_invariant(lambda a: mod(a[None])[2][0], x, max_batch=256, cases=20, seed=4)


def test_mhc_grads_match_float64():
    mod, head, _ = _hc_module(seed=3)
    x = torch.randn(6, 3, 16, generator=_g(15), requires_grad=True)
    post, comb, col = _pre(mod, x)
    w = [torch.randn(t.shape, generator=_g(16 + i)) for i, t in enumerate((post, comb, col))]
    sum((a * b).sum() for a, b in zip((post, comb, col), w)).backward()
    m64 = _hc_module(seed=3)[0].double()
    x64 = x.detach().double().requires_grad_()
    p64, c64, col64 = m64(x64[None])
    sum((a[0] * b.double()).sum() for a, b in zip((p64, c64, col64), w)).backward()
    assert ((x.grad.double() - x64.grad).norm() / x64.grad.norm()) < 1e-5
    assert ((mod.fn.grad.double() - m64.fn.grad).norm() / m64.fn.grad.norm()) < 1e-5


# ---------------------------------------------------------------- rotary, errors, Triton

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interleaved_rotary_is_hf_bit_for_bit_and_inverse_undoes_it(dtype):
    x = torch.randn(7, 3, 32, generator=_g(17)).to(dtype)
    cos, sin = K.rotary_cos_sin(torch.arange(7), 16, 10000.0)
    got = K.apply_rotary_interleaved(x, cos, sin)
    ref = hf.apply_rotary_pos_emb(x.transpose(0, 1)[None], cos.to(dtype)[None], sin.to(dtype)[None])[0].transpose(0, 1)
    assert_bitwise_equal(got, ref, "vs HF apply_rotary_pos_emb")
    assert torch.equal(got[..., :16], x[..., :16])  # the nope channels pass through
    back = K.apply_rotary_interleaved(got.float(), cos, sin, inverse=True)
    assert (back - x.float()).abs().max() < (1e-5 if dtype == torch.float32 else 5e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inverse", [False, True])
def test_interleaved_rotary_gradient_is_autograds_of_the_plain_ops(dtype, inverse):
    # the op's one-node backward (the opposite rotation of the gradient) has the bits autograd
    # gets walking back through the plain ops, 2-D inputs included
    from bitmatch.kernels import rotary_interleaved as RI
    cos, sin = K.rotary_cos_sin(torch.arange(6) * 5, 16, 10000.0)
    for shape in ((6, 3, 24), (6, 24)):
        x = torch.randn(*shape, generator=_g(41)).to(dtype)
        g = torch.randn(*shape, generator=_g(42)).to(dtype)
        a = x.clone().requires_grad_()
        K.apply_rotary_interleaved(a, cos, sin, inverse=inverse).backward(g)
        b = x.clone().requires_grad_()
        out = RI._rotate(b if b.dim() == 3 else b.unsqueeze(1), cos, sin, inverse)
        out.reshape(shape).backward(g)
        assert_bitwise_equal(a.grad, b.grad, f"rotary backward {shape}")


def test_bad_inputs_are_named():
    q, pos, kv, ent, mask, sinks = _attn_case(torch.float32)
    with pytest.raises(ValueError, match="sinks"):
        K.sink_attention(q, pos, kv, ent, mask, sinks[:2], scale=1.0, window=4)
    with pytest.raises(ValueError, match="no key row"):
        K.sink_attention(q, pos, kv[:3], ent, mask, sinks, scale=1.0, window=4)
    with pytest.raises(ValueError, match="position_bias"):
        K.compress_windows(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), torch.zeros(3, 8))
    with pytest.raises(ValueError, match="has_prev"):
        K.compress_windows(torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), torch.zeros(4, 8),
                           prev_kv=torch.zeros(2, 4, 4), prev_gate=torch.zeros(2, 4, 4), has_prev=torch.zeros(2))
    with pytest.raises(ValueError, match="iters"):
        mod, _, _ = _hc_module()
        K.hc_pre(torch.zeros(2, 3, 16), mod.fn, mod.base, mod.scale, iters=0, eps=1e-6, norm_eps=1e-6)


interpret = pytest.mark.interpreter


@interpret
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_sink_attention_prefix_invariant_and_close(dtype):
    q, pos, kv, ent, mask, sinks = _attn_case(dtype, seed=20, L=12, C=3)
    kw = dict(scale=32 ** -0.5, window=5)
    ref = K.sink_attention(q, pos, kv, ent, mask, sinks, **kw)
    with K.use_backend("triton"):
        full = K.sink_attention(q, pos, kv, ent, mask, sinks, **kw)
        for t in (0, 3, 7, 11):
            c = (t + 1) // 4
            one = K.sink_attention(q[t:t + 1], pos[t:t + 1], kv[:t + 1], ent[:c], mask[t:t + 1, :c], sinks, **kw)
            assert_bitwise_equal(one, full[t:t + 1], f"triton decode at t={t}")
        chunk = K.sink_attention(q[4:9], pos[4:9], kv[:9], ent[:2], mask[4:9, :2], sinks, **kw)
        assert_bitwise_equal(chunk, full[4:9], "triton chunk 4:9")
    assert (full.float() - ref.float()).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)


@interpret
def test_triton_compressor_indexer_mhc_invariant_and_close():
    g = _g(21)
    kv, gate = (torch.randn(5, 4, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    bias = torch.randn(4, 16, generator=g)
    prev, prev_g = torch.zeros(5, 4, 8, dtype=torch.bfloat16), torch.zeros(5, 4, 8, dtype=torch.bfloat16)
    prev[1:], prev_g[1:] = kv[:-1, :, :8], gate[:-1, :, :8]
    has = torch.arange(5) > 0
    ref = K.compress_windows(kv, gate, bias, prev_kv=prev, prev_gate=prev_g, has_prev=has)
    q, pos, keys, w = _idx_case(torch.float32, seed=22, T=12, C=3)
    sel_ref = K.indexer_topk(q, pos, keys, w, rate=4, top_k=2, softmax_scale=0.25)
    mod, head, _ = _hc_module(seed=5)
    x = torch.randn(6, 3, 16, generator=g)
    with torch.no_grad():
        pre_ref = _pre(mod, x)
    with K.use_backend("triton"):
        allw = K.compress_windows(kv, gate, bias, prev_kv=prev, prev_gate=prev_g, has_prev=has)
        for i in (0, 3):
            s = slice(i, i + 1)
            one = K.compress_windows(kv[s], gate[s], bias, prev_kv=prev[s], prev_gate=prev_g[s], has_prev=has[s])
            assert_bitwise_equal(one, allw[s], f"triton window {i}")
        sel = K.indexer_topk(q, pos, keys, w, rate=4, top_k=2, softmax_scale=0.25)
        from bitmatch.kernels.triton.indexer import indexer_scores
        full = indexer_scores(q, keys, w, 0.25)
        assert_bitwise_equal(indexer_scores(q[5:6], keys[:1], w[5:6], 0.25), full[5:6, :1], "triton indexer row")
        with torch.no_grad():
            pre = _pre(mod, x)
            assert_batch_invariant(lambda a: _pre(mod, a), x, max_batch=16, cases=2, seed=5)
    assert (allw.float() - ref.float()).abs().max() < 2e-2
    assert torch.equal(sel, sel_ref)
    for a, b in zip(pre, pre_ref):
        assert (a - b).abs().max() < 1e-5


@interpret
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_interleaved_rotary_is_the_reference_bit_for_bit(dtype):
    # one launch per call on the Triton backend, the reference's bits: forward, inverse and the
    # backward, heads in several blocks, no nope channels, 2-D input
    pos = torch.arange(9) * 37
    for shape, rope in (((9, 5, 40), 16), ((9, 3, 16), 16), ((9, 24), 8)):
        cos, sin = K.rotary_cos_sin(pos, rope, 10000.0)
        x = (torch.randn(*shape, generator=_g(61)) * 3).to(dtype)
        g = torch.randn(*shape, generator=_g(62)).to(dtype)
        for inverse in (False, True):
            want = K.apply_rotary_interleaved(x, cos, sin, inverse=inverse)
            a = x.clone().requires_grad_()
            K.apply_rotary_interleaved(a, cos, sin, inverse=inverse).backward(g)
            with K.use_backend("triton"):
                got = K.apply_rotary_interleaved(x, cos, sin, inverse=inverse)
                b = x.clone().requires_grad_()
                K.apply_rotary_interleaved(b, cos, sin, inverse=inverse).backward(g)
            assert_bitwise_equal(got, want, f"triton rotary {shape} inverse={inverse}")
            assert_bitwise_equal(b.grad, a.grad, f"triton rotary backward {shape} inverse={inverse}")
    # control: the stock formula (complex products, one rounding) is another function in bf16
    cos, sin = K.rotary_cos_sin(pos, 16, 10000.0)
    x = (torch.randn(9, 5, 40, generator=_g(63)) * 3).to(torch.bfloat16)
    with K.use_backend("triton"):
        got = K.apply_rotary_interleaved(x, cos, sin)
    with pytest.raises(BitMismatch):
        assert_bitwise_equal(K.OPS["apply_rotary_interleaved"].stock(x, cos, sin), got, "stock rotary")


@interpret
def test_triton_model_rows_alone_equal_packed():
    """The whole DeepSeek-V4 forward on the Triton backend: a sequence alone == the same sequence
    packed with another, and a prefix == the first rows of the longer sequence (bf16); close to
    the reference backend in fp32 (in bf16 a near-tie in the indexer may pick another entry)."""
    import bitmatch
    from bitmatch.context import ForwardContext
    from bitmatch.models import forward_hidden
    from bitmatch.models.deepseek_v4_tiny import tiny_model

    a, b = torch.randint(3, 128, (12,), generator=_g(23)), torch.randint(3, 128, (8,), generator=_g(24))

    def run(m, *seqs):
        ids = torch.cat(seqs)
        cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
        pos = torch.cat([torch.arange(len(s)) for s in seqs])
        with torch.no_grad():
            return forward_hidden(m, ids, ForwardContext(positions=pos, cu_seqlens=cu))
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = bitmatch.patch(tiny_model(torch.bfloat16, seed=4))
        m32 = bitmatch.patch(tiny_model(torch.float32, seed=4))
        ref = run(m32, a)
        with K.use_backend("triton"):
            packed = run(m, b, a)
            alone = run(m, a[:8])
            got32 = run(m32, a)
    finally:
        torch.set_num_threads(n)
    assert_bitwise_equal(packed[8:16], alone, "prefix of a, packed after b")
    err = (got32 - ref).abs().max() / ref.abs().max()
    assert err < 1e-4  # fp32 on another backend: close, not equal


@interpret
def test_triton_select_rows_is_the_stable_sort():
    """The indexer's one-launch selection (kernels/triton/indexer.py select_rows) picks what the
    stable descending sort picks (kernels.indexer.select_rows): ties to the lowest index, -0.0 equal
    to +0.0, NaN first, fewer visible entries than top_k (no search) and more (the bitwise search
    over 256-score blocks). Control: ties to the highest index select other entries."""
    from bitmatch.kernels.indexer import select_rows as by_sort
    from bitmatch.kernels.triton.indexer import select_rows
    g = _g(60)
    for T, C, rate, top_k in ((5, 40, 4, 8), (7, 300, 4, 16), (3, 20, 1, 64), (4, 700, 2, 100)):
        for kind in ("randn", "ties", "special"):
            s = torch.randn(T, C, generator=g)
            if kind == "ties":
                s = torch.randint(0, 4, (T, C), generator=g).float()
            if kind == "special":
                s[:, ::7], s[:, 3::11], s[:, 5::11] = float("-inf"), 0.0, -0.0
                s[:, 2::13], s[:, 1::17] = float("nan"), float("inf")
            qpos = torch.randint(0, C * rate, (T,), generator=g)
            # entries not complete at a row's position score -inf (the score kernels' rule)
            s = torch.where(torch.arange(C)[None, :] < ((qpos + 1) // rate)[:, None], s, float("-inf"))
            got = select_rows(s, qpos, rate, top_k)
            assert torch.equal(got, by_sort(s, qpos, rate, top_k)), (T, C, kind)
            if kind == "ties" and C >= 300:  # control: the highest index winning ties differs
                r = int(((qpos + 1) // rate).argmax())
                n_vis, k = int((qpos[r] + 1) // rate), min(top_k, C)
                high = sorted(sorted(range(n_vis), key=lambda c: (-float(s[r, c]), -c))[:k])
                assert n_vis > k and high != [c for c in got[r].tolist() if c >= 0]

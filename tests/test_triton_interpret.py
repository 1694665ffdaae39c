"""Triton backend (bitmatch.kernels.triton) under Triton's CPU interpreter.

The interpreter computes each block dot in float64 (constexpr INTERP switch: its bf16 tl.dot
is broken), so these tests check each kernel's structure, not the GPU's bits: values against
plain torch math within tolerance, and the invariance structure: a row alone vs inside a batch,
split-K fused vs split, prefill vs chunked prefill vs paged decode at page sizes 8/16/32 with
shuffled block tables, query tile sizes and fused vs split KV partitions, all bit-identical.
The same checks on CUDA bits run in benchmarks/ops/gpu_ops.py.
"""
import importlib
import math
import types

import pytest
import torch

from bitmatch.kernels import order

pytest.importorskip("triton")
pytestmark = pytest.mark.interpreter

K = types.SimpleNamespace(**{m: importlib.import_module(f"bitmatch.kernels.triton.{m}") for m in
                             ("linear", "norm", "rotary", "activation", "attention", "logprobs")})
BF = torch.bfloat16


def _close(y, ref, rel=0.03, abs_=0.02):
    """Within tolerance. The interpreter's fp32 -> bf16 cast truncates (round toward zero)
    where the GPU rounds to nearest even, so bf16 results carry up to ~1 ulp (2^-7 relative)
    of bias per rounding point here: tolerances are relative."""
    y, ref = y.double(), ref.double()
    return bool(((y - ref).abs() <= rel * ref.abs() + abs_).all())


def _g(seed):
    g = torch.Generator().manual_seed(seed)
    return g


def _randn(*shape, dtype=BF, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=_g(seed)) * scale).to(dtype)


# ---------------------------------------------------------------- linear
@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_linear_matches_reference(dtype):
    x, w, b = _randn(21, 160, dtype=dtype, seed=1), _randn(40, 160, dtype=dtype, seed=2), \
        _randn(40, dtype=dtype, seed=3)
    y = K.linear.linear(x, w, b)
    ref = x.double() @ w.double().T + b.double()
    assert y.dtype == dtype and y.shape == (21, 40)
    tol = 0.02 * ref.abs().max().item() if dtype == BF else 1e-4
    assert (y.double() - ref).abs().max().item() < tol
    y0 = K.linear.linear(x, w, None)
    assert (y0.double() - (x.double() @ w.double().T)).abs().max().item() < tol


def test_linear_batch_invariance_and_split_k_structure():
    lin = K.linear
    Kd, N = 512, 48
    x, w, b = _randn(40, Kd, seed=4), _randn(N, Kd, seed=5), _randn(N, seed=6)
    with order.override(linear_split_table=(((N, Kd), 2),)):
        assert lin.split_for(N, Kd) == 2
        full = lin.linear(x, w, b)                     # table config for M = 40
        for m in (1, 3, 17):                          # other table rows (other tiles / modes)
            part = lin.linear(x[:m].contiguous(), w, b)
            assert torch.equal(part, full[:m])
        row = lin.linear(x[29:30].contiguous(), w, b)   # a row alone vs at row 29 of the batch
        assert torch.equal(row, full[29:30])
        cfgs = [(16, 16, 64, 8, 4, 3, "split"), (32, 32, 128, 8, 4, 3, "fused"),
                (64, 16, 256, 4, 4, 3, "split"), (16, 64, 64, 1, 4, 3, "fused")]
        outs = [lin._launch(x, w, b, c, 2) for c in cfgs]
        for o in outs[1:]:
            assert torch.equal(o, outs[0])
        assert torch.equal(outs[0], full)
        # the split-K tree is part of the canonical order: a different SPLIT is another order
        assert lin._launch(x, w, b, cfgs[0], 1).shape == full.shape
    assert lin.split_for(N, Kd) == 1  # the override is gone with its block


def test_linear_half_decode_rows_same_bits():
    """The bf16 decode rows (HALF_TABLES: 16x16 tiles, K blocks of 256 at 33..64 rows) give a row
    the bits it has alone (another table row); fp32 operands never take them, but a router's few
    fp32 columns (N <= 1024) take their own 16x16 rows, split in four for V4 mid's (64, 2048)."""
    lin = K.linear
    N, Kd = 512, 2048
    assert lin.config_for(40, N, Kd, torch.bfloat16)[:3] == (16, 16, 256)
    assert lin.config_for(40, N, Kd, torch.float32)[:3] == (16, 16, 128)
    assert lin.config_for(40, 4096, Kd, torch.float32) == lin.config_for(40, 4096, Kd)
    assert lin.split_for(64, 2048) == 4 and lin.split_for(256, 4096) == 8
    for n, dt in ((N, torch.bfloat16), (64, torch.float32)):
        x, w = _randn(40, Kd, seed=7).to(dt), _randn(n, Kd, seed=8).to(dt)
        full = lin.linear(x, w)
        for r in (0, 23, 39):
            assert torch.equal(lin.linear(x[r:r + 1].contiguous(), w), full[r:r + 1])


def test_linear_ragged_k():
    x, w = _randn(5, 200, seed=7), _randn(24, 200, seed=8)
    y = K.linear.linear(x, w)
    ref = x.double() @ w.double().T
    assert (y.double() - ref).abs().max().item() < 0.02 * ref.abs().max().item()
    assert torch.equal(K.linear.linear(x[2:3].contiguous(), w), y[2:3])


@pytest.mark.parametrize("M,N,Kd,split", [(70, 48, 512, 2), (33, 40, 168, 1), (130, 64, 768, 3)])
def test_linear_tma_persistent_same_order(M, N, Kd, split):
    """The persistent TMA kernel (large-M path) keeps the canonical order: equal bits to the
    table kernel (same BK: the interpreter rounds each BK block's float64 dot to fp32), with
    ragged edges in M, N and K and a persistent grid smaller than the tile count."""
    lin = K.linear
    x, w, b = _randn(M, Kd, seed=1), _randn(N, Kd, seed=2), _randn(N, seed=3)
    try:
        with order.override(linear_split_table=(((N, Kd), split),)):
            S = lin.split_for(N, Kd)
            assert S == split
            ref = lin._launch(x, w, b, (16, 16, 64, 8, 4, 4, "fused"), S)
            assert torch.equal(lin._launch_tma(x, w, b, (32, 16, 64, 8, 4, 3), S), ref)
            # the flattened tile + K loop (one chunk only; a split weight keeps the loop nest)
            assert torch.equal(lin._launch_tma(x, w, b, (32, 16, 64, 8, 4, 3, "flat"), S), ref)
            lin.TMA_TABLE[(N, Kd)] = [(64, 32, 16, 64, 2, 4, 3)]
            assert torch.equal(lin.linear(x, w, b), ref)                       # M >= 64: TMA path
            assert torch.equal(lin.linear(x[:9].contiguous(), w, b), ref[:9])  # M < 64: table
            # a table row in "tma" mode (a swept M bucket's winner) runs the TMA kernel there only
            lin.TMA_TABLE.pop((N, Kd))
            lin.CONFIG_TABLES[(N, Kd)] = [(16, 16, 16, 64, 8, 4, 4, "fused"),
                                          (1 << 62, 32, 16, 64, 2, 4, 3, "tma")]
            assert torch.equal(lin.linear(x, w, b), ref)
            assert torch.equal(lin.linear(x[:9].contiguous(), w, b), ref[:9])
    finally:
        lin.TMA_TABLE.pop((N, Kd), None)
        lin.CONFIG_TABLES.pop((N, Kd), None)


# ---------------------------------------------------------------- norms
def _hf_rms(x, w, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [BF, torch.float32])
def test_rms_norm(dtype):
    x, w = _randn(9, 96, dtype=dtype, seed=9), _randn(96, dtype=dtype, seed=10)
    y = K.norm.rms_norm(x, w, 1e-6)
    ref = _hf_rms(x, w, 1e-6)
    assert y.dtype == dtype
    assert _close(y, ref) if dtype == BF else (y - ref).abs().max().item() < 1e-4
    assert torch.equal(K.norm.rms_norm(x[4:5].contiguous(), w, 1e-6), y[4:5])


def test_fused_add_rms_norm():
    x, r, w = _randn(7, 80, seed=11), _randn(7, 80, seed=12), _randn(80, seed=13)
    out, res = K.norm.fused_add_rms_norm(x, r, w, 1e-5)
    assert _close(res, x.double() + r.double(), rel=0.01, abs_=0.0)
    assert _close(out, _hf_rms(x + r, w, 1e-5))
    o1, r1 = K.norm.fused_add_rms_norm(x[3:4].contiguous(), r[3:4].contiguous(), w, 1e-5)
    assert torch.equal(o1, out[3:4]) and torch.equal(r1, res[3:4])


# ---------------------------------------------------------------- rotary / activation
def _hf_rotary(x, cos, sin):
    c = torch.cat([cos, cos], -1).to(x.dtype)[:, None, :]
    s = torch.cat([sin, sin], -1).to(x.dtype)[:, None, :]
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * c + torch.cat([-x2, x1], -1) * s


def test_apply_rotary():
    T, D = 6, 32
    q, k = _randn(T, 4, D, seed=14), _randn(T, 2, D, seed=15)
    pos = torch.arange(T, dtype=torch.float32) + 3
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    f = pos[:, None] * inv[None, :]
    cos, sin = f.cos(), f.sin()
    qo, ko = K.rotary.apply_rotary(q, k, cos, sin)
    assert _close(qo, _hf_rotary(q, cos, sin), abs_=0.05)
    assert _close(ko, _hf_rotary(k, cos, sin), abs_=0.05)
    q1, k1 = K.rotary.apply_rotary(q[2:3].contiguous(), k[2:3].contiguous(), cos[2:3].contiguous(),
                                   sin[2:3].contiguous())
    assert torch.equal(q1, qo[2:3]) and torch.equal(k1, ko[2:3])


def test_silu_and_mul():
    x = _randn(5, 2 * 1100, seed=16)          # I = 1100 > one 1024 block
    y = K.activation.silu_and_mul(x)
    g, u = x[:, :1100], x[:, 1100:]
    ref = torch.nn.functional.silu(g) * u
    assert _close(y, ref)
    assert torch.equal(K.activation.silu_and_mul(x[1:2].contiguous()), y[1:2])


# ---------------------------------------------------------------- logprobs
def test_logprobs():
    N, V = 5, 5000                              # two 4096-wide blocks, ragged tail
    x = _randn(N, V, seed=17, scale=3.0)
    tok = torch.tensor([0, 4999, 17, 4096, 123])
    temp = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5])
    ref = torch.log_softmax(x.float() / temp[:, None], -1)
    lp = K.logprobs.token_logprobs(x, tok, temp)
    assert lp.dtype == torch.float32
    assert (lp - ref[torch.arange(N), tok]).abs().max().item() < 1e-4
    full = K.logprobs.full_logprobs(x, temp)
    assert (full - ref).abs().max().item() < 1e-4
    assert torch.equal(full[torch.arange(N), tok], lp)
    one = K.logprobs.token_logprobs(x[3:4].contiguous(), tok[3:4].contiguous(), temp[3:4].clone())
    assert torch.equal(one, lp[3:4])


# ---------------------------------------------------------------- attention
def _ref_attn(q, k, v, scale, causal=True, window=None):
    T, Hq, D = q.shape
    G = Hq // k.shape[1]
    kk = k.double().repeat_interleave(G, 1)
    vv = v.double().repeat_interleave(G, 1)
    s = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    vis = torch.ones(T, T, dtype=torch.bool)
    if causal:
        vis &= j <= i
    if window:
        vis &= j > i - window
    s = s.masked_fill(~vis, float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(s, -1), vv)


@pytest.fixture
def small_partition():
    # canonical 512 on the GPU; 128 here exercises the merge cheaply
    with order.override(kv_partition=128):
        yield


def _seqs(lens, Hq=4, Hkv=2, D=32, seed=20):
    T = sum(lens)
    q, k, v = (_randn(T, Hq, D, seed=seed), _randn(T, Hkv, D, seed=seed + 1),
               _randn(T, Hkv, D, seed=seed + 2))
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    return q, k, v, cu


@pytest.mark.slow  # 15-60 s in the interpreter
@pytest.mark.parametrize("window", [None, 70])
def test_attention_prefill_values_and_batch(small_partition, window):
    att = K.attention
    lens = [300, 37]
    q, k, v, cu = _seqs(lens)
    scale = 1 / math.sqrt(32)
    out = att.attention_prefill(q, k, v, cu, scale, True, window)
    for b, L in enumerate(lens):
        s, e = int(cu[b]), int(cu[b + 1])
        ref = _ref_attn(q[s:e], k[s:e], v[s:e], scale, True, window)
        assert (out[s:e].double() - ref).abs().max().item() < 0.03
        one = att.attention_prefill(q[s:e].contiguous(), k[s:e].contiguous(),
                                    v[s:e].contiguous(), torch.tensor([0, L], dtype=torch.int32),
                                    scale, True, window)
        assert torch.equal(one, out[s:e]), "sequence alone vs in a batch"
    # query tile size and fused vs split partitions do not change the bits
    for bm, mode in ((16, "split"), (64, "fused"), (32, "split")):
        o2 = att.attention_prefill(q, k, v, cu, scale, True, window, force_mode=mode, block_m=bm)
        assert torch.equal(o2, out), (bm, mode)


def test_attention_prefill_noncausal_fp32():
    q, k, v, cu = _seqs([40])
    q, k, v = q.float(), k.float(), v.float()
    out = K.attention.attention_prefill(q, k, v, cu, 0.2, False, None)
    ref = _ref_attn(q, k, v, 0.2, False)
    assert (out.double() - ref).abs().max().item() < 1e-4


def _paged_cache(k, v, page, nblocks, seed):
    """Scatter one sequence's K/V into a cache with a shuffled block table; garbage elsewhere."""
    T, Hkv, D = k.shape
    need = (T + page - 1) // page
    perm = torch.randperm(nblocks, generator=_g(seed))[:need]
    kc = torch.full((nblocks, page, Hkv, D), float("nan"), dtype=k.dtype)
    vc = torch.full((nblocks, page, Hkv, D), float("nan"), dtype=k.dtype)
    pos = torch.arange(T)
    slots_b, slots_o = perm[pos // page], pos % page
    kc[slots_b, slots_o] = k
    vc[slots_b, slots_o] = v
    return kc, vc, perm.to(torch.int32)


@pytest.mark.slow  # 15-60 s in the interpreter
@pytest.mark.parametrize("window", [None, 100])
def test_attention_prefill_chunked_decode_bits(small_partition, window):
    """Prefill vs chunked prefill (any split) vs one-token decode, page sizes 8/16/32."""
    att = K.attention
    L = 290
    q, k, v, cu = _seqs([L], seed=30)
    scale = 0.17
    ref = att.attention_prefill(q, k, v, cu, scale, True, window)
    for page in (8, 16, 32):
        kc, vc, bt_row = _paged_cache(k, v, page, 60, seed=page)
        # two sequences in one paged batch: decode token t of seq A + chunk of seq A again
        decode_ts = [0, 63, 64, 127, 128, 255, 289]
        B = len(decode_ts)
        bt = bt_row[None, :].repeat(B, 1).contiguous()
        qd = torch.stack([q[t] for t in decode_ts]).contiguous()
        seq_lens = torch.tensor([t + 1 for t in decode_ts], dtype=torch.int32)
        od = att.attention_decode(qd, kc, vc, bt, seq_lens, scale, window)
        for i, t in enumerate(decode_ts):
            assert torch.equal(od[i], ref[t]), (page, t)
        # chunked prefill: chunks [0,a), [a,b), [b,L) each against the cache
        for a, b in ((100, 200), (1, 289), (64, 130)):
            for s, e in ((0, a), (a, b), (b, L)):
                oc = att.attention_paged(q[s:e].contiguous(), kc, vc, bt[:1].contiguous(),
                                         torch.tensor([0, e - s], dtype=torch.int32),
                                         torch.tensor([e], dtype=torch.int32), scale, window)
                assert torch.equal(oc, ref[s:e]), (page, s, e)
    # fused vs split partitions in the paged kernel
    kc, vc, bt_row = _paged_cache(k, v, 16, 40, seed=3)
    args = (q[150:].contiguous(), kc, vc, bt_row[None].contiguous(),
            torch.tensor([0, L - 150], dtype=torch.int32), torch.tensor([L], dtype=torch.int32),
            scale, window)
    assert torch.equal(att.attention_paged(*args, force_mode="split"), ref[150:])
    assert torch.equal(att.attention_paged(*args, force_mode="fused", block_m=64), ref[150:])


def test_attention_rowsum_mma_variant(small_partition):
    """The other row-sum order (rowsum_mma flipped from the default): same structure holds."""
    att = K.attention
    with order.override(rowsum_mma=not order.current().rowsum_mma):
        L = 150
        q, k, v, cu = _seqs([L], seed=40)
        ref = att.attention_prefill(q, k, v, cu, 0.2, True, None)
        assert (ref.double() - _ref_attn(q, k, v, 0.2)).abs().max().item() < 0.03
        kc, vc, bt_row = _paged_cache(k, v, 16, 20, seed=5)
        ts = [0, 64, 129, 149]
        od = att.attention_decode(torch.stack([q[t] for t in ts]).contiguous(), kc, vc,
                                  bt_row[None].repeat(len(ts), 1).contiguous(),
                                  torch.tensor([t + 1 for t in ts], dtype=torch.int32), 0.2)
        for i, t in enumerate(ts):
            assert torch.equal(od[i], ref[t])


# ---------------------------------------------------------------- attention backward
def _ref_attn_grads(q, k, v, cu, scale, causal, window, do):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    outs = [_ref_attn(*(t[int(cu[b]):int(cu[b + 1])] for t in leaves), scale, causal, window)
            for b in range(len(cu) - 1)]
    torch.cat(outs).backward(do.double())
    return [t.grad for t in leaves]


def _rel_err(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("causal,window,lens,hq,hkv", [
    (True, None, [37, 70], 4, 2),      # varlen, GQA
    (True, 20, [50, 9], 6, 2),         # sliding window, G = 3 (padded head rows)
    (False, None, [33, 21], 4, 4),     # non-causal MHA
])
def test_attention_backward_fp32_vs_float64(causal, window, lens, hq, hkv):
    """Flash backward (fp32 dots in the interpreter) against float64 autograd of the math."""
    from bitmatch.kernels import attention_prefill
    from bitmatch.kernels._backend import use_backend
    q, k, v, cu = _seqs(lens, Hq=hq, Hkv=hkv, D=16, seed=5)
    q, k, v = q.float(), k.float(), v.float()
    do = _randn(q.shape[0], hq, 16, seed=9).float()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with use_backend("triton"):   # the public op, wired to the Triton forward + backward
        out = attention_prefill(*leaves, cu, 0.3, causal, window)
    out.backward(do)
    for got, ref in zip((t.grad for t in leaves), _ref_attn_grads(q, k, v, cu, 0.3, causal,
                                                                  window, do)):
        assert _rel_err(got, ref) < 1e-5


def test_attention_backward_bf16_and_forward_bits():
    """bf16 gradients within bf16 tolerance; the autograd forward keeps the forward's bits."""
    att = K.attention
    q, k, v, cu = _seqs([45, 30], Hq=4, Hkv=1, D=16, seed=6)
    do = _randn(q.shape[0], 4, 16, seed=10)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = att.attention_prefill_autograd(*leaves, cu, 0.3, True, 25)
    assert torch.equal(out.detach(), att.attention_prefill(q, k, v, cu, 0.3, True, 25))
    out.backward(do)
    for got, ref in zip((t.grad for t in leaves), _ref_attn_grads(q, k, v, cu, 0.3, True, 25, do)):
        assert _rel_err(got, ref) < 0.02


def test_attention_backward_backend_choice(monkeypatch):
    """BWD_BACKEND: 'auto' off CUDA runs the Triton backward (same bits, no warning); 'cudnn'
    where cuDNN cannot run raises naming why and the knob; an unknown name raises. (The cuDNN
    backward itself runs on the GPU: benchmarks/ops/gpu_ops.py --only attention_bwd_cudnn.)"""
    import warnings
    bwd = importlib.import_module("bitmatch.kernels.triton.attention_bwd")
    q, k, v, cu = _seqs([21, 12], Hq=4, Hkv=2, D=16, seed=3)
    do = _randn(q.shape[0], 4, 16, seed=4)
    out, lse = K.attention.attention_prefill(q, k, v, cu, 0.3, True, None, return_lse=True)
    ref = bwd.attention_prefill_backward(do, q, k, v, out, lse, cu, 0.3)
    monkeypatch.setattr(bwd, "BWD_BACKEND", "auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = bwd.attention_prefill_backward_any(do, q, k, v, out, lse, cu, 0.3)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    monkeypatch.setattr(bwd, "BWD_BACKEND", "cudnn")
    with pytest.raises(RuntimeError, match="not on CUDA.*BITMATCH_ATTENTION_BWD"):
        bwd.attention_prefill_backward_any(do, q, k, v, out, lse, cu, 0.3)
    monkeypatch.setattr(bwd, "BWD_BACKEND", "cudn")
    with pytest.raises(ValueError, match="'triton', 'cudnn' or 'auto'"):
        bwd.attention_prefill_backward_any(do, q, k, v, out, lse, cu, 0.3)


def _fake_cudnn_sdpa_backward(do, q, k, v, o, stats, seed, offset, bias, cq, ck, max_q, max_k, p,
                              causal, *, scale):
    """The flash backward math from cuDNN's inputs ([B, H, S, D] views, natural-log stats), in
    float64: stands in for torch's cuDNN op on CPU so the packing around it is tested here."""
    G = q.shape[1] // k.shape[1]
    qd, dod, od = q.double(), do.double(), o.double()
    kd, vd = (t.double().repeat_interleave(G, 1) for t in (k, v))
    st = stats.double().reshape(q.shape[0], q.shape[1], q.shape[2], 1)
    s = scale * qd @ kd.transpose(-1, -2)
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -torch.inf)
    pm = torch.exp(s - st)
    dv = pm.transpose(-1, -2) @ dod
    ds = pm * (dod @ vd.transpose(-1, -2) - (dod * od).sum(-1, keepdim=True))
    dq, dk = scale * ds @ kd, scale * ds.transpose(-1, -2) @ qd
    B, Hk, S, D = k.shape
    dk, dv = (t.view(B, Hk, G, S, D).sum(2) for t in (dk, dv))
    # outputs laid out like the inputs, as cuDNN's empty_like does
    return tuple(torch.empty_like(a).copy_(b) for a, b in zip((q, k, v), (dq, dk, dv)))


@pytest.mark.parametrize("lens", [[24, 24, 24], [9, 31, 20]])       # views / padded
@pytest.mark.parametrize("layout", [(("B", "H", "S", "1"), (0, 1, 2, 3), "gqa"),
                                    (("B", "H", "S", "1"), (0, 2, 1, 3), "expand")])
def test_attention_backward_cudnn_packing(monkeypatch, lens, layout):
    """The cuDNN backend's packing (kernels/triton/attention_bwd.py _cudnn_call: [B, H, S, D]
    views, a ragged batch padded with zero rows, our base-2 lse as natural-log stats in either
    stride order, GQA native or expanded and summed back) around the flash backward math in
    float64 gives the float64 gradients of the packed causal batch. cuDNN itself runs on the GPU
    (benchmarks/ops/gpu_ops.py --only attention_bwd_cudnn)."""
    bwd = importlib.import_module("bitmatch.kernels.triton.attention_bwd")
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward",
                        _fake_cudnn_sdpa_backward)
    q, k, v, cu = _seqs(lens, Hq=4, Hkv=2, D=16, seed=11)
    q, k, v = q.float(), k.float(), v.float()
    do = _randn(q.shape[0], 4, 16, seed=12).float()
    out, lse = K.attention.attention_prefill(q, k, v, cu, 0.3, True, None, return_lse=True)
    got = bwd._cudnn_call(do, q, k, v, out, lse, cu, 0.3, True, max(lens), layout)
    for g, ref in zip(got, _ref_attn_grads(q, k, v, cu, 0.3, True, None, do)):
        assert g.shape == ref.shape and _rel_err(g, ref) < 1e-5


def test_attention_backward_cudnn_check(monkeypatch):
    """The one-time check (_cudnn_check) around stand-in cuDNN ops: it learns the forward's stats
    layout and passes; a backward that reads the stats as base-2 (the conversion skipped) fails it
    and the verdict names the gradient."""
    bwd = importlib.import_module("bitmatch.kernels.triton.attention_bwd")

    def fake_fwd(q, k, v, bias, lse_on, p, causal, dbg, *, scale):   # stats [B, H, S, 1], S fastest
        return None, torch.zeros(q.shape[0], q.shape[1], q.shape[2], 1)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", fake_fwd)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward",
                        _fake_cudnn_sdpa_backward)
    ok, why = bwd._cudnn_check(torch.device("cpu"))
    assert ok, why
    assert bwd._LAYOUT[None] == (("B", "H", "S", "1"), (0, 1, 2, 3), "gqa")
    monkeypatch.setattr(bwd, "_LN2", 1.0)
    ok, why = bwd._cudnn_check(torch.device("cpu"))
    assert not ok and "differs from the Triton backward" in why


@pytest.mark.slow  # 11 s in the interpreter
def test_attention_skip_full_block_masks_same_bits(small_partition):
    """SKIP_FULL_BLOCK_MASKS (no mask select on blocks every valid row sees whole) keeps the
    bits: causal prefill (varlen, G = 3 padded head rows, fused and split tiles), a window wider
    than a KV block (full blocks between window edge and diagonal), chunked paged prefill and
    decode."""
    att = K.attention
    lens = [130, 9]
    q, k, v, cu = _seqs(lens, Hq=6, Hkv=2, D=16, seed=50)
    kc, vc, bt_row = _paged_cache(k[:130], v[:130], 16, 12, seed=7)
    ts = [63, 129]

    def run():
        return [att.attention_prefill(q, k, v, cu, 0.3, True, None),
                att.attention_prefill(q, k, v, cu, 0.3, True, None, force_mode="split", block_m=16),
                att.attention_prefill(q, k, v, cu, 0.3, True, 100),
                att.attention_paged(q[100:130].contiguous(), kc, vc, bt_row[None].contiguous(),
                                    torch.tensor([0, 30], dtype=torch.int32),
                                    torch.tensor([130], dtype=torch.int32), 0.3, 100),
                att.attention_decode(torch.stack([q[t] for t in ts]).contiguous(), kc, vc,
                                     bt_row[None].repeat(len(ts), 1).contiguous(),
                                     torch.tensor([t + 1 for t in ts], dtype=torch.int32), 0.3)]

    old = att.SKIP_FULL_BLOCK_MASKS
    try:
        att.SKIP_FULL_BLOCK_MASKS = False
        ref = run()
        att.SKIP_FULL_BLOCK_MASKS = True
        got = run()
    finally:
        att.SKIP_FULL_BLOCK_MASKS = old
    for i, (a, b) in enumerate(zip(got, ref)):
        assert torch.equal(a, b), i
    assert torch.equal(ref[1], ref[0]) and torch.equal(ref[3], ref[2][100:130])
    assert torch.equal(ref[4][0], ref[0][63]) and torch.equal(ref[4][1], ref[0][129])


def test_attention_paged_strided_cache_views():
    """A paged cache given as strided views (K and V interleaved per slot inside one tensor, the
    layout bitmatch keeps inside vLLM's cache) gives the bits of the contiguous caches."""
    att = K.attention
    L, page, Hkv, D = 70, 16, 2, 16
    q, k, v, cu = _seqs([L], Hq=4, Hkv=Hkv, D=D, seed=60)
    kc, vc, bt_row = _paged_cache(k, v, page, 8, seed=9)
    nb = kc.shape[0]
    store = torch.full((nb, Hkv, page, 2 * D), float("nan"), dtype=kc.dtype)  # vLLM's shape
    v5 = torch.as_strided(store, (nb, page, 2, Hkv, D), (store.stride(0), 2 * Hkv * D, Hkv * D, D, 1))
    ks, vs = v5[:, :, 0], v5[:, :, 1]
    ks.copy_(kc)
    vs.copy_(vc)
    assert not ks.is_contiguous()
    ts = [0, 37, 69]
    qd = torch.stack([q[t] for t in ts]).contiguous()
    bt = bt_row[None].repeat(len(ts), 1).contiguous()
    sl = torch.tensor([t + 1 for t in ts], dtype=torch.int32)
    assert torch.equal(att.attention_decode(qd, ks, vs, bt, sl, 0.3),
                       att.attention_decode(qd, kc, vc, bt, sl, 0.3))
    args = (q[40:].contiguous(), None, None, bt_row[None].contiguous(),
            torch.tensor([0, L - 40], dtype=torch.int32), torch.tensor([L], dtype=torch.int32), 0.3)
    strided = att.attention_paged(args[0], ks, vs, *args[3:])
    assert torch.equal(strided, att.attention_paged(args[0], kc, vc, *args[3:]))
    with pytest.raises(ValueError, match="share strides"):
        att.attention_decode(qd, ks, vc, bt, sl, 0.3)


def test_attention_decode_context_bound_same_bits(small_partition):
    """The engine's decode graphs are captured per context bucket (bitmatch/engine/graphs.py):
    the host bound ``max_seq_len`` (how many KV partitions the launch covers) may exceed every
    row's context by several partitions and must not change one bit (partitions past a row's
    context are empty and skipped by the merge)."""
    att = K.attention
    L, page, Hkv, D = 300, 16, 2, 32
    q, k, v, _ = _seqs([L], Hq=4, Hkv=Hkv, D=D, seed=70)
    kc, vc, bt_row = _paged_cache(k, v, page, 64, seed=11)
    width = 640 // page          # the block table covers the largest bound below
    bt_row = torch.cat([bt_row, bt_row[:1].repeat(width - bt_row.shape[0])])
    ts = [0, 127, 128, 200, 299]
    qd = torch.stack([q[t] for t in ts]).contiguous()
    bt = bt_row[None].repeat(len(ts), 1).contiguous()
    sl = torch.tensor([t + 1 for t in ts], dtype=torch.int32)
    qsl = torch.arange(len(ts) + 1, dtype=torch.int32)
    # split mode: one program per KV partition and a merge (what a decode launch on the GPU runs)
    outs = [att.attention_paged(qd, kc, vc, bt, qsl, sl, 0.3, max_query_len=1, max_seq_len=n,
                                force_mode=mode) for n in (300, 384, 512, 640) for mode in ("split", "fused")]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    # control: a bound below the longest context drops partitions, and the comparison sees it
    short = att.attention_paged(qd, kc, vc, bt, qsl, sl, 0.3, max_query_len=1, max_seq_len=128,
                                force_mode="split")
    assert not torch.equal(outs[0], short)


def test_linear_rows_of_runs_the_whole_weights_split():
    """``kernels.linear(x, w_rows, rows_of=N)``: a row slice of an N-row weight (a tensor-parallel
    rank's output rows) gets exactly those columns of the whole weight's product, its K split
    included; the slice's own split (control) is another order. Bad ``rows_of`` is named."""
    import bitmatch.kernels as BK
    Kd, N = 512, 48
    # fp32 out: the two orders' last bits show (a bf16 rounding could hide them)
    x, w = _randn(9, Kd, seed=7, dtype=torch.float32), _randn(N, Kd, seed=8, dtype=torch.float32)
    with order.override(linear_split_table=(((N, Kd), 2),)), BK.use_backend("triton"):
        full = BK.linear(x, w)
        assert torch.equal(BK.linear(x, w[:24].contiguous(), rows_of=N), full[:, :24])
        assert torch.equal(BK.linear(x, w[24:].contiguous(), rows_of=N), full[:, 24:])
        assert not torch.equal(BK.linear(x, w[:24].contiguous()), full[:, :24])
        with pytest.raises(ValueError, match="rows_of"):
            BK.linear(x, w, rows_of=10)

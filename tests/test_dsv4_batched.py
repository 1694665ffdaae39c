"""DeepSeek-V4's batched attention ops (every row of a step in one call, through ``KeyRows``):
sink_attention_rows and indexer_select on the Triton backend (interpreter) against the reference;
bit for bit along every axis (batch composition and padding, packed vs alone, full prefill vs
chunked prefill vs decode with a window completing mid-chunk, paged at two block sizes, indexer
ties to the lowest index), each with a control that fails; the whole model engine == trainer on
the Triton backend; a decode step reads nothing back to the host."""
from __future__ import annotations

import pytest
import torch

import bitmatch
import bitmatch.kernels as K
import bitmatch.models as M
from bitmatch.engine import Engine, SamplingParams, model_runner
from bitmatch.kernels import stock
from bitmatch.kernels.compressed_attention import KeyRows, entry_list, sink_attention_rows
from bitmatch.kernels.indexer import indexer_select
from bitmatch.models.deepseek_v4_tiny import tiny_model
from bitmatch.testing import BitMismatch, assert_batch_invariant, assert_bitwise_equal
from bitmatch.testing.models import random_prompts
from host_reads import host_reads
from test_engine import assert_bitmatch

pytestmark = pytest.mark.interpreter
H, D, W, RATE = 4, 32, 5, 4


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _seq(L, dtype, seed, top_k=3, d=D):
    """One sequence: q [L, H, d], its per-position kv and entry rows (entry c at row (c+1)*RATE-1),
    sinks, and a random selection of complete entries per position (CSA lists)."""
    g = _g(seed)
    q, kv, ent = (torch.randn(*s, generator=g).to(dtype) for s in ((L, H, d), (L, d), (L, d)))
    pos = torch.arange(L)
    vis = torch.arange(L // RATE).view(1, -1) < ((pos + 1) // RATE).view(-1, 1)
    sel = entry_list(vis & (torch.rand(vis.shape, generator=g) < 0.6), top_k)
    return q, pos, kv, ent, sel, torch.randn(H, generator=g)


def _paged(stores, lens, bs, seed):
    """Per-token stores of several sequences scattered into shuffled blocks of ``bs``."""
    per = [-(-n // bs) for n in lens]
    perm = torch.randperm(sum(per) + 3, generator=_g(seed))
    out = [torch.zeros((perm.numel() * bs, *s[0].shape[1:]), dtype=s[0].dtype) for s in stores]
    bt = torch.zeros(len(lens), max(per), dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        for j in range(per[b]):
            bt[b, j] = int(perm[used])
            used += 1
        p = torch.arange(n)
        slots = bt[b, p // bs].long() * bs + p % bs
        for o, s in zip(out, stores):
            o[slots] = s[b]
    return out, bt


def _call(q, pos, kv, ent, sel, sinks, rows, mode):
    kw = dict(scale=D ** -0.5, window=W)
    if mode == "hca":
        kw.update(entries=ent, rate=RATE)
    elif mode == "csa":
        kw.update(entries=ent, rate=RATE, selected=sel)
    return sink_attention_rows(q, pos, kv, sinks, rows, **kw)


@pytest.mark.parametrize("mode", ["sliding", "hca", "csa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sink_attention_rows_close_to_reference_paged(mode, dtype):
    lens = [23, 9, 14]
    seqs = [_seq(n, dtype, seed=i) for i, n in enumerate(lens)]
    (kv, ent), bt = _paged([[s[2] for s in seqs], [s[3] for s in seqs]], lens, 4, seed=1)
    # a step: the last 7 rows of seq 0 (chunk), one decode row of seq 1, all of seq 2
    take = [(0, range(16, 23)), (1, range(8, 9)), (2, range(14))]
    q = torch.cat([seqs[b][0][list(r)] for b, r in take])
    pos = torch.cat([torch.tensor(list(r)) for _, r in take])
    sel = torch.cat([seqs[b][4][list(r)] for b, r in take])
    qsl = torch.tensor([0, 7, 8, 22], dtype=torch.int32)
    rows = KeyRows.paged(bt, 4, qsl, q.shape[0], max_len=24)
    sinks = seqs[0][5]
    ref = _call(q, pos, kv, ent, sel, sinks, rows, mode)
    with K.use_backend("triton"):
        got = _call(q, pos, kv, ent, sel, sinks, rows, mode)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - ref.float()).abs().max() < tol
    # the same rows through the one-sequence op (the reference of the reference): equal bits
    one = K.sink_attention(q[:7], pos[:7], seqs[0][2], seqs[0][3][RATE - 1::RATE], torch.zeros(7, 5, dtype=torch.bool)
                           if mode == "sliding" else _mask(sel[:7], 5, pos[:7], mode), sinks, scale=D ** -0.5, window=W)
    assert_bitwise_equal(ref[:7], one, "rows reference vs one-sequence reference")


def _mask(sel, n, pos, mode):
    if mode == "hca":
        return torch.arange(n).view(1, -1) < ((pos + 1) // RATE).view(-1, 1)
    m = torch.zeros(sel.shape[0], n + 1, dtype=torch.bool)
    return m.scatter_(1, torch.where(sel >= 0, sel.long(), n), True)[:, :n]


def _packed_fn(kv, ent, sinks, mode, stock_scores=False):
    """fn(q, pos, start, sel) on one fixed packed store: the harness's rows are query rows."""
    def fn(q, pos, start, sel):
        rows = KeyRows.packed(pos, row_start=start, max_len=kv.shape[0])
        if stock_scores:
            return _stock_rows(q, pos, start, kv, ent, sinks)
        with K.use_backend("triton"):
            return _call(q, pos, kv, ent, sel, sinks, rows, mode)
    return fn


def _stock_rows(q, pos, start, kv, ent, sinks):
    """A stock batched formula (HCA, HF's eager attention): per head, every row's scores against
    the whole store in ONE matmul over the batch's rows (a lone row is a GEMV, a batch a GEMM:
    BLAS picks its kernel by the row count, as cuBLAS does), masked, one fp32 softmax with the sink."""
    T, S, d = q.shape[0], kv.shape[0], q.shape[2]
    keys = torch.cat([kv, ent]).float()
    sc = torch.matmul(q.float().transpose(0, 1), keys.t()).transpose(0, 1) * d ** -0.5
    j = torch.arange(S).view(1, -1) - start.view(-1, 1)
    loc = (j <= pos.view(-1, 1)) & (j > pos.view(-1, 1) - W)
    c = torch.div(j + 1, RATE, rounding_mode="floor") - 1
    ents = ((j + 1) % RATE == 0) & (c >= 0) & (c < ((pos + 1) // RATE).view(-1, 1))
    valid = torch.cat([loc, ents], 1).unsqueeze(1)
    logits = torch.cat([sc.masked_fill(~valid, float("-inf")), sinks.view(1, -1, 1).expand(T, -1, 1)], -1)
    p = logits.softmax(-1)[..., :-1]
    return (p @ torch.cat([kv, ent]).float()).to(q.dtype)


@pytest.mark.parametrize("mode", ["hca", "csa"])
def test_rows_batch_composition_padding_and_packing(mode):
    """A row alone == inside random batches of other rows and zero padding (the batch harness),
    and a sequence's rows alone == the same rows packed after another sequence."""
    q, pos, kv, ent, sel, sinks = _seq(20, torch.bfloat16, seed=3)
    start = torch.zeros(20, dtype=torch.int64)
    fn = _packed_fn(kv, ent, sinks, mode)
    assert_batch_invariant(fn, (q, pos, start, sel), max_batch=6, cases=3, seed=1)
    q2, pos2, kv2, ent2, sel2, _ = _seq(11, torch.bfloat16, seed=4)
    rows = KeyRows.packed(torch.cat([pos2, pos]))
    with K.use_backend("triton"):
        packed = _call(torch.cat([q2, q]), torch.cat([pos2, pos]), torch.cat([kv2, kv]), torch.cat([ent2, ent]),
                       torch.cat([sel2, sel]), sinks, rows, mode)
        alone = _call(q, pos, kv, ent, sel, sinks, KeyRows.packed(pos), mode)
    assert_bitwise_equal(packed[11:], alone, "packed after another sequence vs alone")


def test_control_stock_batched_scores_are_batch_variant():
    q, pos, kv, ent, sel, sinks = _seq(20, torch.float32, seed=3, d=128)
    fn = _packed_fn(kv, ent, sinks, "hca", stock_scores=True)
    with pytest.raises(BitMismatch):
        assert_batch_invariant(fn, (q, pos, torch.zeros(20, dtype=torch.int64), sel), max_batch=64, cases=4, seed=2)


@pytest.mark.parametrize("mode", ["sliding", "hca", "csa"])
def test_rows_prefill_chunked_decode_and_block_size_agree(mode):
    """Full prefill (packed) == chunked prefill (paged, block size 4; a window completes inside
    the chunk 5:11) == one-row decode steps (paged, block size 16), bit for bit."""
    L = 19
    q, pos, kv, ent, sel, sinks = _seq(L, torch.bfloat16, seed=5)
    with K.use_backend("triton"):
        full = _call(q, pos, kv, ent, sel, sinks, KeyRows.packed(pos), mode)
        for bs, cuts in ((4, [0, 5, 11, 12, 19]), (16, list(range(L + 1)))):
            (kvp, entp), bt = _paged([[kv], [ent]], [L], bs, seed=bs)
            for a, b in zip(cuts[:-1], cuts[1:]):
                rows = KeyRows.paged(bt, bs, torch.tensor([0, b - a], dtype=torch.int32), b - a, max_len=L)
                got = _call(q[a:b], pos[a:b], kvp, entp, sel[a:b], sinks, rows, mode)
                assert_bitwise_equal(got, full[a:b], f"{mode} block size {bs} rows {a}:{b}")


def test_control_stock_attention_prefill_differs_from_decode():
    """The same comparison on the stock formula (HF's fp32 matmul over every key of the call)."""
    g = _g(6)
    L, Hs, Ds = 96, 8, 64
    q, kv, ent = torch.randn(L, Hs, Ds, generator=g), torch.randn(L, Ds, generator=g), torch.randn(24, Ds, generator=g)
    pos = torch.arange(L)
    mask = torch.arange(24).view(1, -1) < ((pos + 1) // 4).view(-1, 1)
    sinks = torch.randn(Hs, generator=g)
    full = stock.sink_attention(q, pos, kv, ent, mask, sinks, scale=0.125, window=48)
    with pytest.raises(BitMismatch):
        for t in range(L):
            c = (t + 1) // 4
            assert_bitwise_equal(stock.sink_attention(q[t:t + 1], pos[t:t + 1], kv[:t + 1], ent[:c], mask[t:t + 1, :c],
                                                      sinks, scale=0.125, window=48), full[t:t + 1], f"t={t}")


# ---------------------------------------------------------------- fused backward

def _rows64(q, kv, ent, sinks, pos, sel, rows, mode, value_grad=True):
    """The rows' attention in float64 (the dense formula on every row's window and entries);
    ``value_grad=False`` detaches the keys' value role (the control: K = V feeds both)."""
    keys, valid = stock.row_keys(q, pos, kv, ent if mode != "sliding" else None, sel if mode == "csa" else None,
                            rows, W, RATE)
    sc = torch.einsum("thd,tkd->thk", q, keys) * D ** -0.5
    sc = sc.masked_fill(~valid.unsqueeze(1), float("-inf"))
    p = torch.cat([sc, sinks.view(1, -1, 1).expand(sc.shape[0], -1, 1)], -1).softmax(-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", p, keys if value_grad else keys.detach())


def _two_packed(mode, dtype=torch.float32):
    q1, p1, kv1, e1, s1, sinks = _seq(13, dtype, seed=7)
    q2, p2, kv2, e2, s2, _ = _seq(22, dtype, seed=8)
    pos = torch.cat([p1, p2])
    return (torch.cat([q1, q2]), pos, torch.cat([kv1, kv2]), torch.cat([e1, e2]), torch.cat([s1, s2]), sinks,
            KeyRows.packed(pos))


def _grads(fn, leaves, w):
    (fn(*leaves) * w).sum().backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("mode", ["sliding", "hca", "csa"])
def test_fused_backward_matches_float64(mode):
    """Triton's fused backward (atomics into the K = V rows, entries, the sinks) == float64 autograd."""
    q, pos, kv, ent, sel, sinks, rows = _two_packed(mode)
    w = torch.randn(q.shape, generator=_g(9), dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, kv, ent, sinks)]
    with K.use_backend("triton"):
        got = _grads(lambda a, b, c, d: _call(a, pos, b, c, sel, d, rows, mode).double(), leaves, w)
    l64 = [t.detach().double().requires_grad_() for t in (q, kv, ent, sinks)]
    want = _grads(lambda a, b, c, d: _rows64(a, b, c, d, pos, sel, rows, mode), l64, w)
    for name, a, b in zip(("q", "kv", "entries", "sinks"), got, want):
        if mode == "sliding" and name == "entries":
            assert a is None or a.abs().max() == 0
            continue
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < 1e-5, f"{mode} d{name}: relative error {err:.2e}"


def test_control_backward_without_the_value_role_fails():
    """The tolerance sees a dropped term: the keys' gradient without their value role (K = V)."""
    q, pos, kv, ent, sel, sinks, rows = _two_packed("csa")
    w = torch.randn(q.shape, generator=_g(9), dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, kv, ent, sinks)]
    with K.use_backend("triton"):
        got = _grads(lambda a, b, c, d: _call(a, pos, b, c, sel, d, rows, "csa").double(), leaves, w)
    l64 = [t.detach().double().requires_grad_() for t in (q, kv, ent, sinks)]
    want = _grads(lambda a, b, c, d: _rows64(a, b, c, d, pos, sel, rows, "csa", value_grad=False), l64, w)
    assert ((got[1].double() - want[1]).norm() / want[1].norm()).item() > 1e-2


def test_fused_backward_keeps_forward_bits_and_bf16_is_close():
    """The grad path's forward (which also stores the logsumexp) == the no-grad forward, bit for bit;
    bf16 gradients stay close to float64."""
    q, pos, kv, ent, sel, sinks, rows = _two_packed("csa", torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, kv, ent, sinks.float())]
    with K.use_backend("triton"):
        out = _call(*leaves[:1], pos, leaves[1], leaves[2], sel, leaves[3], rows, "csa")
        with torch.no_grad():
            assert_bitwise_equal(out, _call(q, pos, kv, ent, sel, sinks, rows, "csa"), "grad vs no-grad forward")
        w = torch.randn(q.shape, generator=_g(9))
        (out.float() * w).sum().backward()
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    (_rows64(l64[0], l64[1], l64[2], l64[3], pos, sel, rows, "csa") * w.double()).sum().backward()
    for a, b in zip(leaves, l64):
        assert ((a.grad.double() - b.grad).norm() / b.grad.norm()).item() < 2e-2


# ---------------------------------------------------------------- indexer

def _idx_case(T=21, Hi=4, Di=16, seed=7):
    g = _g(seed)
    q = torch.randn(T, Hi, Di, generator=g).to(torch.bfloat16)
    keys = torch.randn(T, Di, generator=g).to(torch.bfloat16)
    for c in (3, 4):  # entries 1, 3 and 4 (rows 7, 15, 19) equal: ties for every query
        keys[(c + 1) * RATE - 1] = keys[2 * RATE - 1]
    return q, torch.arange(T), keys, torch.rand(T, Hi, generator=g) + 0.1


def test_indexer_select_ties_lowest_index_invariant_and_equal_to_reference():
    q, pos, keys, w = _idx_case()
    kw = dict(rate=RATE, top_k=2, softmax_scale=0.25)
    ref = indexer_select(q, pos, keys, w, KeyRows.packed(pos), **kw)
    with K.use_backend("triton"):
        full = indexer_select(q, pos, keys, w, KeyRows.packed(pos), **kw)
        for t in (3, 8, 15, 19, 20):  # alone, as a decode row with a longer static bound
            one = indexer_select(q[t:t + 1], pos[t:t + 1], keys, w[t:t + 1],
                                 KeyRows.packed(pos[t:t + 1], row_start=torch.zeros(1, dtype=torch.int64),
                                                max_len=64), **kw)
            assert torch.equal(one, full[t:t + 1]), t
    assert torch.equal(full, ref)
    tied = [r for r in full.tolist() if {1, 3, 4} & set(r)]
    assert tied and all(not ({3, 4} & set(r)) or 1 in r for r in tied)  # 3 or 4 only after 1


def test_trainer_bound_is_the_longest_sequence_and_selects_the_same():
    """The trainer's KeyRows bound is ctx.max_seq_len (indexer scores [T, longest / m], not
    [T, T / m]); two packed sequences select the same entries under either bound."""
    from bitmatch.context import ForwardContext
    from bitmatch.models.deepseek_v4_attention import sequences
    q1, p1, k1, w1 = _idx_case()
    q2, p2, k2, w2 = (t[:13] for t in _idx_case())
    q, pos, keys, w = (torch.cat(a) for a in ((q1, q2), (p1, p2), (k1, k2), (w1, w2)))
    cu = torch.tensor([0, p1.shape[0], pos.shape[0]], dtype=torch.int32)
    rows = sequences(ForwardContext(positions=pos, cu_seqlens=cu, max_seq_len=p1.shape[0]), pos)
    assert rows.max_len == p1.shape[0]
    kw = dict(rate=RATE, top_k=2, softmax_scale=0.25)
    with K.use_backend("triton"):
        got = indexer_select(q, pos, keys, w, rows, **kw)
        want = indexer_select(q, pos, keys, w, KeyRows.packed(pos), **kw)
    assert torch.equal(got, want)


def test_control_torch_topk_breaks_ties_elsewhere():
    """HF's selection (torch.topk) on tied scores: not the lowest index."""
    s = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.5, 3.0, 3.0, 3.0] * 4])
    low = torch.sort(s, descending=True, stable=True).indices[:, :3]
    assert not torch.equal(s.topk(3).indices.sort(1).values, low.sort(1).values)


# ---------------------------------------------------------------- the model

@pytest.fixture(scope="module")
def model():
    return bitmatch.patch(tiny_model(torch.bfloat16, seed=1))


def test_model_engine_equals_trainer_on_triton(model):
    """The whole V4 model on the Triton backend: the engine (paged, chunks of 3 tokens: CSA rate 2
    and HCA rate 4 windows close inside and across chunks, then decode) == token_logprobs."""
    prompts = [random_prompts(1, 6, 6, seed=9)[0], random_prompts(1, 3, 3, seed=10)[0]]
    params = [SamplingParams(temperature=t, max_tokens=2, seed=i, ignore_eos=True) for i, t in enumerate([1.0, 0.0])]
    with K.use_backend("triton"):
        outs = Engine(model, max_num_seqs=2, max_num_batched_tokens=3, block_size=4,
                      enforce_eager=True).generate(prompts, params, use_tqdm=False)
        assert assert_bitmatch(model, outs, params) == 4


def test_compressor_row_chunks_do_not_change_bits(model, monkeypatch):
    """compress_rows's reference pools its rows in chunks (memory): 2-row chunks give the same bits."""
    from bitmatch.context import ForwardContext
    from bitmatch.kernels import compressor as C
    ids = torch.tensor(random_prompts(1, 23, 23, seed=12)[0])
    ctx = ForwardContext(positions=torch.arange(23), cu_seqlens=torch.tensor([0, 23], dtype=torch.int32))
    with torch.no_grad():
        whole = M.forward_hidden(model, ids, ctx)
        # 2 rows: 2m x C = 2 * 4 * 32 (HCA), 2 * 2 * 64 (CSA); the trainer pools only closing rows
        monkeypatch.setattr(C, "_ROWS_SCRATCH", 2 * 2 * 4 * 32)
        assert_bitwise_equal(M.forward_hidden(model, ids, ctx), whole, "row chunks")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_closing_only_entries_equal_every_row_pooling(model, backend):
    """The trainer computes only the rows closing a window (nonzero_static, T // m of them); their
    entries equal the every-row pooling's (the engine's) bit for bit; the other rows are zeros."""
    from bitmatch.context import ForwardContext
    from bitmatch.models import deepseek_v4_attention as A
    lm = M.unwrap_causal_lm(model)
    spec = M.family_of(model).build_spec(lm)
    i = next(j for j, lt in enumerate(spec.layer_types) if lt == A.CSA)
    comp = lm.model.layers[i].self_attn.compressor
    m = spec.compress_rates[A.CSA]
    pos = torch.cat([torch.arange(11), torch.arange(6)])
    ctx = ForwardContext(positions=pos, cu_seqlens=torch.tensor([0, 11, 17], dtype=torch.int32), max_seq_len=11)
    rows = A.sequences(ctx, pos)
    c = comp.kv_proj.weight.shape[0]
    raw = [torch.randn(17, c, generator=_g(s)).to(torch.bfloat16) for s in (1, 2)]
    with torch.no_grad(), K.use_backend(backend):
        rope_at = A.rope_lookup(spec, ctx, rows)
        every = A.closing_entries(comp, *raw, rows, pos, m, True, torch.bfloat16, rope_at)
        only = A.closing_entries(comp, *raw, rows, pos, m, True, torch.bfloat16, rope_at, closing_only=True)
    close = (pos + 1) % m == 0
    assert_bitwise_equal(only[close], every[close], "closing rows")
    assert not only[~close].any()


def _decode_reads(model, backend):
    reads, seen = [], []
    orig = M.forward_hidden

    def spy(m, ids, ctx, *a, **kw):
        if ctx.max_query_len != 1 or seen:
            return orig(m, ids, ctx, *a, **kw)
        seen.append(1)
        with K.use_backend(backend), host_reads(depth=5) as r:
            orig(m, ids, ctx, *a, **kw)
        reads.extend(r)
        return orig(m, ids, ctx, *a, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(M, "forward_hidden", spy)
        if hasattr(model_runner, "forward_hidden"):  # the runner imports it at the top: patch its name too
            mp.setattr(model_runner, "forward_hidden", spy)
        Engine(model, num_gpu_blocks=64, max_num_seqs=4, enforce_eager=True).generate(
            random_prompts(3, 4, 9, seed=3), SamplingParams(temperature=0.8, max_tokens=2, ignore_eos=True),
            use_tqdm=False)
    assert seen, "no pure-decode step ran"
    return reads


def test_decode_step_reads_nothing_on_the_host(model):
    assert not _decode_reads(model, "triton")


def test_control_reference_decode_step_reads_on_the_host(model):
    # the detector's control: the reference groups rows by sequence on the host (unique, tolist)
    found = {what for what, _ in _decode_reads(model, "reference")}
    assert {"aten._unique2", "Tensor.tolist"} <= found, found


# ---------------------------------------------------------------- compress_rows (the compressor from the stores)
def _rows_store(lens, C, dtype, seed):
    """Per-token raw kv / gate stores of packed sequences (from position 0) and their positions."""
    g = _g(seed)
    T = sum(lens)
    kv, gate = (torch.randn(T, C, generator=g).to(dtype) for _ in range(2))
    pos = torch.cat([torch.arange(n) for n in lens])
    return kv, gate, torch.randn(RATE, C, generator=g), pos


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compress_rows_is_compress_windows_of_the_gathered_windows(backend, overlap, dtype):
    """compress_rows reads each row's windows from the store (packed rows, and the same rows
    scattered into shuffled paged blocks of two sizes): compress_windows of the gathered windows,
    bit for bit, every row; a subset of rows alone has the same bits. Control: windows one
    position off give other bits."""
    lens = (13, 6)
    kv, gate, bias, pos = _rows_store(lens, 32 if overlap else 16, dtype, seed=31)
    rows = KeyRows.packed(pos)
    with K.use_backend(backend):
        got = K.compress_rows(kv, gate, bias, pos, rows, rate=RATE, overlap=overlap)
        idx, prev, has = rows.window_slots(pos, RATE, overlap)
        kw = {} if not overlap else dict(prev_kv=kv[prev][..., :16], prev_gate=gate[prev][..., :16], has_prev=has)
        want = K.compress_windows(kv[idx], gate[idx], bias, **kw)
        assert_bitwise_equal(got, want, f"{backend} packed rows")
        for bs in (4, 16):
            (kvp, gp), bt = _paged([list(kv.split(lens)), list(gate.split(lens))], list(lens), bs, seed=bs)
            qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
            prow = KeyRows.paged(bt, bs, qsl, pos.shape[0])
            assert_bitwise_equal(K.compress_rows(kvp, gp, bias, pos, prow, rate=RATE, overlap=overlap), got,
                                 f"{backend} paged block size {bs}")
        pick = torch.tensor([3, 11, 15])
        alone = K.compress_rows(kv, gate, bias, pos[pick], rows.take(pick), rate=RATE, overlap=overlap)
        assert_bitwise_equal(alone, got[pick], f"{backend} rows alone")
        # the first sequence's rows read one store row later
        off = K.compress_rows(kv, gate, bias, pos[:12], KeyRows.packed(pos[:12], row_start=rows.row_start[:12] + 1),
                              rate=RATE, overlap=overlap)
    with pytest.raises(BitMismatch):
        assert_bitwise_equal(off, got[:12], "control: windows one row later")


def test_compress_rows_gradients_match_float64_and_errors_are_named():
    kv, gate, bias, pos = _rows_store((9, 5), 32, torch.float32, seed=32)
    rows = KeyRows.packed(pos)
    w = torch.randn(pos.shape[0], 16, generator=_g(33), dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (kv, gate, bias)]
    (K.compress_rows(*leaves, pos, rows, rate=RATE, overlap=True).double() * w).sum().backward()
    l64 = [t.double().requires_grad_() for t in (kv, gate, bias)]
    (stock.compress_rows(*l64, pos, rows, rate=RATE, overlap=True) * w).sum().backward()
    for a, b in zip(leaves, l64):
        assert ((a.grad.double() - b.grad).norm() / b.grad.norm()) < 1e-5
    with pytest.raises(ValueError, match="position_bias"):
        K.compress_rows(kv, gate, bias[:, :8], pos, rows, rate=RATE, overlap=True)
    with pytest.raises(ValueError, match="C = 2D"):
        K.compress_rows(kv[:, :31], gate[:, :31], bias[:, :31], pos, rows, rate=RATE, overlap=True)
    with pytest.raises(ValueError, match="rate"):
        K.compress_rows(kv, gate, bias, pos, rows, rate=0, overlap=True)

"""The chunked-SSD Triton scan (kernels/triton/mamba_ssd.py) in Triton's CPU interpreter: a full
prefill == every two-way chunked-prefill split == token-by-token decode bit for bit (bf16 and fp32,
the cache's boundary state too), sequences packed with others in shuffled slots == alone, parity
with the float64 reference; and the controls: the same kernel with chunks aligned 5 positions off
(a packing offset, as a varlen scan aligned to the packed buffer would) changes the bits, HF's torch
scan split in two or stepped token by token changes them, and dropping the carried state fails the
parity tolerance. Tiny shapes (tl.dot needs dims >= 16)."""
from __future__ import annotations

import random

import pytest
import torch

import bitmatch
import bitmatch.kernels as K
from bitmatch.engine import Engine, SamplingParams
from bitmatch.kernels.triton import mamba_ssd
from bitmatch.models import nemotron_h as NH
from bitmatch.testing import assert_bitwise_equal
from bitmatch.testing.models import random_prompts
from test_engine import assert_bitmatch

pytestmark = pytest.mark.interpreter

H, P, G, N, Q = 4, 16, 2, 16, 16
DT_MIN = 1e-3
BF, F32 = torch.bfloat16, torch.float32


def _seq(T, seed, dtype=BF):
    g = torch.Generator().manual_seed(seed)
    x, dt = torch.randn(T, H, P, generator=g), torch.randn(T, H, generator=g) - 1
    B, C = torch.randn(T, G, N, generator=g), torch.randn(T, G, N, generator=g)
    return tuple(t.to(dtype) for t in (x, dt, B, C))


def _params(seed=1):
    g = torch.Generator().manual_seed(seed)
    return -torch.rand(H, generator=g) * 2 - 0.1, torch.randn(H, generator=g), torch.randn(H, generator=g) * 0.5


def _cache(dtype, slots=4, q=Q):
    return (torch.zeros(slots, H, P, N), torch.zeros(slots, q, H, P, dtype=dtype),
            torch.zeros(slots, q, G, N, dtype=dtype), torch.zeros(slots, q, H))


def _scan(parts, starts=None, cache=None, slots=None, params=None, q=Q, host=False):
    """One launch over the packed ``parts`` (tuples x, dt, B, C) continuing at ``starts``
    (``host``: cu_seqlens on the host too, as the engine's decode steps give it)."""
    A, D, db = params or _params()
    cat = [torch.cat([p[j] for p in parts]) for j in range(4)]
    cu = torch.tensor([0] + list(torch.tensor([p[0].shape[0] for p in parts]).cumsum(0)))
    kw = {} if cache is None else dict(seq_start=torch.tensor(starts), cache=cache, state_slots=torch.tensor(slots))
    if host:
        kw["cu_seqlens_host"] = tuple(int(v) for v in cu)
    return K.mamba_chunk_scan(cat[0], cat[1], A, cat[2], cat[3], q, cu, D=D, dt_bias=db, dt_min=DT_MIN, **kw)


def _in_calls(seq, splits, dtype, slot=2, q=Q):
    """The sequence in consecutive calls of ``splits`` tokens through one cache slot."""
    cache, at, outs = _cache(dtype, q=q), 0, []
    for n in splits:
        outs.append(_scan([tuple(t[at:at + n] for t in seq)], [at], cache, [slot], q=q))
        at += n
    return torch.cat(outs), cache


@pytest.mark.parametrize(("T", "dtype"), [(37, BF), (37, F32), (2 * Q, BF)])
def test_prefill_equals_every_split_and_decode(T, dtype):
    """T = 37 (2 chunks + 5) and 32 (ending on a boundary): each two-way split point, token-by-token
    decode and a few three-way splits give the full prefill's bits; the slot's boundary state and
    open-chunk rows equal a cached full prefill's."""
    seq = _seq(T, seed=3, dtype=dtype)
    with K.use_backend("triton"):
        full = _scan([seq])
        want_y, want_cache = _in_calls(seq, [T], dtype)
        assert_bitwise_equal(want_y, full, "cached prefill vs uncached")
        cases = [[p, T - p] for p in range(1, T)] + [[1] * T, [Q - 1, 1, Q, 4, 1, 4], [3, 2 * Q, 2]]
        for splits in cases:
            got, cache = _in_calls(seq, splits, dtype)
            assert_bitwise_equal(got, full, f"splits {splits}")
            assert_bitwise_equal(cache[0][2], want_cache[0][2], f"splits {splits}: ssm_state")
            for name, a, b in zip(("x_buf", "B_buf", "dt_buf"), cache[1:], want_cache[1:]):  # the open chunk's rows
                assert_bitwise_equal(a[2, :T % Q], b[2, :T % Q], f"splits {splits}: {name}")


@pytest.mark.parametrize("dtype", [BF, F32])
def test_chunk_128_several_row_tiles_and_k_blocks(dtype):
    """Chunk 128 (bf16: two 64-row tiles over 32-position K blocks; fp32: four 32-row tiles): a row
    tile's K loop, the tiles after the first and the multi-block state update, with full prefill ==
    chunked calls crossing boundaries mid-tile == decode over a boundary, and parity with the
    reference."""
    q, T = 128, 2 * 128 + 21
    seq = _seq(T, seed=13, dtype=dtype)
    with K.use_backend("triton"):
        full = _scan([seq], q=q)
        for splits in ([70, 100, 29, 1, 1, 76], [T - 40] + [1] * 40, [5, 59, 1, 63, 1, 148]):
            got, _ = _in_calls(seq, splits, dtype, q=q)
            assert_bitwise_equal(got, full, f"chunk 128 splits {splits}")
    ref = _scan([seq], q=q)
    tol = {"rtol": 1e-5, "atol": 5e-5} if dtype == F32 else {"rtol": 0.0, "atol": 0.02 * float(ref.abs().max())}
    torch.testing.assert_close(full, ref, **tol)


def test_p_blocks_split_a_head_over_programs(monkeypatch):
    """Config BP < P (a head's channels over several programs; 8 of 16 here, which the interpreter
    allows): the interpreter's bits of one program per head, in a prefill and in chunked / decode
    calls through the cache (x rows written per program, dt rows staged per token and copied once)."""
    seq = _seq(37, seed=3)
    with K.use_backend("triton"):
        full = _scan([seq])
        base = mamba_ssd.config_for
        monkeypatch.setattr(mamba_ssd, "config_for", lambda *a, **k: {**base(*a, **k), "BP": 8})
        assert_bitwise_equal(_scan([seq]), full, "BP 8 prefill")
        for splits in ([5, 13, 3, 16], [20] + [1] * 17):
            got, _ = _in_calls(seq, splits, BF)
            assert_bitwise_equal(got, full, f"BP 8 splits {splits}")


def test_packed_with_others_in_shuffled_slots_equals_alone():
    """Five sequences advanced in random pieces (decode steps, chunk crossings), packed in one launch
    in random orders and cache slots: each gets the bits of its own full prefill."""
    seqs = [_seq(n, seed=10 + n) for n in (3, 17, 9, 1, 26)]
    rng = random.Random(1)
    with K.use_backend("triton"):
        alone = [_scan([s]) for s in seqs]
        for trial in range(2):
            slots = rng.sample(range(8), len(seqs))
            cache, done, outs = _cache(BF, slots=8), [0] * len(seqs), [[] for _ in seqs]
            while any(done[i] < seqs[i][0].shape[0] for i in range(len(seqs))):
                live = [i for i in range(len(seqs)) if done[i] < seqs[i][0].shape[0]]
                rng.shuffle(live)
                take = [min(rng.choice([1, 1, 2, 7, Q]), seqs[i][0].shape[0] - done[i]) for i in live]
                parts = [tuple(t[done[i]:done[i] + n] for t in seqs[i]) for i, n in zip(live, take)]
                y = _scan(parts, [done[i] for i in live], cache, [slots[i] for i in live])
                at = 0
                for i, n in zip(live, take):
                    outs[i].append(y[at:at + n])
                    at += n
                    done[i] += n
            for i in range(len(seqs)):
                assert_bitwise_equal(torch.cat(outs[i]), alone[i], f"trial {trial} seq {i}")


def test_control_chunk_alignment_changes_bits():
    """The same sequence behind 5 replayed zero positions (x = B = dt = 0: the same mathematics)
    has its chunks aligned 5 positions off, as a varlen scan aligned to the packed buffer would:
    close to the aligned result, never equal. Absolute alignment is what makes the bits stable."""
    seq = _seq(37, seed=3)
    with K.use_backend("triton"):
        aligned = _scan([seq])
        shifted = _scan([seq], [5], _cache(BF), [0])
    torch.testing.assert_close(shifted, aligned, rtol=0.05, atol=0.05 * float(aligned.abs().max()))
    assert not torch.equal(shifted, aligned)


def test_control_stock_torch_scan_split_or_stepped_differs():
    """HF's torch SSD (chunks relative to each call, the state handed over) split at 13, and its
    one-token recurrent step, differ from its own full prefill: the failure the scan removes."""
    hf = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    x, dt, B, C = _seq(30, seed=5, dtype=F32)
    A, D, db = _params()

    def run(a, b, initial=None, final=False):
        return hf.mamba2_chunk_scan(x[None, a:b], dt[None, a:b], A, B[None, a:b], C[None, a:b], Q, D=D,
                                    dt_bias=db, dt_softplus=True, dt_limit=(DT_MIN, float("inf")),
                                    initial_states=initial, return_final_states=final)
    full = run(0, 30)[0]
    first, state = run(0, 13, final=True)
    assert not torch.equal(torch.cat([first[0], run(13, 30, initial=state)[0]]), full)
    st, rec = torch.zeros(1, H, P, N), []
    for t in range(30):
        rec.append(hf.mamba2_selective_state_update(
            st, x[t][None], dt[t][None, :, None].expand(1, H, P), A[:, None, None].expand(H, P, N), B[t][None],
            C[t][None], D[:, None].expand(H, P), dt_bias=db[:, None].expand(H, P), dt_softplus=True))
    assert not torch.equal(torch.cat(rec), full)


@pytest.mark.parametrize("dtype", [BF, F32])
def test_parity_with_float64_reference_and_stateless_control(dtype):
    """Within tolerance of the reference backend (float64 on the same inputs): fp32 to 1e-5, bf16 to
    2% of the output's scale (bf16 dot operands, as mamba_ssm). Control: each chunk scanned as its
    own sequence (the carried state dropped) fails the same tolerance."""
    T = 3 * Q
    seq = _seq(T, seed=7, dtype=dtype)
    ref = _scan([seq])
    with K.use_backend("triton"):
        got = _scan([seq])
        stateless = _scan([tuple(t[c:c + Q] for t in seq) for c in range(0, T, Q)])
    scale = float(ref.abs().max())
    tol = dict(rtol=1e-5, atol=5e-5) if dtype == F32 else dict(rtol=0.0, atol=0.02 * scale)
    torch.testing.assert_close(got, ref, **tol)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(stateless, ref, **tol)


def test_triton_scan_refuses_untileable_shapes_and_a_misaligned_cache():
    """Errors name the argument and the fix: a chunk_size the tiles cannot cover, and a cache tensor
    off 16-byte alignment (alignment picks the kernel variant, and the cache cannot be copied)."""
    x, dt, B, C = _seq(4, seed=0)
    A, D, db = _params()
    with K.use_backend("triton"):
        with pytest.raises(NotImplementedError, match="chunk_size=8 must be a power of two"):
            K.mamba_chunk_scan(x, dt, A, B, C, 8, torch.tensor([0, 4]), D=D, dt_bias=db)
        cache = _cache(BF)
        off = torch.zeros(cache[0].numel() + 1)[1:].view(cache[0].shape)  # 4 bytes past an aligned start
        with pytest.raises(ValueError, match="ssm_state must be contiguous and 16-byte aligned"):
            _scan([(x, dt, B, C)], [0], (off,) + cache[1:], [0])


@pytest.mark.slow
def test_nemotron_h_bf16_engine_equals_trainer_on_triton():
    """The bf16 model on the Triton backend (bf16 dot operands in the scan): the engine's chunked
    prefill and decode across chunk boundaries == the trainer's forward, bit for bit."""
    m = bitmatch.patch(NH.FAMILY.tiny_model(dtype=torch.bfloat16, seed=0, chunk_size=16), compute_dtype=torch.bfloat16)
    prompts = random_prompts(2, 13, 18, seed=2)
    params = [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=i) for i in range(2)]
    with torch.no_grad(), K.use_backend("triton"):
        outs = Engine(m, max_num_seqs=2, max_num_batched_tokens=7).generate(prompts, params, use_tqdm=False)
        assert_bitmatch(m, outs, params)


@pytest.mark.slow
def test_nemotron_h_engine_equals_trainer_at_chunk_128_on_triton():
    """The model at the real chunk size (128: two 64-row tiles and four 32-position K blocks per
    chunk in the scan), on the Triton backend: 97-token chunked-prefill steps splitting prompts of
    120-270 tokens mid-chunk beside other sequences' decodes, simulated graph buckets, == the
    trainer's forward bit for bit (the chunk-16 model above has one tile and one block per chunk)."""
    m = bitmatch.patch(NH.FAMILY.tiny_model(
        dtype=torch.bfloat16, seed=0, hidden_size=64, mamba_num_heads=2, mamba_head_dim=32, n_groups=1,
        ssm_state_size=32, chunk_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        intermediate_size=64, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, n_routed_experts=4,
        num_experts_per_tok=2, vocab_size=128))
    prompts = random_prompts(3, 120, 270, seed=1, vocab_hi=127)
    params = [SamplingParams(temperature=0.9, max_tokens=4, ignore_eos=True, seed=i) for i in range(3)]
    with torch.no_grad(), K.use_backend("triton"):
        eng = Engine(m, num_gpu_blocks=64, max_num_seqs=2, max_num_batched_tokens=97, block_size=32)
        eng.model_runner.simulate_buckets = True
        outs = eng.generate(prompts, params, use_tqdm=False)
        assert eng.model_runner.num_simulated_steps > 0
        assert assert_bitmatch(m, outs, params) == 12


def test_decode_calls_run_their_own_row_tile(monkeypatch):
    """A call of one token per sequence runs 16-row tiles (bf16), a prefill 64-row ones; the
    decode rows still carry the prefill's bits (the splits above, here with the configs seen)."""
    assert mamba_ssd.config_for(BF, 64, 128, 128, decode=True)["BM"] == 16
    assert mamba_ssd.config_for(BF, 64, 128, 128)["BM"] == 64
    assert mamba_ssd.config_for(F32, 64, 128, 128, decode=True) == mamba_ssd.config_for(F32, 64, 128, 128)
    # a prefill of few (sequence, head) programs splits P over two programs (bits: the BP test above)
    assert mamba_ssd.config_for(BF, 64, 128, 128, programs=128, sms=132)["BP"] == 32
    assert mamba_ssd.config_for(BF, 64, 128, 128, programs=8192, sms=132)["BP"] == 64
    assert mamba_ssd.config_for(BF, 64, 128, 128, decode=True, programs=128, sms=132)["BP"] == 64
    # decode calls load their C and first K block with the state (PRELOAD), a prefill does not
    assert mamba_ssd.config_for(BF, 64, 128, 128, decode=True)["PRELOAD"]
    assert not mamba_ssd.config_for(BF, 64, 128, 128)["PRELOAD"]
    # and a decode launch that small runs 8 warps, a large one 4
    assert mamba_ssd.config_for(BF, 64, 128, 128, decode=True, programs=128, sms=132)["num_warps"] == 8
    assert mamba_ssd.config_for(BF, 64, 128, 128, decode=True, programs=8192, sms=132)["num_warps"] == 4
    # and loads its own rows with the state (XEARLY), a large one and a prefill do not
    assert mamba_ssd.config_for(BF, 64, 128, 128, decode=True, programs=128, sms=132)["XEARLY"]
    assert not mamba_ssd.config_for(BF, 64, 128, 128, decode=True, programs=8192, sms=132)["XEARLY"]
    assert not mamba_ssd.config_for(BF, 64, 128, 128, programs=128, sms=132)["XEARLY"]
    seen = []
    base = mamba_ssd.config_for
    monkeypatch.setattr(mamba_ssd, "config_for", lambda *a, **k: seen.append(k.get("decode")) or base(*a, **k))
    seq = _seq(70, seed=5)   # chunk 64: the prefill's tile is 64 rows, the decode calls' 16
    with K.use_backend("triton"):
        full = _scan([seq], q=64)
        got, _ = _in_calls(seq, [60, 1, 1, 1, 1, 6], BF, q=64)
    assert_bitwise_equal(got, full, "prefill, one-token calls across the chunk boundary, prefill")
    assert seen.count(True) == 4 and seen.count(False) == 3, seen
    # control: a decode config that changes the K blocks (the order) is caught by the same check
    monkeypatch.setattr(mamba_ssd, "config_for",
                        lambda *a, **k: {**base(*a, **k), **({"BK": 16} if k.get("decode") else {})})
    with K.use_backend("triton"):
        bad, _ = _in_calls(seq, [60, 1, 1, 1, 1, 6], BF, q=64)
    assert not torch.equal(bad, full)
    # PRELOAD is the same operations in the same order: on every call (prefill row tiles after the
    # first, their K blocks after the first) it keeps the bits
    monkeypatch.setattr(mamba_ssd, "config_for", lambda *a, **k: {**base(*a, **k), "PRELOAD": True})
    with K.use_backend("triton"):
        assert_bitwise_equal(_scan([seq], q=64), full, "prefill with PRELOAD")
        pre, _ = _in_calls(seq, [60, 1, 1, 1, 1, 6], BF, q=64)
    assert_bitwise_equal(pre, full, "calls with PRELOAD")
    # XEARLY (the token's own rows loaded with the state) keeps them too, on every call
    monkeypatch.setattr(mamba_ssd, "config_for", lambda *a, **k: {**base(*a, **k), "PRELOAD": True, "XEARLY": True})
    with K.use_backend("triton"):
        assert_bitwise_equal(_scan([seq], q=64), full, "prefill with XEARLY")
        got, _ = _in_calls(seq, [60, 1, 1, 1, 1, 6], BF, q=64)
    assert_bitwise_equal(got, full, "calls with XEARLY")
    # control: XEARLY with a K block of 16 in the decode calls (another order) is caught
    monkeypatch.setattr(mamba_ssd, "config_for",
                        lambda *a, **k: {**base(*a, **k), **({"BK": 16, "XEARLY": True} if k.get("decode") else {})})
    with K.use_backend("triton"):
        bad, _ = _in_calls(seq, [60, 1, 1, 1, 1, 6], BF, q=64)
    assert not torch.equal(bad, full)


class _LaunchSpy:
    """Stands in for a Triton kernel: records each launch's grid, then runs it (or not)."""

    def __init__(self, kernel, run=True):
        self.kernel, self.run, self.grids = kernel, run, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid] if self.run else (lambda *a, **k: None)


def test_one_token_calls_with_host_bounds_need_no_stash_launch(monkeypatch):
    """One-token calls given their layout on the host (the engine's decode steps) write their open
    chunk's B and dt rows from the scan itself and skip the stash launch: three sequences in shuffled
    slots, prefilled to 5, 17 (closing a chunk, one open row) and 16 tokens (closing it exactly), then
    decoded together, get their full prefills' bits with no stash launch. Control: without the stash
    launch, a call that closes a chunk and leaves open rows loses them (the bits differ), which is
    why only one-token calls skip it."""
    spy = _LaunchSpy(mamba_ssd._stash_kernel)
    monkeypatch.setattr(mamba_ssd, "_stash_kernel", spy)
    seqs = [_seq(n, seed=20 + n) for n in (21, 35, 18)]
    starts, slots = [5, 17, 16], [3, 0, 1]
    with K.use_backend("triton"):
        alone = [_scan([s]) for s in seqs]
        cache = _cache(BF, slots=4)
        outs = [[_scan([tuple(t[:k] for t in s)], [0], cache, [sl])] for s, k, sl in zip(seqs, starts, slots)]
        spy.grids.clear()
        at = list(starts)
        while any(at[i] < seqs[i][0].shape[0] for i in range(3)):
            live = [i for i in (2, 0, 1) if at[i] < seqs[i][0].shape[0]]
            y = _scan([tuple(t[at[i]:at[i] + 1] for t in seqs[i]) for i in live], [at[i] for i in live], cache,
                      [slots[i] for i in live], host=True)
            for j, i in enumerate(live):
                outs[i].append(y[j:j + 1])
                at[i] += 1
        assert spy.grids == []
        for i in range(3):
            assert_bitwise_equal(torch.cat(outs[i]), alone[i], f"sequence {i}")
        # control
        monkeypatch.setattr(mamba_ssd, "_stash_kernel", _LaunchSpy(spy.kernel, run=False))
        got, _ = _in_calls(seqs[1], [5, 13, 3, 14], BF)
    assert not torch.equal(got, alone[1])

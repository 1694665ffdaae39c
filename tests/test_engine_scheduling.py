"""Schedule invariance of the engine: preemption, prefix caching, mixed steps, block bookkeeping."""
from __future__ import annotations

import pytest

from bitmatch.engine import Engine, SamplingParams
from bitmatch.engine.block_manager import BlockManager, compute_block_hash
from bitmatch.engine.sequence import Sequence
from bitmatch.testing import same_outputs
from bitmatch.testing.models import random_prompts, tiny_model
from test_engine import assert_bitmatch


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3-hd64-gqa4-tied", seed=2, num_hidden_layers=1)


def record_steps(engine):
    """Wrap the scheduler to record each step's [(seq_id, num_new_tokens, num_computed)]."""
    steps, schedule = [], engine.scheduler.schedule

    def wrapped():
        out = schedule()
        steps.append([(s.seq_id, n, s.num_computed_tokens) for s, n in out])
        return out
    engine.scheduler.schedule = wrapped
    return steps


def test_preemption_same_bits(model):
    prompts = random_prompts(6, 5, 20, seed=11)
    params = [SamplingParams(temperature=1.0 if i % 2 else 0.6, max_tokens=10, ignore_eos=True, seed=i)
              for i in range(6)]
    ref = Engine(model, num_gpu_blocks=512, block_size=8).generate(prompts, params, use_tqdm=False)
    # 5 blocks of 8 = 40 token slots for 6 requests that each grow to 14-29 tokens
    tight = Engine(model, num_gpu_blocks=5, block_size=8, max_num_batched_tokens=16)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.scheduler.num_preemptions > 0
    assert any(o.num_preemptions > 0 for o in outs)
    assert same_outputs(ref, outs)
    assert_bitmatch(model, outs, params)


def test_request_too_big_for_cache_raises(model):
    eng = Engine(model, num_gpu_blocks=2, block_size=16)
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        eng.generate([[5] * 30], SamplingParams(max_tokens=8), use_tqdm=False)
    eng = Engine(model, num_gpu_blocks=64, max_num_batched_tokens=16, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        eng.generate([[5] * 30], SamplingParams(max_tokens=2), use_tqdm=False)
    # the engine is still usable after the error
    assert len(eng.generate([[5] * 3], SamplingParams(max_tokens=2), use_tqdm=False)) == 1


def test_prefix_caching_same_bits_and_shared_blocks_never_written(model):
    system = random_prompts(1, 40, 40, seed=3)[0]
    prompts = [system + p for p in random_prompts(6, 1, 10, seed=4)] + [system[:17], system[:33]]
    prompts += prompts[:3]  # exact duplicates
    params = [SamplingParams(temperature=0.6, top_p=0.9 if i % 3 == 0 else 1.0, max_tokens=3, ignore_eos=True,
                             seed=i) for i in range(len(prompts))]
    ref = Engine(model, num_gpu_blocks=512, max_num_seqs=4).generate(prompts, params, use_tqdm=False)
    eng = Engine(model, num_gpu_blocks=512, max_num_seqs=4, enable_prefix_caching=True)
    bm = eng.block_manager

    class SharedBlockWrites:   # an engine recorder: sees every step's context, on whatever path it runs
        def step(self, view):
            real = [s for s, k in zip(view.ctx.slot_mapping.tolist(), view.rows) if k is not None]
            for block in {s // bm.block_size for s in real}:
                assert bm.blocks[block].ref_count == 1, f"step {view.index} writes into shared block {block}"

        def record(self, name, value, rows):
            pass
    with eng.record(SharedBlockWrites()):
        outs = eng.generate(prompts, params, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in outs) >= 32 * 5
    assert same_outputs(ref, outs)
    assert_bitmatch(model, outs, params)
    # again: the cache is reset at each generate (weights may have changed), still same bits
    assert same_outputs(ref, eng.generate(prompts, params, use_tqdm=False))


def test_steps_mix_decode_and_prefill_chunks(model):
    prompts = random_prompts(4, 20, 40, seed=8)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=1)
    eng = Engine(model, num_gpu_blocks=256, max_num_batched_tokens=24, max_num_seqs=3)
    steps = record_steps(eng)
    outs = eng.generate(prompts, params, use_tqdm=False)
    assert all(sum(n for _, n, _ in s) <= 24 for s in steps)
    assert all(len(s) <= 3 for s in steps)
    mixed = [s for s in steps if any(n == 1 for _, n, _ in s) and any(n > 1 for _, n, _ in s)]
    chunked = [s for s in steps if any(n > 1 and c > 0 for _, n, c in s)]  # a prefill continuing
    assert mixed and chunked
    assert_bitmatch(model, outs, [params] * len(prompts))
    # one request at a time, whole prompts: same bits
    one = Engine(model, num_gpu_blocks=256, max_num_seqs=1, enable_chunked_prefill=False)
    assert same_outputs(outs, one.generate(prompts, params, use_tqdm=False))


def test_block_manager_allocate_free_and_hash_chain():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    sp = SamplingParams()
    a = Sequence(0, list(range(10)), sp, None, 4)
    assert bm.get_computed_blocks(a) == []
    bm.allocate_prefix(a, [])
    bm.append_slots(a, 10)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 3
    a.num_computed_tokens = 10
    bm.mark_computed(a)  # two full blocks registered, the partial third not
    assert len(bm.hash_to_block_id) == 2
    b = Sequence(1, list(range(8)) + [99, 98, 97], sp, None, 4)
    hits = bm.get_computed_blocks(b)
    assert hits == a.block_table[:2]
    assert bm.num_free_blocks_taken_by(hits) == 0
    bm.allocate_prefix(b, hits)
    assert b.num_computed_tokens == 8 and bm.blocks[hits[0]].ref_count == 2
    # a prompt exactly 2 blocks long hits only the first: one token must be computed
    c = Sequence(2, list(range(8)), sp, None, 4)
    assert bm.get_computed_blocks(c) == a.block_table[:1]
    # the hash depends on the parent: same tokens after another prefix do not hit
    assert compute_block_hash([4, 5, 6, 7]) != compute_block_hash([4, 5, 6, 7], compute_block_hash([0, 1, 2, 3]))
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 6
    # freed blocks keep their hash until reused: a later request still hits them
    assert bm.get_computed_blocks(Sequence(3, list(range(9)), sp, None, 4)) == hits
    bm.reset_prefix_cache()
    assert bm.get_computed_blocks(Sequence(4, list(range(9)), sp, None, 4)) == []

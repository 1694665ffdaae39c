"""The engine's cache-group kinds: per-token "paged" state and per-sequence "per_seq" state.

A probe family (the dense family plus two bookkeeping caches) checks inside every engine step
what a recurrent family (Mamba, compressed attention) relies on: each scheduled sequence has its
own slot, the slot holds exactly the state of the tokens computed so far (zeroed when a
sequence starts or restarts after preemption, kept across chunks and decode steps), and the
paged state of every earlier token is readable through the block table. The control disables
the zeroing and the same probe fails.
"""
from __future__ import annotations

import pytest
import torch

from bitmatch.engine import Engine, SamplingParams
from bitmatch.models import registry
from bitmatch.models.dense import DenseFamily
from bitmatch.testing.models import random_prompts, tiny_model


class ProbeFamily(DenseFamily):
    """Dense forward; before it, checks and advances the per_seq token count and the paged positions."""

    def cache_groups(self, spec, dtype):
        return super().cache_groups(spec, dtype) + [
            registry.CacheGroup("count", "per_seq", (0,), tensors=(((1,), torch.int64),)),
            registry.CacheGroup("pos", "paged", (0,), tensors=(((2,), torch.int64),)),
        ]

    def forward_hidden(self, lm, spec, input_ids, ctx, dtype, recorder=None):
        if ctx.paged:
            (count,), (pos,) = ctx.cache("count", 0), ctx.cache("pos", 0)
            slots = ctx.state_slots.tolist()
            assert len(set(slots)) == len(slots) and min(slots) >= 0, f"slots not distinct: {slots}"
            qsl, lens = ctx.query_start_loc.tolist(), ctx.seq_lens.tolist()
            flat = pos.view(-1, 2)
            flat[ctx.slot_mapping] = torch.stack([ctx.positions, input_ids], 1)
            for b, slot in enumerate(slots):
                n = qsl[b + 1] - qsl[b]
                assert int(count[slot]) == lens[b] - n, \
                    f"slot {slot}: state of {int(count[slot])} tokens, sequence computed {lens[b] - n}"
                count[slot] += n
                p = torch.arange(lens[b])
                row = ctx.block_table[b].long()
                got = flat[row[p // pos.shape[1]] * pos.shape[1] + p % pos.shape[1]]
                assert torch.equal(got[:, 0], p), "paged state of an earlier token not found"
        return super().forward_hidden(lm, spec, input_ids, ctx, dtype, recorder)


@pytest.fixture
def probe_family():
    orig = registry.family_for_architecture("Qwen3ForCausalLM")
    probe = ProbeFamily()
    registry.register(probe)
    try:
        yield probe
    finally:
        registry.register(orig)


def _run(model, num_gpu_blocks=None, **kw):
    eng = Engine(model, block_size=4, num_gpu_blocks=num_gpu_blocks, max_num_seqs=5,
                 max_num_batched_tokens=24, **kw)
    prompts = random_prompts(9, 1, 30, seed=3)
    outs = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True), use_tqdm=False)
    return eng, outs


def test_per_seq_and_paged_state_across_chunks_decode_preemption(probe_family):
    model = tiny_model("qwen3")
    eng, outs = _run(model, num_gpu_blocks=24)  # tight: forces preemption (recompute from token 0)
    assert eng.scheduler.num_preemptions > 0
    # a second generate reuses the freed slots: they must come back zeroed
    _, outs2 = _run(model, num_gpu_blocks=24)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in outs2]
    assert sorted(eng.block_manager.free_state_slots) == list(range(5))
    # the extra caches do not change the model's bits: same tokens/logprobs as without preemption
    _, big = _run(model, num_gpu_blocks=200)
    assert [o.outputs[0].logprobs for o in outs] == [o.outputs[0].logprobs for o in big]


def test_control_without_zeroing_the_probe_fails(probe_family, monkeypatch):
    from bitmatch.engine.model_runner import ModelRunner
    model = tiny_model("qwen3")
    eng, _ = _run(model, num_gpu_blocks=200)
    monkeypatch.setattr(ModelRunner, "reset_state_slots", lambda self, slots: None)
    with pytest.raises(AssertionError, match="state of"):
        eng.generate(random_prompts(3, 2, 9, seed=1), SamplingParams(max_tokens=3), use_tqdm=False)


def test_prefix_caching_refused_with_per_seq_state(probe_family):
    with pytest.raises(ValueError, match="enable_prefix_caching.*count"):
        Engine(tiny_model("qwen3"), num_gpu_blocks=16, enable_prefix_caching=True)


def test_budget_reserves_per_seq_state_and_bad_groups():
    g = registry.CacheGroup("s", "per_seq", (0, 1), tensors=(((3, 4), torch.float32), ((2,), torch.bfloat16)))
    assert g.bytes_per_seq() == 2 * (48 + 4) and g.bytes_per_block(16) == 0
    p = registry.CacheGroup("p", "paged", (0,), tensors=(((5,), torch.float32),))
    assert p.bytes_per_block(16) == 16 * 20 and p.bytes_per_seq() == 0
    kv = registry.CacheGroup("kv", "paged_kv", (0, 1, 2), 2, 8, torch.bfloat16)
    assert kv.bytes_per_block(4) == 3 * 2 * 4 * 2 * 8 * 2
    with pytest.raises(NotImplementedError, match="kind 'ring'"):
        registry.CacheGroup("x", "ring", (0,))
    with pytest.raises(ValueError, match="needs tensors"):
        registry.CacheGroup("x", "paged", (0,))
    with pytest.raises(ValueError, match="num_seqs"):
        registry.allocate_caches([g], 4, 16, "cpu")
    c = registry.allocate_caches([g, p, kv], 4, 16, "cpu", num_seqs=3)
    assert c["s"][1][0].shape == (3, 3, 4) and c["p"][0][0].shape == (4, 16, 5)
    assert c["kv"][2][1].shape == (4, 16, 2, 8)

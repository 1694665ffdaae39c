"""Fused q/k/v and gate/up projections: ``kernels.linear(segments=)`` gives each segment exactly
the bits of the separate linear, on the CPU reference and on the Triton kernel (interpreter), also
when segments have different canonical K splits (a split table forced for the test); the dense
family's fused copies follow in-place weight updates. Control: fusing without the per-segment split
(the whole weight under one split) changes the bits of the segment whose split differs."""
from __future__ import annotations

import pytest
import torch

import bitmatch.kernels as K
from bitmatch.kernels import order
from bitmatch.testing import bits_equal


def _weights(sizes, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, k, generator=g).to(dtype) for n in sizes]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_fused_equals_separate(dtype):
    ws = _weights((64, 16, 16), 96, dtype)
    bs = [torch.randn(w.shape[0]).to(dtype) for w in ws]
    for m in (1, 5, 33):
        x = torch.randn(m, 96).to(dtype)
        fused = K.linear(x, torch.cat(ws), torch.cat(bs), segments=(64, 16, 16))
        sep = torch.cat([K.linear(x, w, b) for w, b in zip(ws, bs)], -1)
        assert bits_equal(fused, sep)


def test_segments_validated():
    with pytest.raises(ValueError, match="segments"):
        K.linear(torch.randn(2, 8), torch.randn(10, 8), segments=(4, 4))


triton_only = pytest.mark.interpreter


@triton_only
@pytest.mark.parametrize("m", [1, 20, 70])
def test_triton_fused_equals_separate_mixed_splits(m):
    from bitmatch.kernels.triton import linear as TL
    # q-like segment with a 2-chunk K split, k/v-like segments plain: two launches, same bits
    with order.override(linear_split_table=(((64, 512), 2),)):
        ws = _weights((64, 32, 32), 512, torch.float32, seed=1)
        x = torch.randn(m, 512)
        with K.use_backend("triton"):
            fused = K.linear(x, torch.cat(ws), segments=(64, 32, 32))
            sep = torch.cat([K.linear(x, w) for w in ws], -1)
            assert bits_equal(fused, sep)
            # control: the whole fused weight under the k/v split (what a plain fused GEMM does)
            plain = K.linear(x, torch.cat(ws))
        assert TL.split_for(128, 512) == 1 and TL.split_for(64, 512) == 2
        assert not bits_equal(plain[:, :64], sep[:, :64])


@triton_only
def test_triton_fused_gate_up_equal_split():
    ws = _weights((48, 48), 256, torch.float32, seed=2)
    x = torch.randn(9, 256)
    with K.use_backend("triton"):
        assert bits_equal(K.linear(x, torch.cat(ws), segments=(48, 48)),
                           torch.cat([K.linear(x, w) for w in ws], -1))


def test_dense_fused_copy_follows_in_place_updates():
    """The engine's paged steps use the fused copies (same bits as the trainer's separate
    projections); an in-place update is followed; the trainer path never fuses."""
    from bitmatch.context import ForwardContext
    from bitmatch.models import allocate_caches, cache_groups, dense, forward_hidden
    from bitmatch.testing.models import tiny_model
    model = tiny_model()
    ids = torch.tensor([3, 5, 7, 9, 11])
    packed = ForwardContext(positions=torch.arange(5), cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))

    def paged():
        return ForwardContext(positions=torch.arange(5), query_start_loc=torch.tensor([0, 5], dtype=torch.int32),
                              seq_lens=torch.tensor([5], dtype=torch.int32),
                              block_table=torch.zeros((1, 1), dtype=torch.int32), slot_mapping=torch.arange(5),
                              caches=allocate_caches(cache_groups(model), 1, 16, "cpu"))
    with torch.no_grad():
        sep = forward_hidden(model, ids, packed)
        assert not dense.fused_copies(model.model.layers[0].self_attn), "the trainer path fused"
        fused = forward_hidden(model, ids, paged())
        assert dense.fused_copies(model.model.layers[0].self_attn), "the engine path did not fuse"
    assert bits_equal(fused, sep)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)  # in place: _version bumps
        model.model.layers[0].mlp.up_proj.weight.mul_(0.5)
        after = forward_hidden(model, ids, paged())
        sep2 = forward_hidden(model, ids, packed)
    assert bits_equal(after, sep2) and not bits_equal(after, fused)


def _engine_vs_trainer(eng, model, prompts):
    import bitmatch
    from bitmatch.engine import SamplingParams
    from bitmatch.testing.models import pad_batch
    outs = eng.generate(prompts, SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True), use_tqdm=False)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    ids, mask = pad_batch(seqs)
    with torch.no_grad():  # the trainer path never reads the fused copies
        lp = bitmatch.token_logprobs(model, ids, mask, temperature=1.0)
    bad = 0
    for b, o in enumerate(outs):
        p, c = len(o.prompt_token_ids), len(o.outputs[0].token_ids)
        bad += int((lp[b, p - 1:p + c - 1].float() != torch.tensor(o.outputs[0].logprobs)).sum())
    return bad


def test_engine_sees_a_weight_write_through_data_between_generates(monkeypatch):
    """A write through ``param.data`` bumps no version counter; the engine rebuilds its fused
    copies whenever it starts work after being idle, so the next generate() is Diff = 0 on the new
    weights. Control: without that rebuild the fused copy is stale and the engine differs."""
    from bitmatch.engine import Engine
    from bitmatch.models import dense
    from bitmatch.testing.models import random_prompts, tiny_model
    model = tiny_model("qwen3")
    eng = Engine(model, num_gpu_blocks=64)
    prompts = random_prompts(3, 3, 12, seed=5)
    assert _engine_vs_trainer(eng, model, prompts) == 0
    assert dense.fused_copies(model.model.layers[0].self_attn), "the engine did not fuse (the test would prove nothing)"

    def write(seed):
        g = torch.Generator().manual_seed(seed)
        for layer in model.model.layers:
            for m in (layer.self_attn.q_proj, layer.mlp.up_proj):
                m.weight.data.copy_(torch.randn(m.weight.shape, generator=g).to(m.weight.dtype) * 0.2)

    write(1)
    assert _engine_vs_trainer(eng, model, prompts) == 0
    monkeypatch.setattr(dense, "refresh_fused", lambda lm, force=False: None)
    write(2)
    assert _engine_vs_trainer(eng, model, prompts) > 0

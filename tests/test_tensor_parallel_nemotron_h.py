"""Gather-only tensor (and expert) parallelism for Nemotron-H on CPU: TP = 2 and 4 equal TP = 1 bit for bit.

Each world size runs once in that many gloo processes (fork, a file rendezvous), on tiny models with
every block kind (Mamba2, MoE, attention, MLP, Mamba2) whose Mamba heads (8), groups (4), attention
heads (4), experts (8) and widths divide 4; the 2 KV heads are sharded at TP = 2 and replicated at
TP = 4. Every rank computes the trainer's logprobs of a left- and a right-padded batch (prompts
across the chunk boundaries), the hidden states, the controls (the stock all-reduce out_proj in the
Mamba layers; the whole stock layout), the rank's cache sizes, the embedded engine's tokens and
logprobs (chunked prefill) and a trainer step's gradients; at TP = 2 also the trainer's logprobs and
the engine on Triton (interpreter). The ranks save their results; this process computes TP = 1 and
compares every rank's bits.
"""
from __future__ import annotations

import pytest
import torch

import bitmatch
import bitmatch.kernels as K
from bitmatch import Engine, SamplingParams
from bitmatch.models import cache_groups as model_cache_groups, family_of, forward_hidden as tp1_forward_hidden
from bitmatch.models.nemotron_h_tp import MambaShare
from bitmatch.models.registry import tp_shard
from bitmatch.parallel import (
    TPGroup,
    disable_tensor_parallel,
    enable_tensor_parallel,
    reduce_tp_gradients,
    shard_model,
    token_logprobs,
)
from bitmatch.parallel.tensor_parallel import AllreduceRowShard
from bitmatch.testing import assert_bitwise_equal
from bitmatch.testing.models import pad_batch, random_prompts, tiny_model
from tp_ranks import FakeTP, packed_ctx, ranks_fixture

# head_dim 16 and chunk 16: the Triton scan's smallest tile; 8 Mamba heads in 4 groups
DIVISIBLE = dict(mamba_num_heads=8, mamba_head_dim=16, n_groups=4)
MODELS = {
    "chunk8": dict(DIVISIBLE, chunk_size=8),
    # the MoE's latent projections (fc1 / fc2, replicated) and chunk 16 (Triton's)
    "latent": dict(DIVISIBLE, chunk_size=16, moe_latent_size=32),
}
ENGINE_PROMPTS = [[1, 5, 9, 33, 40, 41, 42, 43, 44], [1, 7, 7], [1] + list(range(60, 77))]


def _model(name):
    return tiny_model("nemotron_h", **MODELS[name])


def _batches():
    """A left- and a right-padded batch, lengths around the chunk boundaries (8, 16)."""
    prompts = random_prompts(4, 7, 18, seed=3) + [list(range(3, 20))]
    return {side: pad_batch(prompts, side) for side in ("left", "right")}


def _engine_run(lm, prompts=ENGINE_PROMPTS, max_tokens=6, budget=5):
    """The embedded engine's sampled tokens and logprobs: each prompt x ``max_tokens`` seeded tokens,
    steps of ``budget`` tokens (chunked prefill splitting the chunks)."""
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=21 + i)
              for i in range(len(prompts))]
    eng = Engine(lm, block_size=4, num_gpu_blocks=64, max_num_seqs=3, max_num_batched_tokens=budget)
    outs = eng.generate(prompts, params, use_tqdm=False)
    return [(torch.tensor(o.outputs[0].token_ids), torch.tensor(o.outputs[0].logprobs)) for o in outs]


def _worker(tp):
    world = tp.world
    res = {}
    ids0 = _batches()["right"][0][4]
    with torch.no_grad():
        for name in MODELS:
            shard = shard_model(_model(name), tp)
            for side, (ids, mask) in _batches().items():
                res[f"{name}/{side}/logprobs"] = token_logprobs(shard, ids, mask)
            res[f"{name}/hidden"] = shard.forward_hidden(ids0, packed_ctx(ids0))
            res.update(_controls(name, tp, ids0))
        lm = _model("chunk8")
        enable_tensor_parallel(lm, tp)
        res["caches"] = [(g.name, g.num_kv_heads, [shape for shape, _ in g.tensors or ()])
                         for g in model_cache_groups(lm)]
        res["graph_safe"] = family_of(lm).cuda_graph_safe(lm)
        res["engine"] = _engine_run(lm)
        if world == 2:
            res.update(_triton_case(tp))
    res.update(_trainer_grads(tp))
    return res


def _controls(name, tp, ids0):
    """The stock all-reduce row-parallel layer (bf16 partials summed by ``dist.all_reduce``): in the
    Mamba layers' out_proj only, and as the whole stock layout (``row_parallel="allreduce"``)."""
    out = {}
    shard = shard_model(_model(name), tp)
    for mixer in shard.layers:
        if isinstance(mixer, MambaShare):
            k = mixer.inner.stop - mixer.inner.start  # the rank's K columns of out_proj
            mixer.out = AllreduceRowShard(mixer.out.module, tp.rank * k, (tp.rank + 1) * k, shard.dtype, tp)
    out[f"{name}/control/hidden"] = shard.forward_hidden(ids0, packed_ctx(ids0))
    out[f"{name}/control/logprobs"] = token_logprobs(shard, *_batches()["right"])
    stock = shard_model(_model(name), tp, row_parallel="allreduce")
    out[f"{name}/control/stock_hidden"] = stock.forward_hidden(ids0, packed_ctx(ids0))
    return out


def _trainer_grads(tp):
    """A TP trainer step on the fp32 model: the logprobs (autograd on) and the gradients of their sum,
    the ranks' parts summed by ``reduce_tp_gradients``."""
    lm = _model("latent").float()
    enable_tensor_parallel(lm, tp)
    lp = bitmatch.token_logprobs(lm, *_batches()["right"])
    lp.sum().backward()
    reduce_tp_gradients(lm)
    return {"grad/logprobs": lp.detach(), "grad/params": {n: p.grad for n, p in lm.named_parameters()}}


# the Triton engine case (8-token steps): 2 prompts, the second's prefill split inside chunk 0 and
# its decode across the chunk boundary (16)
TRITON_PROMPTS = [[1, 5, 9, 33, 40], [1] + list(range(60, 74))]
TRITON_ENGINE = dict(prompts=TRITON_PROMPTS, max_tokens=3, budget=8)


def _triton_case(tp):
    """On the Triton backend (interpreter), chunk 16: the trainer's logprobs (right padding), and the
    engine's tokens and logprobs (the conv / scan state in the rank's cache slots)."""
    ids, mask = _batches()["right"]
    lm = _model("latent")
    with K.use_backend("triton"):
        out = {"triton/logprobs": token_logprobs(shard_model(lm, tp), ids[:2], mask[:2])}
        enable_tensor_parallel(lm, tp)
        out["triton/engine"] = _engine_run(lm, **TRITON_ENGINE)
    return out


ranks = ranks_fixture(_worker, "nh_tp")  # (world, [each rank's results]) at TP 2 and 4


def test_trainer_logprobs_equal_tp1(ranks):
    world, res = ranks
    for name in MODELS:
        lm = _model(name)
        for side, (ids, mask) in _batches().items():
            want = bitmatch.token_logprobs(lm, ids, mask)
            for r, got in enumerate(res):
                assert_bitwise_equal(got[f"{name}/{side}/logprobs"], want, f"{name} {side} rank {r}/{world} logprobs")


def test_hidden_states_equal_tp1_and_allreduce_out_proj_differs(ranks):
    """The final hidden states are TP = 1's; the controls, the stock all-reduce out_proj in the Mamba
    layers (bf16 partials rounded, then summed) and the whole stock layout, change them, so the
    comparison can fail."""
    world, res = ranks
    ids = _batches()["right"][0][4]
    for name in MODELS:
        lm = _model(name)
        with torch.no_grad():
            want = tp1_forward_hidden(lm, ids, packed_ctx(ids))
            want_lp = bitmatch.token_logprobs(lm, *_batches()["right"])
        for r, got in enumerate(res):
            assert_bitwise_equal(got[f"{name}/hidden"], want, f"{name} rank {r}/{world} hidden")
            assert not torch.equal(got[f"{name}/control/hidden"], want), \
                f"control: the all-reduce out_proj should change {name}'s hidden states at TP = {world}"
            assert not torch.equal(got[f"{name}/control/stock_hidden"], want), \
                f"control: the stock layout should change {name}'s hidden states at TP = {world}"
        assert any(not torch.equal(got[f"{name}/control/logprobs"], want_lp) for got in res), \
            f"control: the all-reduce out_proj should change some logprob of {name} at TP = {world}"


def test_tp_trainer_gradients_match_tp1(ranks):
    """Autograd through the sharded forward: bitwise logprobs; after ``reduce_tp_gradients`` every rank
    holds the same whole-model gradient, TP = 1's within fp32 rounding (backward passes need correct
    gradients, not invariant ones). A parameter missing from the shard's ``partial_parameters`` would
    keep a part; a replicated one listed there would be counted ``world`` times."""
    world, res = ranks
    lm = _model("latent").float()
    lp = bitmatch.token_logprobs(lm, *_batches()["right"])
    lp.sum().backward()
    for r, got in enumerate(res):
        assert_bitwise_equal(got["grad/logprobs"], lp.detach(), f"rank {r}/{world} fp32 trainer logprobs")
    checked = 0
    for n, p in lm.named_parameters():
        if p.grad is None:
            continue
        g = res[0]["grad/params"][n]
        for r, got in enumerate(res[1:], 1):
            assert torch.equal(got["grad/params"][n], g), f"{n}: rank {r} differs from rank 0"
        atol = 1e-4 * p.grad.abs().max().item()  # fp32 sums in another order: relative to the scale
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=atol, msg=lambda m, n=n: f"{n}: {m}")
        checked += 1
    assert checked > 30


def test_rank_caches_hold_the_ranks_heads_and_groups(ranks):
    """While a shard is set the family's caches are the rank's: KV heads (2 sharded at TP = 2, one
    replicated at TP = 4), the Mamba conv channels, heads and groups; no CUDA graphs."""
    world, res = ranks
    lm = _model("chunk8")
    full = {g.name: g for g in model_cache_groups(lm)}
    c = lm.config
    hl, gl = c.mamba_num_heads // world, c.n_groups // world
    conv = hl * c.mamba_head_dim + 2 * gl * c.ssm_state_size
    Q, P, N = c.chunk_size, c.mamba_head_dim, c.ssm_state_size
    mamba = [(c.conv_kernel - 1, conv), (hl, P, N), (Q, hl, P), (Q, gl, N), (Q, hl)]
    want = [("kv", max(c.num_key_value_heads // world, 1), []), ("mamba", full["mamba"].num_kv_heads, mamba)]
    for r, got in enumerate(res):
        assert [(n, h, [tuple(s) for s in shapes]) for n, h, shapes in got["caches"]] == want, f"rank {r}"
        assert got["graph_safe"] is False


def test_engine_equals_engine_tp1_and_trainer(ranks):
    """The embedded engine, one process per rank (enable_tensor_parallel), chunked prefill in 5-token
    steps, each rank sampling from the same gathered logits with the same seeds: the TP = 1 engine's
    tokens and logprobs, which are the TP = 1 trainer's logprobs of those tokens."""
    world, res = ranks
    lm = _model("chunk8")
    want = _engine_run(lm)
    for r, got in enumerate(res):
        for i, ((tok, lp), (wtok, wlp)) in enumerate(zip(got["engine"], want)):
            assert_bitwise_equal(tok, wtok, f"rank {r}/{world} prompt {i} tokens")
            assert_bitwise_equal(lp, wlp, f"rank {r}/{world} prompt {i} logprobs")
    for i, (tok, lp) in enumerate(res[0]["engine"]):
        seq = torch.tensor(ENGINE_PROMPTS[i] + tok.tolist())[None]
        trainer = bitmatch.token_logprobs(lm, seq)[0, len(ENGINE_PROMPTS[i]) - 1:]
        assert_bitwise_equal(lp, trainer, f"prompt {i}: engine TP = {world} vs trainer TP = 1")


@pytest.mark.interpreter
def test_triton_interpreter_trainer_and_engine_equal_tp1(ranks):
    world, res = ranks
    if world != 2:
        pytest.skip("the Triton case runs at TP = 2")
    ids, mask = _batches()["right"]
    lm = _model("latent")
    with K.use_backend("triton"):
        want = bitmatch.token_logprobs(lm, ids[:2], mask[:2])
        want_engine = _engine_run(lm, **TRITON_ENGINE)
    for r, got in enumerate(res):
        assert_bitwise_equal(got["triton/logprobs"], want, f"triton rank {r} logprobs")
        for i, ((tok, lp), (wtok, wlp)) in enumerate(zip(got["triton/engine"], want_engine)):
            assert_bitwise_equal(tok, wtok, f"triton rank {r} prompt {i} tokens")
            assert_bitwise_equal(lp, wlp, f"triton rank {r} prompt {i} logprobs")


# ----------------------------------------------------------------------------- single process

def test_refuses_indivisible_sizes_by_config_field():
    lm = tiny_model("nemotron_h")  # 4 Mamba heads in 2 groups, 4 heads, 2 KV heads, 8 experts, hidden 64
    with pytest.raises(ValueError) as e:
        shard_model(lm, FakeTP(0, 3))
    for field in ("hidden_size = 64", "vocab_size = 128", "mamba_num_heads = 4", "n_groups = 2",
                  "num_attention_heads = 4", "n_routed_experts = 8", "num_key_value_heads = 2"):
        assert field in str(e.value), field
    assert "intermediate_size = 96" not in str(e.value)  # 96 = 3 x 32: not named
    # heads divide 4, groups do not: the gated norm's groups would straddle ranks
    with pytest.raises(ValueError, match="row_parallel must be 'gather' or 'allreduce'"):
        shard_model(lm, FakeTP(0, 2), row_parallel="reduce")
    with pytest.raises(ValueError, match=r"n_groups = 2 is not divisible by the TP degree 4 \(the gated RMSNorm"):
        enable_tensor_parallel(lm, FakeTP(1, 4))
    assert tp_shard(lm) is None, "a refused enable sets no shard"


def test_tp1_shard_is_the_model_and_disable_restores_graphs():
    """TP = 1 runs the same layout with no collective: the model's bits; enable/disable hand the
    family's forward, spec and CUDA-graph permission over and back."""
    lm = _model("chunk8")
    ids, mask = _batches()["left"]
    want = bitmatch.token_logprobs(lm, ids, mask)
    assert family_of(lm).cuda_graph_safe(lm)
    enable_tensor_parallel(lm, TPGroup(0, 1))
    try:
        assert not family_of(lm).cuda_graph_safe(lm)
        assert_bitwise_equal(bitmatch.token_logprobs(lm, ids, mask), want, "TP = 1 through the shard")
    finally:
        disable_tensor_parallel(lm)
    assert family_of(lm).cuda_graph_safe(lm)

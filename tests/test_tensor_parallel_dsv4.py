"""Gather-only tensor + expert parallelism for DeepSeek-V4 on CPU (gloo): TP = 2 and 4 equal TP = 1 bit for bit.

The tiny V4 (sliding, CSA with the Lightning Indexer, HCA, CSA; hash routing on layer 0, learned
routing after; mHC; YaRN) with 8 heads in 4 output groups and 8 routed experts, so heads, whole
groups and experts divide by 2 and 4. Each world size runs once in ``world`` forked gloo processes
(the harness of tests/test_tensor_parallel.py): every rank computes the trainer's logprobs on a
left- and right-padded batch, the final hidden states, the same logprobs with the stock all-reduce
o_b_proj (the control), a fp32 trainer step's gradients and the embedded engine (with the same
control), and under Triton's interpreter the logits of a short sequence on the Triton kernels; this
process computes TP = 1 with the unsharded model and compares every rank's bits.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch

import bitmatch
import bitmatch.kernels as K
from bitmatch import Engine, SamplingParams
from bitmatch.models import (
    cache_groups as model_cache_groups,
    compute_logits as tp1_compute_logits,
    family_of,
    forward_hidden as tp1_forward_hidden,
)
from bitmatch.parallel import (
    allreduce_row_parallel_linear,
    enable_tensor_parallel,
    reduce_tp_gradients,
    shard_model,
    token_logprobs,
)
from bitmatch.testing import assert_bitwise_equal, bits_equal
from bitmatch.testing.models import tiny_model
from tp_ranks import FakeTP, packed_ctx, padded_batch, ranks_fixture

# heads 8 x 16 in 4 output groups (2 heads each), 8 experts top-2: TP 2 holds 2 groups and 4 experts
# a rank, TP 4 one group and 2 experts
CONFIG = dict(num_attention_heads=8, head_dim=16, o_groups=4, n_routed_experts=8)
ENGINE_PROMPTS = [[1, 5, 9, 33, 40], [1, 7, 7], [1, 60, 61, 62, 63, 64, 65, 66, 67]]
MAX_TOKENS = 6  # 5 + 6 tokens: CSA (rate 2) and HCA (rate 4) windows close during decode


def _model(**kw):
    return tiny_model("deepseek_v4", seed=1, **{**CONFIG, **kw})


def _engine_run(lm):
    """The embedded engine's sampled tokens and logprobs (3 prompts x 6 seeded tokens, blocks of 4)."""
    params = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=11 + i) for i in range(3)]
    outs = Engine(lm, block_size=4, num_gpu_blocks=64).generate(ENGINE_PROMPTS, params, use_tqdm=False)
    return [(torch.tensor(o.outputs[0].token_ids), torch.tensor(o.outputs[0].logprobs)) for o in outs]


class _StockRow:
    """o_b_proj as stock TP runs it: this rank's K columns (its groups' outputs) times the weight's K
    slice, the bf16 partials summed by an all-reduce."""

    def __init__(self, mod, tp):
        self.mod, self.tp = mod, tp

    def __call__(self, y):
        k = y.shape[-1]
        w = self.mod.weight[:, self.tp.rank * k:(self.tp.rank + 1) * k].to(y.dtype)
        return allreduce_row_parallel_linear(y, w, None, self.tp)


def _trainer_grads(tp, ids, mask):
    """A TP trainer step (fp32, autograd on): the logprobs and the gradients of their sum, the ranks'
    parts summed by ``reduce_tp_gradients``."""
    lm = _model().float()
    enable_tensor_parallel(lm, tp)
    lp = bitmatch.token_logprobs(lm, ids, mask)
    lp.sum().backward()
    reduce_tp_gradients(lm)
    return {"grad/logprobs": lp.detach(), "grad/params": {n: p.grad for n, p in lm.named_parameters()}}


TRITON_IDS = torch.tensor([1, 5, 9, 33, 40, 41])


def _triton_logits(model_or_shard):
    """Logits of a 6-token sequence on the Triton backend (the interpreter on CPU): TP = 1 through
    ``bitmatch.models``, a rank through its shard."""
    with K.use_backend("triton"), torch.no_grad():
        if isinstance(model_or_shard, torch.nn.Module):
            return tp1_compute_logits(model_or_shard, tp1_forward_hidden(model_or_shard, TRITON_IDS,
                                                                         packed_ctx(TRITON_IDS)))
        return model_or_shard.compute_logits(model_or_shard.forward_hidden(TRITON_IDS, packed_ctx(TRITON_IDS)))


def _triton_case(tp):
    """The sharded forward on Triton: sink attention on the rank's heads, the grouped o_a on its groups,
    shard_linear for the column slices, the experts' grouped GEMM on the rank's experts."""
    return {"triton/logits": _triton_logits(shard_model(_model(), tp))}


def _worker(tp):
    res = {}
    ids, mask = padded_batch()
    with torch.no_grad():
        shard = shard_model(_model(), tp)
        res["logprobs"] = token_logprobs(shard, ids, mask)
        res["hidden"] = shard.forward_hidden(ids[0], packed_ctx(ids[0]))
        for a, _ in shard.layers:  # the control: stock row-parallel o_b_proj
            a.o_b = _StockRow(a.module.o_b_proj, tp)
        res["control/logprobs"] = token_logprobs(shard, ids, mask)
        res["heads"] = [tuple(a.heads().sinks.shape) for a, _ in shard.layers]
    res.update(_trainer_grads(tp, ids, mask))
    lm = _model()
    shard = enable_tensor_parallel(lm, tp)
    res["engine/graph_safe"] = family_of(lm).cuda_graph_safe(lm)
    res["engine/cache_shapes"] = [(g.name, g.layers, g.tensors) for g in model_cache_groups(lm)]
    res["engine/out"] = _engine_run(lm)
    for a, _ in shard.layers:  # the control through the engine: the stock o_b_proj
        a.o_b = _StockRow(a.module.o_b_proj, tp)
    res["engine/control"] = _engine_run(lm)
    if os.environ.get("TRITON_INTERPRET") == "1":
        res.update(_triton_case(tp))
    return res


ranks = ranks_fixture(_worker, "dsv4_tp")  # (world, [each rank's results]) at TP 2 and 4


@pytest.fixture(scope="module")
def tp1():
    """TP = 1: the unsharded model's trainer logprobs, hidden states and engine run."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the float64 reference is faster on one thread of this shared box; same bits
    lm = _model()
    ids, mask = padded_batch()
    with torch.no_grad():
        out = dict(logprobs=bitmatch.token_logprobs(lm, ids, mask),
                   hidden=tp1_forward_hidden(lm, ids[0], packed_ctx(ids[0])),
                   cache_shapes=[(g.name, g.layers, g.tensors) for g in model_cache_groups(lm)],
                   engine=_engine_run(lm), lm=lm)
    yield out
    torch.set_num_threads(n)


def test_trainer_logprobs_equal_tp1(ranks, tp1):
    world, res = ranks
    for r, got in enumerate(res):
        assert_bitwise_equal(got["logprobs"], tp1["logprobs"], f"rank {r}/{world} logprobs")


def test_hidden_states_equal_tp1(ranks, tp1):
    world, res = ranks
    for r, got in enumerate(res):
        assert_bitwise_equal(got["hidden"], tp1["hidden"], f"rank {r}/{world} hidden")


def test_control_allreduce_o_b_proj_differs(ranks, tp1):
    """The stock row-parallel o_b_proj (bf16 partials all-reduced) in place of the gather: other bits."""
    world, res = ranks
    for r, got in enumerate(res):
        assert not bits_equal(got["control/logprobs"], tp1["logprobs"]), f"control rank {r}/{world} should differ"


def test_engine_equals_engine_tp1_and_trainer(ranks, tp1):
    """The embedded engine, one process per rank (enable_tensor_parallel), replicated caches of TP = 1's
    shapes, each rank sampling from the same gathered logits: the TP = 1 engine's tokens and logprobs,
    which are the TP = 1 trainer's logprobs of those tokens. Control: the stock o_b_proj in the same
    engine gives other logprobs."""
    world, res = ranks
    for r, got in enumerate(res):
        assert got["heads"] == [(8 // world,)] * 4, "each rank attends with its own heads"
        assert got["engine/graph_safe"] is False, "no CUDA graphs while a shard is set"
        assert got["engine/cache_shapes"] == tp1["cache_shapes"], "the caches are replicated"
        assert any(not bits_equal(lp, wlp) for (_, lp), (_, wlp) in zip(got["engine/control"], tp1["engine"])), \
            f"engine control rank {r}/{world}: the stock o_b_proj should differ"
        for i, ((tok, lp), (wtok, wlp)) in enumerate(zip(got["engine/out"], tp1["engine"])):
            assert_bitwise_equal(tok, wtok, f"rank {r} prompt {i} tokens")
            assert_bitwise_equal(lp, wlp, f"rank {r} prompt {i} logprobs")
    for i, (tok, lp) in enumerate(res[0]["engine/out"]):
        seq = torch.tensor(ENGINE_PROMPTS[i] + tok.tolist())[None]
        with torch.no_grad():
            trainer = bitmatch.token_logprobs(tp1["lm"], seq)[0, len(ENGINE_PROMPTS[i]) - 1:]
        assert_bitwise_equal(lp, trainer, f"prompt {i}: engine TP = {world} vs trainer TP = 1")


def test_tp_trainer_gradients_match_tp1(ranks):
    """Autograd through the sharded forward (fp32): bitwise logprobs; after ``reduce_tp_gradients``
    every rank holds the same gradient, equal to TP = 1's within fp32 rounding (backward needs correct
    gradients, not invariant ones)."""
    world, res = ranks
    ids, mask = padded_batch()
    lm = _model().float()
    lp = bitmatch.token_logprobs(lm, ids, mask)
    lp.sum().backward()
    for r, got in enumerate(res):
        assert_bitwise_equal(got["grad/logprobs"], lp.detach(), f"rank {r}/{world} fp32 trainer logprobs")
    for n, p in lm.named_parameters():
        if p.grad is None:  # the indexer: a top-k selection, no gradient (HF's neither)
            assert all(got["grad/params"][n] is None for got in res), n
            continue
        g = res[0]["grad/params"][n]
        for r, got in enumerate(res[1:], 1):
            assert torch.equal(got["grad/params"][n], g), f"{n}: rank {r} differs from rank 0"
        atol = 1e-4 * p.grad.abs().max().item()
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=atol, msg=lambda m, n=n: f"{n}: {m}")


@functools.cache
def _tp1_triton_logits():
    return _triton_logits(_model())


@pytest.mark.interpreter
def test_triton_interpreter_forward_equals_tp1(ranks):
    """On the Triton kernels (interpreter) too: Triton's sink attention gives a head the same bits with
    8, 4 or 2 heads beside it."""
    world, res = ranks
    want = _tp1_triton_logits()
    for r, got in enumerate(res):
        assert_bitwise_equal(got["triton/logits"], want, f"triton logits rank {r}/{world}")


@pytest.mark.parametrize("kw, world, field", [
    ({}, 3, "num_attention_heads = 8 is not divisible by the TP degree 3"),
    (dict(o_groups=2), 4, "o_groups = 2 is not divisible by the TP degree 4"),
    (dict(n_routed_experts=6), 4, "n_routed_experts = 6 is not divisible by the TP degree 4"),
], ids=["heads", "o_groups", "experts"])
def test_shard_refuses_indivisible(kw, world, field):
    with pytest.raises(ValueError, match=field):
        shard_model(_model(**kw), FakeTP(0, world))

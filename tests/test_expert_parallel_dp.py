"""Data-parallel attention with expert-parallel MoE (``parallel.enable_expert_parallel``), CPU gloo.

DeepSeek models are served this way: each rank runs its own requests, the routed experts are spread
over the ranks, and a MoE layer moves each (token, slot) row to its expert's rank and back. Each
rank here gets its own batch (other lengths, other padding) and its own prompts; every rank's
trainer logprobs and engine tokens / logprobs must equal the one-process ones of that rank's inputs,
bit for bit, whatever the other ranks run (Qwen3-MoE, DeepSeek-V4, Nemotron-H). Backward: the ranks'
gradients summed equal the one process's gradient of the summed loss (within fp32 rounding). The
control is stock expert parallelism: each rank combines its own experts' share of every token and
the partial outputs are all-reduced (``allreduce_expert_parallel``), which differs.
"""
from __future__ import annotations

import pytest
import torch

import bitmatch
from bitmatch import Engine, SamplingParams
from bitmatch.parallel import (
    TPGroup,
    data_parallel_experts,
    disable_tensor_parallel,
    enable_expert_parallel,
    enable_tensor_parallel,
    idle_step,
    keep_local_experts,
    reduce_data_parallel_gradients,
    step_data_parallel,
)
from bitmatch.testing import assert_bitwise_equal
from bitmatch.testing.models import tiny_model
from tp_ranks import FakeTP, ranks_fixture

# every MoE family, 8 routed experts: Qwen3-MoE (top-2, one dense layer); DeepSeek-V4 (hash and
# learned routing, the tests' TP config); Nemotron-H (Mamba2 / attention / MLP / MoE blocks)
MODELS = {
    "qwen3moe": ("qwen3moe-e8-k2", {}),
    "deepseek_v4": ("deepseek_v4", dict(seed=1, num_attention_heads=8, head_dim=16, o_groups=4, n_routed_experts=8)),
    "nemotron_h": ("nemotron_h", dict(mamba_num_heads=8, mamba_head_dim=16, n_groups=4, chunk_size=8)),
}


def _model(name="qwen3moe"):
    args, kw = MODELS[name]
    return tiny_model(args, **kw)


def _batch(rank):
    """This rank's own batch: 2 + rank rows of 9 + 2 rank tokens, its last row left-padded."""
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(3, 99, (2 + rank, 9 + 2 * rank), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, :3] = 0
    return ids, mask


def _prompts(rank):
    g = torch.Generator().manual_seed(200 + rank)
    return [torch.randint(3, 99, (n,), generator=g).tolist() for n in (5, 8)]


def _engine_run(lm, prompts):
    params = [SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=31 + i) for i in range(len(prompts))]
    outs = Engine(lm, block_size=4, num_gpu_blocks=64).generate(prompts, params, use_tqdm=False)
    return [(torch.tensor(o.outputs[0].token_ids), torch.tensor(o.outputs[0].logprobs)) for o in outs]


def _uneven_prompts(rank):
    """Rank r: r + 1 prompts of 3 + 2 r new tokens, so the ranks run out of work at different steps."""
    g = torch.Generator().manual_seed(300 + rank)
    return [torch.randint(3, 99, (4 + i,), generator=g).tolist() for i in range(rank + 1)], 3 + 2 * rank


def _uneven_engine(lm, ep):
    """The ranks' engines stepped together by step_data_parallel until no rank has a request left."""
    prompts, n = _uneven_prompts(ep.rank)
    eng = Engine(lm, block_size=4, num_gpu_blocks=64)
    ids = [eng.add_request(p, SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=41 + i))
           for i, p in enumerate(prompts)]
    done, steps = {}, 0
    while (finished := step_data_parallel(eng, ep)) is not None:
        steps += 1
        for o in finished:
            done[o.request_id] = (torch.tensor(o.outputs[0].token_ids), torch.tensor(o.outputs[0].logprobs))
    return [done[i] for i in ids], steps


def _control(lm, ep, ids):
    """Stock EP on this rank's tokens: each rank's partial combine of every token, all-reduced."""
    from bitmatch.models import forward_hidden
    from tp_ranks import packed_ctx

    enable_expert_parallel(lm, ep, row_parallel="allreduce")
    try:
        with torch.no_grad():
            return forward_hidden(lm, ids, packed_ctx(ids))
    finally:
        disable_tensor_parallel(lm)


TRAIN = [("qwen3moe", False), ("deepseek_v4", False), ("nemotron_h", False), ("qwen3moe", True)]


def _train(name, local, ep, steps=2):
    """``steps`` SGD steps (fp32) under data-parallel experts, each rank its own batch, the gradients
    summed by ``reduce_data_parallel_gradients`` (``local``: only this rank's experts kept); the
    rank's weights and its logprobs on them."""
    lm = _model(name).float()
    enable_expert_parallel(lm, ep)
    if local:
        keep_local_experts(lm)
    opt = torch.optim.SGD(lm.parameters(), lr=0.1)
    ids, mask = _batch(ep.rank)
    for _ in range(steps):
        (-(bitmatch.token_logprobs(lm, ids, mask) * mask[:, 1:]).sum()).backward()
        reduce_data_parallel_gradients(lm)
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        lp = bitmatch.token_logprobs(lm, ids, mask)
    return {"weights": {n: p.detach().clone() for n, p in lm.named_parameters()}, "logprobs": lp}


def _worker(ep):
    res = {}
    ids, mask = _batch(ep.rank)
    for name in MODELS:
        lm = _model(name)
        enable_expert_parallel(lm, ep)
        with torch.no_grad():
            res[f"{name}/logprobs"] = bitmatch.token_logprobs(lm, ids, mask)
        res[f"{name}/engine"] = _engine_run(lm, _prompts(ep.rank))
        res[f"{name}/uneven"] = _uneven_engine(lm, ep)
        prompts, n = _uneven_prompts(ep.rank)  # Engine.generate steps the ranks together by itself
        outs = Engine(lm, block_size=4, num_gpu_blocks=64).generate(
            prompts, [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=41 + i)
                      for i in range(len(prompts))], use_tqdm=False)
        res[f"{name}/uneven_generate"] = [(torch.tensor(o.outputs[0].token_ids), torch.tensor(o.outputs[0].logprobs))
                                          for o in outs]
        with torch.no_grad():  # the trainer: rank 0 scores two batches, the others one and an idle step
            ids1, mask1 = _batch(ep.rank + 10)
            if ep.rank == 0:
                res[f"{name}/second"] = bitmatch.token_logprobs(lm, ids1, mask1)
            else:
                idle_step(lm)
        disable_tensor_parallel(lm)
        f32 = _model(name).float()
        enable_expert_parallel(f32, ep)
        lp = bitmatch.token_logprobs(f32, ids, mask)
        (lp * mask[:, 1:]).sum().backward()
        res[f"{name}/grads"] = {n: p.grad for n, p in f32.named_parameters()}
    res["control"] = _control(_model(), ep, torch.arange(3, 14 + ep.rank) + ep.rank)
    for name, local in TRAIN:
        res[f"train/{name}/{local}"] = _train(name, local, ep)
    for name in MODELS:  # only this rank's experts kept, data-parallel and tensor-parallel (EP = TP)
        lm = _model(name)
        enable_expert_parallel(lm, ep)
        res[f"{name}/local/kept"] = keep_local_experts(lm)
        with torch.no_grad():
            res[f"{name}/local/logprobs"] = bitmatch.token_logprobs(lm, ids, mask)
        res[f"{name}/local/uneven"] = _uneven_engine(lm, ep)
        try:
            disable_tensor_parallel(lm)
            res[f"{name}/local/disable"] = "allowed"
        except ValueError as e:
            res[f"{name}/local/disable"] = str(e)
        lm = _model(name)
        enable_tensor_parallel(lm, ep)
        keep_local_experts(lm)
        with torch.no_grad():
            res[f"{name}/local/tp_logprobs"] = bitmatch.token_logprobs(lm, *_batch(0))
    return res


ranks = ranks_fixture(_worker, "dp_ep")


@pytest.mark.parametrize("name", list(MODELS))
def test_each_rank_gets_its_own_one_process_bits(ranks, name):
    world, res = ranks
    lm = _model(name)
    for r, got in enumerate(res):
        ids, mask = _batch(r)
        where = f"{name} rank {r}/{world}"
        with torch.no_grad():
            assert_bitwise_equal(got[f"{name}/logprobs"], bitmatch.token_logprobs(lm, ids, mask), f"{where} trainer")
        want = _engine_run(lm, _prompts(r))
        for i, ((t, lp), (wt, wlp)) in enumerate(zip(got[f"{name}/engine"], want)):
            assert torch.equal(t, wt), f"{where} prompt {i}: sampled tokens differ"
            assert_bitwise_equal(lp, wlp, f"{where} prompt {i}: engine logprobs")
            seq = torch.tensor(_prompts(r)[i] + t.tolist())[None]
            with torch.no_grad():
                trainer = bitmatch.token_logprobs(lm, seq)[0, len(_prompts(r)[i]) - 1:]
            assert_bitwise_equal(lp, trainer, f"{where} prompt {i}: engine vs trainer")


@pytest.mark.parametrize("name", list(MODELS))
def test_ranks_out_of_work_step_idle(ranks, name):
    """Ranks with fewer requests (engine: ``step_data_parallel``, or ``Engine.generate``, which steps
    the ranks together by itself) or batches (trainer: ``idle_step``) join the busy ranks' MoE
    collectives with no tokens: the busy ranks finish with one process's bits."""
    world, res = ranks
    lm = _model(name)
    steps = [got[f"{name}/uneven"][1] for got in res]
    # every rank stepped until the busiest was done (rank 0 needs 3 steps, the last rank 3 + 2 (world - 1))
    assert len(set(steps)) == 1 and steps[0] >= 3 + 2 * (world - 1), steps
    for r, got in enumerate(res):
        prompts, n = _uneven_prompts(r)
        params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=41 + i)
                  for i in range(len(prompts))]
        want = Engine(lm, block_size=4, num_gpu_blocks=64).generate(prompts, params, use_tqdm=False)
        for i, ((t, lp), w) in enumerate(zip(got[f"{name}/uneven"][0], want)):
            assert t.tolist() == list(w.outputs[0].token_ids), f"{name} rank {r} prompt {i}: tokens"
            assert_bitwise_equal(lp, torch.tensor(w.outputs[0].logprobs), f"{name} rank {r} prompt {i}: logprobs")
        for (t, lp), (t2, lp2) in zip(got[f"{name}/uneven_generate"], got[f"{name}/uneven"][0]):
            assert torch.equal(t, t2) and torch.equal(lp, lp2), (
                f"{name} rank {r}: Engine.generate vs step_data_parallel")
    ids1, mask1 = _batch(10)
    with torch.no_grad():
        assert_bitwise_equal(res[0][f"{name}/second"], bitmatch.token_logprobs(lm, ids1, mask1),
                             f"{name}: rank 0's second batch beside idle ranks")


@pytest.mark.parametrize("name", list(MODELS))
def test_keep_local_experts(ranks, name):
    """Each rank frees the experts it does not run: 1 / N of the expert parameters stay, the bits do
    not change (data-parallel and tensor-parallel layouts), and the model refuses to run as one
    process again."""
    world, res = ranks
    lm = _model(name)
    experts = sum(p.numel() for n, p in lm.named_parameters() if ".experts." in n)
    with torch.no_grad():
        want_tp = bitmatch.token_logprobs(lm, *_batch(0))
    for r, got in enumerate(res):
        assert got[f"{name}/local/kept"] * world == experts, (got[f"{name}/local/kept"], experts)
        ids, mask = _batch(r)
        with torch.no_grad():
            want = bitmatch.token_logprobs(lm, ids, mask)
        assert_bitwise_equal(got[f"{name}/local/logprobs"], want, f"{name} rank {r}: data-parallel, local experts")
        assert_bitwise_equal(got[f"{name}/local/tp_logprobs"], want_tp, f"{name} rank {r}: EP = TP, local experts")
        for (t, lp), (t2, lp2) in zip(got[f"{name}/local/uneven"][0], got[f"{name}/uneven"][0]):
            assert torch.equal(t, t2) and torch.equal(lp, lp2), f"{name} rank {r}: engine with local experts"
        assert "holds only this rank's experts" in got[f"{name}/local/disable"]


@pytest.mark.parametrize("name,local", TRAIN)
def test_training_under_data_parallel_experts(ranks, name, local):
    """Two SGD steps, each rank its own batch, gradients summed by ``reduce_data_parallel_gradients``:
    the ranks' shared weights stay bit for bit equal, the whole model (the ranks' kept experts put
    together when trimmed) is one process's training on the summed loss within fp32 rounding, and
    each rank's logprobs on it are one process's on that model, bit for bit."""
    world, res = ranks
    runs = [got[f"train/{name}/{local}"] for got in res]
    whole = {}
    for n in runs[0]["weights"]:
        parts = [run["weights"][n] for run in runs]
        if local and ".experts." in n:
            whole[n] = torch.cat(parts)  # rank order = expert order
        else:
            for r, p in enumerate(parts[1:], 1):
                assert torch.equal(p, parts[0]), f"{name}: {n} differs on rank {r}"
            whole[n] = parts[0]
    ref = _model(name).float()  # one process: the same steps on the summed loss of every rank's batch
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        for r in range(world):
            ids, mask = _batch(r)
            (-(bitmatch.token_logprobs(ref, ids, mask) * mask[:, 1:]).sum()).backward()
        opt.step()
        opt.zero_grad()
    init = dict(_model(name).float().named_parameters())
    assert sum(not torch.equal(whole[n], init[n]) for n in whole) > 10, f"{name}: the steps moved too little"
    for n, p in ref.named_parameters():
        torch.testing.assert_close(whole[n], p.detach(), rtol=1e-4, atol=1e-4 * p.abs().max().item(),
                                   msg=lambda m, n=n: f"{name} {n}: {m}")
    with torch.no_grad():
        ref.load_state_dict(whole, strict=False)
        for r, run in enumerate(runs):
            assert_bitwise_equal(run["logprobs"], bitmatch.token_logprobs(ref, *_batch(r)),
                                 f"{name} rank {r}: logprobs after training")


def test_stock_expert_parallel_differs(ranks):
    from bitmatch.models import forward_hidden
    from tp_ranks import packed_ctx

    world, res = ranks
    lm = _model()
    differs = 0
    for r, got in enumerate(res):
        ids = torch.arange(3, 14 + r) + r
        with torch.no_grad():
            differs += int(not torch.equal(got["control"], forward_hidden(lm, ids, packed_ctx(ids))))
    assert differs > 0, f"the stock partial-combine EP gave one process's bits on every rank at EP = {world}"


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_sum_to_the_one_process_gradient(ranks, name):
    world, res = ranks
    f32 = _model(name).float()
    for r in range(world):
        ids, mask = _batch(r)
        (bitmatch.token_logprobs(f32, ids, mask) * mask[:, 1:]).sum().backward()
    for n, p in f32.named_parameters():
        if p.grad is None:  # V4's indexer: a top-k selection, no gradient
            assert all(got[f"{name}/grads"][n] is None for got in res), n
            continue
        g = sum(got[f"{name}/grads"][n] for got in res)
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-4 * p.grad.abs().max().item(),
                                   msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("name", list(MODELS))
def test_refusals(name):
    with pytest.raises(ValueError, match="experts = 8 is not divisible by the EP degree 3"):
        enable_expert_parallel(_model(name), FakeTP(0, 3))
    with pytest.raises(ValueError, match="stock expert combine is built for qwen3_moe only"):
        enable_expert_parallel(_model("nemotron_h"), FakeTP(0, 2), row_parallel="allreduce")
    with pytest.raises(ValueError, match="data_parallel_experts needs tp of one rank"):
        from bitmatch.parallel import shard_dense_model
        shard_dense_model(_model(), FakeTP(0, 2), data_parallel_experts=FakeTP(0, 2))


def test_one_rank_is_moe_experts():
    # EP = 1: the data-parallel experts are kernels.moe_experts itself
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 64, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 8, (7, 2), generator=g)
    w = torch.rand(7, 2, generator=g)
    w_in = (torch.randn(8, 64, 64, generator=g) / 8).to(torch.bfloat16)
    w_out = (torch.randn(8, 64, 32, generator=g) / 6).to(torch.bfloat16)
    got = data_parallel_experts(x, ids, w, w_in, w_out, 8, TPGroup(0, 1))
    assert_bitwise_equal(got, bitmatch.kernels.moe_experts(x, ids, w, w_in, w_out), "EP = 1")

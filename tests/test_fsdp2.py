"""FSDP2 training through bitmatch on CPU: ``bitmatch.token_logprobs`` on a ``fully_shard``-ed model,
with backward, at 2 gloo ranks, against the unsharded model and the TP = 1 engine.

One set of 2 ranks (torch.multiprocessing, fork, a file rendezvous) runs every case and saves its
results; this process computes the references (the unsharded model's logprobs and gradients, the
engine's sampled tokens and logprobs) and compares:

- fp32, the root and every decoder layer sharded, the model patched: logprobs bit for bit, the
  gradients reach the parameters' ``.grad`` as DTensor shards and equal the unsharded model's bit
  for bit when both ranks score the same batch (FSDP2 averages (g + g) / 2 = g exactly), and the
  average of the two batches' gradients bit for bit when each rank scores its own; HF gradient
  checkpointing on top, and a no-grad pass, give the same bits;
- verl's layout: fp32 masters, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, the
  embedding and the head units of their own: the engine's sampled tokens scored at its temperature
  give the engine's logprobs bit for bit, and the gradients are the bf16 model's exactly;
- controls: HF's stock forward on the same sharded model differs from the engine's bits, and
  ``bitmatch.token_logprobs`` refuses (named errors) an unpatched sharded layer, a unit inside a
  layer, a missing root unit and FSDP1.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

import bitmatch
from bitmatch import Engine, SamplingParams
from bitmatch.testing.models import tiny_model

WORLD = 2
BF = torch.bfloat16
TEMPERATURE = 0.8
PROMPTS = [[1, 5, 9, 33, 40], [1, 7, 7, 8, 2], [1, 60, 61, 62, 63]]  # equal lengths: HF's control needs no padding


def _model(dtype=torch.float32):
    return tiny_model("qwen3", dtype=dtype, num_attention_heads=4, num_key_value_heads=4)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 99, (3, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    return ids, mask


def _engine_sequences():
    """The TP = 1 engine on the bf16 model: [3, 11] sequences and each sampled token's logprob."""
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=6, ignore_eos=True, seed=21 + i) for i in range(3)]
    outs = Engine(_model(BF), block_size=4, num_gpu_blocks=64).generate(PROMPTS, params, use_tqdm=False)
    seqs = torch.tensor([p + list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, outs)])
    return seqs, torch.tensor([list(o.outputs[0].logprobs) for o in outs], dtype=torch.float32)


def _response(lp):
    return lp[:, len(PROMPTS[0]) - 1:]


def _shard(lm, mesh, *, units=(), **kw):
    for layer in lm.model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    for name in units:
        fully_shard(lm.get_submodule(name), mesh=mesh, **kw)
    fully_shard(lm, mesh=mesh, **kw)
    return lm


def _grads(lm):
    shards = {n: p.grad for n, p in lm.named_parameters()}
    assert all(isinstance(g, DTensor) and g.placements == (Shard(0),) for g in shards.values()), \
        {n: type(g).__name__ for n, g in shards.items()}
    return {n: g.full_tensor() for n, g in shards.items()}


def _refusal(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _fp32_cases(rank, mesh):
    out = {}
    lm = _shard(bitmatch.patch(_model()), mesh)
    ids, mask = _batch(7)
    lp = bitmatch.token_logprobs(lm, ids, mask)
    lp.sum().backward()
    out["fp32/logprobs"], out["fp32/grads"] = lp.detach(), _grads(lm)
    lm.zero_grad()
    ids, mask = _batch(100 + rank)  # data parallel: each rank its own batch
    lp = bitmatch.token_logprobs(lm, ids, mask)
    lp.sum().backward()
    out["dp/logprobs"], out["dp/grads"] = lp.detach(), _grads(lm)
    with torch.no_grad():  # the old-logprobs pass: the same hooks, no backward to follow
        out["no_grad/logprobs"] = bitmatch.token_logprobs(lm, *_batch(7))

    lm = _model()
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.train()
    lm = _shard(bitmatch.patch(lm), mesh)
    ids, mask = _batch(7)
    lp = bitmatch.token_logprobs(lm, ids, mask)
    lp.sum().backward()
    out["ckpt/logprobs"], out["ckpt/grads"] = lp.detach(), _grads(lm)
    return out


def _mixed_cases(mesh, seqs):
    """verl's FSDP2 layout: bf16 compute of fp32 masters, embedding and head units of their own."""
    out = {}
    mp_policy = MixedPrecisionPolicy(param_dtype=BF, reduce_dtype=torch.float32)
    units = ("model.embed_tokens", "lm_head")
    lm = _shard(bitmatch.patch(_model(), compute_dtype=BF), mesh, units=units, mp_policy=mp_policy)
    lp = bitmatch.token_logprobs(lm, seqs, temperature=TEMPERATURE)
    lp.sum().backward()
    out["mixed/logprobs"], out["mixed/grads"] = lp.detach(), _grads(lm)

    stock = _shard(_model(), mesh, units=units, mp_policy=mp_policy)
    with torch.no_grad():
        logits = stock(seqs).logits[:, :-1].float() / TEMPERATURE
    out["control/stock_hf"] = torch.log_softmax(logits, -1).gather(-1, seqs[:, 1:, None])[..., 0]
    out["control/unpatched"] = _refusal(lambda: bitmatch.token_logprobs(stock, seqs))
    return out


def _refusals(mesh):
    out = {}
    lm = _model()
    fully_shard(lm.model.layers[0].mlp, mesh=mesh)
    out["refuse/inside_layer"] = _refusal(lambda: bitmatch.token_logprobs(_shard(bitmatch.patch(lm), mesh), *_batch(7)))
    lm = bitmatch.patch(_model())
    for layer in lm.model.layers:
        fully_shard(layer, mesh=mesh)
    out["refuse/no_root"] = _refusal(lambda: bitmatch.token_logprobs(lm, *_batch(7)))
    fsdp1 = FullyShardedDataParallel(bitmatch.patch(_model()), device_id=torch.device("cpu"))
    out["refuse/fsdp1"] = _refusal(lambda: bitmatch.token_logprobs(fsdp1, *_batch(7)))
    return out


def _worker(rank, world, store, out_dir, seqs):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        res = {**_fp32_cases(rank, mesh), **_mixed_cases(mesh, seqs), **_refusals(mesh)}
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def engine():
    return _engine_sequences()


@pytest.fixture(scope="module")
def ranks(engine, tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp2")
    # fork: the ranks inherit this process's imports (spawn re-imports torch and transformers per rank)
    mp.start_processes(_worker, args=(WORLD, str(d / "store"), str(d), engine[0]), nprocs=WORLD, join=True,
                       start_method="fork")
    return [torch.load(d / f"rank{r}.pt") for r in range(WORLD)]


def _unsharded(ids, mask, dtype=torch.float32, **kw):
    # one thread, as the ranks: torch's CPU embedding backward adds a repeated token's rows in an
    # order that depends on the thread count (gradients are stock torch, not an invariant op)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lm = _model(dtype)
        lp = bitmatch.token_logprobs(lm, ids, mask, **kw)
        lp.sum().backward()
    finally:
        torch.set_num_threads(threads)
    return lp.detach(), {n: p.grad for n, p in lm.named_parameters()}


def _assert_bits(name, got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        pytest.fail(f"{name}: {bad.shape[0]} of {want.numel()} differ, first at {bad[:5].tolist()}")


def test_fsdp2_logprobs_and_gradients_equal_unsharded(ranks):
    want_lp, want_g = _unsharded(*_batch(7))
    for r, got in enumerate(ranks):
        _assert_bits(f"no_grad rank {r} logprobs", got["no_grad/logprobs"], want_lp)
        for case in ("fp32", "ckpt"):
            _assert_bits(f"{case} rank {r} logprobs", got[f"{case}/logprobs"], want_lp)
            for n, g in want_g.items():
                _assert_bits(f"{case} rank {r} grad {n}", got[f"{case}/grads"][n], g)


def test_fsdp2_data_parallel_gradients_are_the_average(ranks):
    """Each rank its own batch: its logprobs are the unsharded model's on that batch bit for bit; the
    gradients FSDP2 reduce-scatters are the two ranks' average bit for bit (at 2 ranks: a sum of two
    is order-free and halving is exact; at more ranks the collective's order would show)."""
    per_rank = [_unsharded(*_batch(100 + r)) for r in range(WORLD)]
    for r, got in enumerate(ranks):
        _assert_bits(f"dp rank {r} logprobs", got["dp/logprobs"], per_rank[r][0])
        for n in per_rank[0][1]:
            _assert_bits(f"dp rank {r} grad {n}", got["dp/grads"][n], (per_rank[0][1][n] + per_rank[1][1][n]) / 2)


def test_fsdp2_mixed_precision_equals_engine(ranks, engine):
    """fp32 masters computed in bf16 (verl's policy, its embedding / head units): the trainer's logprobs
    of the engine's sampled tokens are the engine's, and the gradients are the bf16 model's."""
    seqs, engine_lp = engine
    want_lp, want_g = _unsharded(seqs, None, BF, temperature=TEMPERATURE)
    _assert_bits("engine vs unsharded bf16 trainer", _response(want_lp), engine_lp)
    for r, got in enumerate(ranks):
        _assert_bits(f"mixed rank {r} logprobs vs engine", _response(got["mixed/logprobs"]), engine_lp)
        for n, g in want_g.items():
            _assert_bits(f"mixed rank {r} grad {n}", got["mixed/grads"][n], g.float())


def test_stock_hf_forward_on_fsdp2_differs_from_engine(ranks, engine):
    """The control: HF's own forward on the same sharded model (bf16 compute) is not the engine's bits."""
    _, engine_lp = engine
    for r, got in enumerate(ranks):
        stock = _response(got["control/stock_hf"])
        assert stock.shape == engine_lp.shape
        assert not torch.equal(stock, engine_lp), f"rank {r}: HF's stock forward matched the engine bit for bit"
        torch.testing.assert_close(stock, engine_lp, atol=0.2, rtol=0)  # the same model, other rounding


def test_fsdp2_refusals_name_the_fix(ranks):
    for got in ranks:
        assert "bitmatch.patch(model)" in got["control/unpatched"]
        assert "inside a decoder layer" in got["refuse/inside_layer"]
        assert "fully_shard the model itself" in got["refuse/no_root"]
        assert "FSDP1" in got["refuse/fsdp1"] and "fully_shard" in got["refuse/fsdp1"]

"""``bitmatch.token_logprobs`` on a DistributedDataParallel model (what accelerate, TRL and torchrun data
parallel hand it), CPU gloo, 2 ranks, each rank its own batch.

DDP all-reduces gradients only for a backward its own forward prepared; the trainer must run inside
it (``bitmatch.parallel.ddp``). Checked: the logprobs are one process's bits, every rank ends with the
same gradient, the average of the ranks' one-process gradients; the control (the module inside the
wrapper called directly, as before the fix) leaves each rank its own gradient. With data-parallel
experts trimmed to each rank's own (``keep_local_experts(ddp=True)``) the experts' gradients match
DDP's average too, and a model trimmed without ``ddp=True`` is refused.
"""
from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import bitmatch
from bitmatch.parallel import enable_expert_parallel, keep_local_experts
from bitmatch.testing import assert_bitwise_equal
from bitmatch.testing.models import tiny_model
from tp_ranks import ranks_fixture


def _dense():
    return tiny_model("qwen3", dtype=torch.float32)


def _moe():
    return tiny_model("qwen3moe-e8-k2", dtype=torch.float32, seed=0, hidden_size=64)


def _batch(rank):
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randint(3, 99, (2, 9 + rank), generator=g)


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _worker(ep):
    res, ids = {}, _batch(ep.rank)
    m = _dense()
    wrapped = DDP(m)  # held through the backward, as a trainer holds it: its reducer does the all-reduce
    lp = bitmatch.token_logprobs(wrapped, ids)
    lp.sum().backward()
    res["dense/logprobs"], res["dense/grads"] = lp.detach(), _grads(m)
    m = _dense()
    wrapped = DDP(m)
    bitmatch.token_logprobs(wrapped.module, ids).sum().backward()  # the control: DDP's forward bypassed
    res["control/grads"] = _grads(m)
    m = _moe()
    enable_expert_parallel(m, ep)
    keep_local_experts(m, ddp=True)
    wrapped = DDP(m)
    lp = bitmatch.token_logprobs(wrapped, ids)
    lp.sum().backward()
    res["moe/logprobs"], res["moe/grads"] = lp.detach(), _grads(m)
    m = _moe()
    enable_expert_parallel(m, ep)
    keep_local_experts(m)
    try:
        bitmatch.token_logprobs(DDP(m), ids)
        res["moe/refused"] = ""
    except ValueError as e:
        res["moe/refused"] = str(e)
    return res


ranks = ranks_fixture(_worker, "ddp", worlds=(2,))


def _reference(make, world):
    """One process: the logprobs of each rank's batch and the gradient of the ranks' mean loss."""
    m = make()
    lps = []
    for r in range(world):
        lp = bitmatch.token_logprobs(m, _batch(r))
        (lp.sum() / world).backward()
        lps.append(lp.detach())
    return lps, _grads(m)


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item(), msg=lambda m: f"{what}: {m}")


def _check_ranks(res, key, lps, want, world, what):
    """Each rank's logprobs equal the one-process reference bit for bit and its gradients are close
    to the reference's (a routed expert's: this rank's rows, whole on it, scaled to DDP's average)."""
    for r, got in enumerate(res):
        assert_bitwise_equal(got[f"{key}/logprobs"], lps[r], f"rank {r} logprobs, {what}")
        for n, g in want.items():
            if ".experts." in n:
                e = g.shape[0] // world
                g = g[r * e:(r + 1) * e]
            _close(got[f"{key}/grads"][n], g, f"rank {r} {n}")


def test_dense_gradients_are_synchronized(ranks):
    world, res = ranks
    lps, want = _reference(_dense, world)
    _check_ranks(res, "dense", lps, want, world, "through DDP")
    for r, got in enumerate(res):
        for n in want:
            assert torch.equal(got["dense/grads"][n], res[0]["dense/grads"][n]), f"rank {r}: {n} not synchronized"
    differ = sum(not torch.equal(res[0]["control/grads"][n], res[1]["control/grads"][n]) for n in want)
    assert differ > 0, "control: DDP's forward bypassed should leave each rank its own gradient"


def test_data_parallel_experts_under_ddp(ranks):
    world, res = ranks
    lps, want = _reference(_moe, world)
    _check_ranks(res, "moe", lps, want, world, "local experts, DDP")
    for got in res:
        assert "keep_local_experts(model, ddp=True)" in got["moe/refused"]

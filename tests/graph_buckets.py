"""The scaffolding every family's CUDA-graph bucket tests share (tests/test_engine_graphs*.py).

On CPU there are no graphs: ``ModelRunner.simulate_buckets`` runs each pure-decode step eagerly on
exactly the padded inputs a replay gets (scratch block, padded rows decoding token 0, the context
bucket's host bound and full-width block table). These helpers run an engine that way, build the
staggered batch whose decode steps land in every batch bucket, replay one request in several
buckets, and plant the control (padded rows written into a real sequence's block); for LoRA
models, the kept merged weights across an update of A and B, and their stale-weight control.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import bitmatch.kernels as K
import bitmatch.models as M
from bitmatch.engine import Engine, SamplingParams, graphs, model_runner as mr
from bitmatch.testing import same_outputs
from bitmatch.testing.models import random_prompts
from host_reads import host_reads


def run(model, prompts, params, simulate, max_num_seqs=8, num_gpu_blocks=96, **kw):
    """(engine, outputs) of one generate, decode steps simulated as graph replays or not."""
    eng = Engine(model, num_gpu_blocks=num_gpu_blocks, max_num_seqs=max_num_seqs, **kw)
    eng.model_runner.simulate_buckets = simulate
    return eng, eng.generate(prompts, params, use_tqdm=False)


def eager_and_simulated(model, prompts, params, decode_steps):
    """(eager outputs, simulated-replay outputs) of one batch; the simulated run must have taken
    ``decode_steps`` padded replays (every decode step), the eager one none."""
    eng, eager = run(model, prompts, params, simulate=False)
    assert eng.model_runner.num_simulated_steps == 0
    eng, simulated = run(model, prompts, params, simulate=True)
    assert eng.model_runner.num_simulated_steps == decode_steps
    return eager, simulated


def staggered(n=5, lo=3, hi=30, seed=11):
    """n requests finishing at different times (max_tokens 2 .. n + 1), greedy and sampled rows
    mixed: with n = 5 the decode steps of 5, 4, 3, 2, 1 rows run in buckets 8, 4, 4, 2, 1."""
    temps = [0.8, 1.0, 0.0, 0.6, 0.8]
    prompts = random_prompts(n, lo, hi, seed=seed)
    params = [SamplingParams(temperature=temps[i % len(temps)], max_tokens=2 + i, ignore_eos=True, seed=i)
              for i in range(n)]
    return prompts, params


def one_request_in_buckets(model, neighbours=(0, 2, 6), target_len=17, others_hi=25, max_tokens=4,
                           neighbour_temperature=0.7, decode_steps=None):
    """The outputs of one fixed request run alone and beside k other requests for each k in
    ``neighbours`` (so its decode steps run in different batch buckets), all simulated replays.
    ``decode_steps``: the simulated steps each run must have taken (None: not checked)."""
    target = random_prompts(1, target_len, target_len, seed=5)[0]
    sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=99)
    others = random_prompts(max(neighbours), 2, others_hi, seed=6)
    runs = []
    for k in neighbours:
        ps = [SamplingParams(temperature=neighbour_temperature, max_tokens=max_tokens, ignore_eos=True, seed=i)
              for i in range(k)]
        eng, outs = run(model, others[:k] + [target], ps + [sp], simulate=True)
        if decode_steps is not None:
            assert eng.model_runner.num_simulated_steps == decode_steps
        runs.append(outs[-1])
    return runs


@contextlib.contextmanager
def padding_into_a_real_block(monkeypatch):
    """The control: padded rows write their K/V at the position before the first row's token (a
    real sequence's block) instead of the scratch block."""
    orig = mr.ModelRunner.pad

    def bad_pad(self, inp, bucket):
        p = orig(self, inp, bucket)
        if bucket > inp.B:
            p.slots = p.slots.copy()
            p.slots[inp.B:] = inp.slots[0] - 1
        return p
    with monkeypatch.context() as m:
        m.setattr(mr.ModelRunner, "pad", bad_pad)
        yield


def decode_step_reads(model, prompts, params, backend: str = "triton", part=None):
    """Host reads (tests/host_reads.py) of a simulated pure-decode step on ``backend`` (Triton:
    the interpreter stands in for the GPU): of the whole forward of the second decode step (the
    first may build tables once, as a graph's warm-up run does), or, with ``part(model, ids)``,
    of that call alone at the first decode step. The engine's modules import forward_hidden at
    their top: each is patched."""
    reads, seen = [], []
    orig = M.forward_hidden

    def spy(m, ids, ctx, *a, **kw):
        if ctx.max_query_len != 1:
            return orig(m, ids, ctx, *a, **kw)
        seen.append(1)
        with K.use_backend(backend):
            if part is None:
                if len(seen) != 2:
                    return orig(m, ids, ctx, *a, **kw).to(torch.bfloat16)
                with host_reads() as r:
                    out = orig(m, ids, ctx, *a, **kw)
                reads.extend(r)
                return out.to(torch.bfloat16)
            if len(seen) == 1:
                with host_reads() as r:
                    part(m, ids)
                reads.extend(r)
        return orig(m, ids, ctx, *a, **kw)
    with pytest.MonkeyPatch.context() as mp:
        for mod in (M, mr, graphs):
            mp.setattr(mod, "forward_hidden", spy)
        run(model, prompts, params, simulate=True)
    assert len(seen) >= 2, "fewer than two pure-decode steps ran"
    return reads


# ---------------------------------------------------------------- LoRA layers in the graphs
def step_lora(pm, scale):
    """An optimizer-like in-place update of every LoRA A and B (bumps their version counters)."""
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if ".lora_" in n:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))).to(p.dtype) * scale)


def opt_in_needs_runnable_lora(pm, opt_in) -> None:
    """``opt_in(pm)`` holds with plain LoRA layers and not once one of them is a layer the LoRA
    linear cannot run (fan_in_fan_out)."""
    from bitmatch.models import lora
    assert opt_in(pm)
    mod = next(m for m in M.unwrap_causal_lm(pm).modules() if lora.is_lora_layer(m))
    mod.fan_in_fan_out = True
    try:
        assert not opt_in(pm)
    finally:
        mod.fan_in_fan_out = False


def lora_updates_keep_the_bits(pm, prompts, params, bitmatch_count) -> None:
    """Eager == simulated replays == the trainer (``bitmatch_count(pm, outs, params)``: tokens
    compared, all equal), before and after an update of A and B between generate calls."""
    for update in (False, True):
        if update:
            step_lora(pm, 0.05)
        _, eager = run(pm, prompts, params, simulate=False)
        eng, simulated = run(pm, prompts, params, simulate=True)
        assert eng.model_runner.num_simulated_steps > 0
        assert same_outputs(eager, simulated), update
        assert bitmatch_count(pm, simulated, params) == sum(sp.max_tokens for sp in params), update


def stale_kept_weights(pm, prompts, params, monkeypatch):
    """The control: the outputs of a simulated engine whose kept LoRA weights are left stale
    across an update of A and B (refresh disabled)."""
    from bitmatch.models import lora
    eng, _ = run(pm, prompts, params, simulate=True)  # the kept weights exist now
    monkeypatch.setattr(lora, "refresh_rollout_weights", lambda lm, force=False: None)
    monkeypatch.setattr(lora, "_rollout_key", lambda mod, live: "frozen")
    for m in M.unwrap_causal_lm(pm).modules():
        for entry in lora.rollout_weights_of(m).values():
            entry[0] = "frozen"
    step_lora(pm, 0.5)
    return eng.generate(prompts, params, use_tqdm=False)

"""Engines give their memory back: ``Engine.close()`` and ``with Engine(...) as engine:`` free the KV
cache (and, on CUDA, the decode graphs and their pool) at once, without the cycle collector; the
model holds no reference to an engine; what an engine derived on the model (fused copies, kept
casts of fp32 masters) goes with the last engine over it; ten engines in a row leave none alive.
Every test runs with ``gc.disable()``: freed means freed by reference counting."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch

import bitmatch
from bitmatch.engine import Engine, SamplingParams
from bitmatch.engine.graphs import DecodeGraphs
from bitmatch.models import lora
from bitmatch.models.dense import fused_copies
from bitmatch.testing.models import random_prompts, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_MEMORY = os.path.join(ROOT, "benchmarks", "engine", "engine_memory.py")
PROMPTS = random_prompts(3, 5, 20, seed=1)
SP = SamplingParams(temperature=0.7, max_tokens=4, ignore_eos=True, seed=0)


@pytest.fixture
def no_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=0)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def _cache_refs(engine) -> list:
    refs = [weakref.ref(t) for t in _tensors(engine.model_runner.caches)]
    assert refs
    return refs


def _reachable(root, targets) -> list:
    """The objects of ``targets`` reachable from ``root`` through references (not through a
    tensor's storage: parameters are leaves)."""
    want = {id(t) for t in targets}
    seen, todo, hit = set(), [root], []
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, (type, type(sys))):
            continue
        seen.add(id(o))
        if id(o) in want:
            hit.append(o)
            continue
        todo.extend(gc.get_referents(o))
    return hit


def _engine(model, **kw):
    return Engine(model, num_gpu_blocks=32, block_size=16, **kw)


def test_close_frees_the_kv_cache_at_once_and_refuses_generate(model, no_gc):
    eng = _engine(model)
    eng.generate(PROMPTS, SP, use_tqdm=False)
    caches = _cache_refs(eng)
    eng.close()
    assert all(r() is None for r in caches), "close() left KV cache tensors alive"
    eng.close()   # idempotent
    with pytest.raises(RuntimeError, match="Engine.generate: this engine was closed"):
        eng.generate(PROMPTS, SP, use_tqdm=False)
    with pytest.raises(RuntimeError, match="Engine.add_request: this engine was closed"):
        eng.add_request(PROMPTS[0], SP)
    with pytest.raises(RuntimeError, match="Engine.step: this engine was closed"):
        eng.step()


def test_with_block_closes(model, no_gc):
    with _engine(model) as eng:
        out = eng.generate(PROMPTS, SP, use_tqdm=False)
        caches = _cache_refs(eng)
    assert len(out) == 3 and all(r() is None for r in caches)
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate(PROMPTS, SP, use_tqdm=False)
    with pytest.raises(ValueError, match="boom"), _engine(model) as eng2:   # closed on an exception too
        caches = _cache_refs(eng2)
        raise ValueError("boom")
    assert all(r() is None for r in caches)


def test_the_model_holds_no_reference_to_an_engine(model, no_gc):
    eng = _engine(model, enable_prefix_caching=True)
    eng.generate(PROMPTS, SP, use_tqdm=False)
    parts = [eng, eng.model_runner, eng.scheduler, eng.block_manager, eng.model_runner.sampler]
    assert not _reachable(model, parts)
    ref = weakref.ref(eng)
    del eng, parts
    assert ref() is None, "an engine dropped without close() stayed alive (a reference cycle or the model)"


def test_decode_graphs_form_no_cycle(model, no_gc):
    """The CUDA-graph holder refers back to its runner: weakly, so ``del engine`` alone frees an
    engine with graphs (built here on CPU: the holder without a capture)."""
    eng = _engine(model)
    eng.model_runner.graphs = DecodeGraphs(eng.model_runner, 64)
    caches = _cache_refs(eng)
    ref = weakref.ref(eng)
    del eng
    assert ref() is None and all(r() is None for r in caches)


def test_ten_engines_in_a_row_leave_none_alive(model, no_gc):
    refs, caches = [], []
    for i in range(10):
        eng = _engine(model, enable_prefix_caching=bool(i % 2))
        eng.generate(PROMPTS, SP, use_tqdm=False)
        refs.append(weakref.ref(eng))
        caches += _cache_refs(eng)
        if i % 3 == 0:
            eng.close()
        elif i % 3 == 1:
            with eng:
                pass
        del eng
    assert [r() is None for r in refs] == [True] * 10
    assert all(r() is None for r in caches)


def test_derived_weights_go_with_the_last_engine(no_gc):
    """fp32 masters computed in bf16 (TRL's bf16 mixed precision): an engine step derives fused
    q/k/v, gate/up copies and bf16 casts of the parameters it reads, kept on the model between steps.
    They stay while another engine over the model is open and go when the last one closes."""
    m = bitmatch.patch(tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.float32, seed=0), compute_dtype=torch.bfloat16)
    derived = lambda: [e.weight for layer in m.model.layers for p in (layer.self_attn, layer.mlp)  # noqa: E731
                       for e in fused_copies(p).values()] + \
        [c for p in m.parameters() for c in lora.kept_casts(p).values()]
    a, b = _engine(m), _engine(m)
    ref = a.generate(PROMPTS, SP, use_tqdm=False)
    kept = [weakref.ref(t) for t in derived()]
    assert kept
    a.close()
    assert all(r() is not None for r in kept)          # b still runs on them
    assert [o.outputs[0].logprobs for o in b.generate(PROMPTS, SP, use_tqdm=False)] == \
        [o.outputs[0].logprobs for o in ref]
    b.close()
    assert all(r() is None for r in kept) and not derived()
    with _engine(m) as c:                               # rebuilt on the next engine's first step
        assert [o.outputs[0].logprobs for o in c.generate(PROMPTS, SP, use_tqdm=False)] == \
            [o.outputs[0].logprobs for o in ref]


def test_engine_memory_script_smoke(tmp_path):
    out = tmp_path / "engine_memory.json"
    res = subprocess.run([sys.executable, ENGINE_MEMORY, "--device", "cpu", "--tiny", "--engines", "3",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    rep = json.loads(out.read_text())
    assert {"device", "torch", "command", "engines", "model_bytes", "passed"} <= rep.keys()
    assert rep["passed"] and len(rep["engines"]) == 3
    assert all(e["engine_alive_after_close"] is False and e["kv_cache_alive_after_close"] is False
               for e in rep["engines"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")
def test_ten_engines_with_cuda_graphs_end_at_the_models_memory(tmp_path):
    """On the GPU (tiny model, decode steps replayed from CUDA graphs): after each of ten engines
    (closed, left by its with block, or just dropped) memory_allocated is back at the model's,
    with the cycle collector off. The 1.7B-shape run: benchmarks/engine/engine_memory.py without --tiny."""
    out = tmp_path / "engine_memory.json"
    res = subprocess.run([sys.executable, ENGINE_MEMORY, "--device", "cuda", "--tiny", "--engines", "10",
                          "--max-tokens", "8", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    rep = json.loads(out.read_text())
    assert rep["passed"] and all(e["graph_replays"] > 0 for e in rep["engines"]), rep["engines"]

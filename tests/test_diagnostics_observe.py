"""Diagnostics observe; they do not patch. ``Engine.record`` hands a recorder every op output of every
step on the path the step takes unrecorded (eager, or the recording twin of its CUDA graph), so a
check never changes the path it checks:

* the bits of a run with a recorder attached are the bits without it: eager steps, simulated graph
  replays (the padded inputs a graph gets, CPU) and, on CUDA, real replays; the steps take the
  same paths;
* the recorded rows carry the engine's own (sequence, position) keys: an eager run and a
  simulated-replay run give the same trace (the padding is dropped);
* ``locate --pair engine`` (healthy, a planted kernel, the other temperature formula) leaves every
  method of the engine, its runner, the family and the sampler as it found them, while it runs;
* no diagnostics module assigns attributes on objects it imports or methods on live objects
  (a scan of their source).
"""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import bitmatch.engine.sampling as S
import bitmatch.kernels as K
from bitmatch.diagnostics.tracing import Recorder, diff_traces
from bitmatch.diagnostics.verify import locate_pair
from bitmatch.engine import Engine, SamplingParams
from bitmatch.engine.graphs import DecodeGraphs
from bitmatch.engine.model_runner import ModelRunner
from bitmatch.models import family_of
from bitmatch.testing import same_outputs
from bitmatch.testing.models import random_prompts, tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[1] / "bitmatch"
DIAGNOSTICS = sorted((ROOT / "diagnostics").glob("*.py")) + [ROOT / "demo.py"] + sorted((ROOT / "cli").glob("*.py"))
MODELS = {"dense": lambda: tiny_model(), "qwen3_moe": lambda: tiny_model("qwen3moe-e8-k2", seed=0)}


def _batch():
    """5 requests finishing at different times: decode steps of 5 .. 1 rows in buckets 8, 4, 4, 2, 1."""
    prompts = random_prompts(5, 3, 20, seed=11)
    params = [SamplingParams(temperature=(0.8, 1.0, 0.0, 0.6)[i % 4], max_tokens=2 + i, ignore_eos=True, seed=i)
              for i in range(5)]
    return prompts, params


def _generate(model, simulate: bool, recorder=None, device="cpu"):
    """(outputs, paths the steps took) of one generate, with ``recorder`` attached or not."""
    prompts, params = _batch()
    with Engine(model, num_gpu_blocks=64, max_num_seqs=8, max_num_batched_tokens=24) as eng:
        eng.model_runner.simulate_buckets = simulate
        runner = eng.model_runner
        if recorder is None:
            outs = eng.generate(prompts, params, use_tqdm=False)
        else:
            with eng.record(recorder):
                outs = eng.generate(prompts, params, use_tqdm=False)
        graphs = runner.graphs
        paths = (runner.num_steps, runner.num_simulated_steps, None if graphs is None else graphs.num_replays)
    return outs, paths


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("simulate", [False, True], ids=["eager", "simulated-graphs"])
def test_recorder_attached_same_bits_same_paths(family, simulate):
    model = MODELS[family]()
    ref, ref_paths = _generate(model, simulate)
    rec = Recorder()
    got, paths = _generate(model, simulate, rec)
    assert same_outputs(ref, got), f"{family}: a recorder changed the engine's outputs"
    assert paths == ref_paths, f"{family}: a recorder changed the steps' paths: {paths} vs {ref_paths}"
    assert rec.paths == ({"eager": paths[0]} if not simulate else
                         {"eager": paths[0] - paths[1], "simulated graph": paths[1]}), rec.paths
    assert not simulate or paths[1] > 0, "no simulated replay ran: the test proves nothing about graphs"
    names = {n for n, _, _ in rec.trace()}
    assert {"embed_tokens", "lm_head", "layers.0.self_attn.attn"} <= names


@pytest.mark.parametrize("family", sorted(MODELS))
def test_graph_rows_keyed_as_eager_rows(family):
    """The recording of simulated replays (padded buckets) equals the eager run's op for op and row
    for row: the padded rows are dropped and every real row keyed by its sequence and position."""
    model = MODELS[family]()
    eager, simulated = Recorder(), Recorder()
    _generate(model, False, eager)
    _generate(model, True, simulated)
    res = diff_traces(eager.trace(), simulated.trace(), side_a="eager", side_b="simulated replays")
    assert res.bitmatched and res.ops_compared > 20, res.summary()
    assert all(o["status"] == "same" for o in res.ops), [o for o in res.ops if o["status"] != "same"][:3]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_recorder_attached_same_bits_with_cuda_graphs():
    model = tiny_model().cuda()
    ref, ref_paths = _generate(model, False)
    rec = Recorder()
    got, paths = _generate(model, False, rec)
    assert same_outputs(ref, got)
    assert paths == ref_paths and paths[2] > 0 and rec.paths.get("graph") == paths[2], (paths, rec.paths)


def test_record_refuses_an_object_without_the_protocol_and_nests():
    model = tiny_model()
    with Engine(model, num_gpu_blocks=16) as eng:
        with pytest.raises(TypeError, match="step.*record"):
            with eng.record(lambda name, value: None):
                pass
        outer, inner = Recorder(), Recorder()
        with eng.record(outer):
            with eng.record(inner):
                eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
            assert eng.model_runner.recorders == [outer]
        assert eng.model_runner.recorders == []
        assert outer.paths == inner.paths == {"eager": 2}


def _callables(obj) -> dict:
    return {k: v for k, v in vars(obj).items() if callable(v) or isinstance(v, (staticmethod, classmethod))}


@pytest.mark.parametrize("inject", [None, "kernel:silu_and_mul", "temperature"])
def test_locate_engine_pair_patches_nothing_while_it_runs(inject, monkeypatch):
    model = tiny_model("qwen3moe-e8-k2", dtype=torch.float32, seed=0)
    fam = family_of(model)
    seen = []
    run = ModelRunner.run

    def checked_run(self, scheduled):   # the test's own spy: what the diagnostic left on live objects
        seen.append(1)
        assert not set(_callables(self)) & set(dir(ModelRunner)), "a runner method shadowed on the instance"
        assert _callables(fam) == fam_before, "the family object gained or lost a method"
        for c, before in classes.items():
            assert _callables(c) == before, f"{c.__name__}'s methods changed"
        assert _callables(S) == sampling_before, "a function of bitmatch.engine.sampling was swapped"
        return run(self, scheduled)
    monkeypatch.setattr(ModelRunner, "run", checked_run)
    classes = {c: _callables(c) for c in (Engine, ModelRunner, DecodeGraphs, S.Sampler, type(fam))}
    fam_before, sampling_before = _callables(fam), _callables(S)
    (r,) = locate_pair("engine", model, random_prompts(2, 4, 9, seed=1), inject=inject)
    assert seen, "the engine ran no step"
    assert r.bitmatched == (inject is None), r.summary()
    assert "steps run: " in r.comparison and "eager" in r.comparison
    assert K.token_logprobs is K.OPS["token_logprobs"].canonical and K.silu_and_mul is K.OPS["silu_and_mul"].canonical


def _imported_names(tree) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out |= {a.asname or a.name for a in node.names}
    return out


def _methods_of_live_objects() -> set[str]:
    fam = family_of(tiny_model())
    return {n for c in (Engine, ModelRunner, DecodeGraphs, S.Sampler, type(fam), torch.nn.Module)
            for n in dir(c) if callable(getattr(c, n, None)) and not n.startswith("__")}


@pytest.mark.parametrize("path", DIAGNOSTICS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_diagnostics_source_assigns_nothing_on_live_objects(path):
    tree = ast.parse(path.read_text())
    imported, methods = _imported_names(tree), _methods_of_live_objects()
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            bad.append(f"line {node.lineno}: {node.func.id}()")
        elif isinstance(node, ast.Attribute) and node.attr in ("__dict__", "MethodType"):
            bad.append(f"line {node.lineno}: .{node.attr}")
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if not isinstance(t, ast.Attribute):
                continue
            base = t.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in imported:
                bad.append(f"line {t.lineno}: assigns {base.id}...{t.attr} (an imported module or class)")
            elif t.attr in methods and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                bad.append(f"line {t.lineno}: assigns .{t.attr}, a method of the engine, its runner or a model")
    assert not bad, f"{path.name} patches live objects: {bad}"

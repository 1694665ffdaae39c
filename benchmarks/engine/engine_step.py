"""Engine decode step on the GPU: host vs GPU time, per phase, against the weight + K/V read roofline.

For each batch size B: the engine (CUDA graphs on) runs B prompts of --prompt-len tokens, then
decode steps; each phase of a step is timed once with a device sync around it (the phases: the
scheduler + step inputs, the forward (graph replay), the LM head, the sampler, the engine's
bookkeeping), and separately the step's wall time without the extra syncs; the torch profiler
gives the GPU kernel time of one step by kernel. The weight + K/V read roofline is the bound.

  python benchmarks/engine/engine_step.py --out DIR [--size 8b] [--batches 64,256]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
import _common
from engine.gpu_e2e import roofline_ms
from training import gpu_train


def _timed(fn, box, key):
    """fn wrapped: synchronizes before and after, adds its wall ms to box[key]."""
    def w(*a, **k):
        _common.sync()
        t = time.perf_counter()
        out = fn(*a, **k)
        _common.sync()
        box[key] = box.get(key, 0.0) + (time.perf_counter() - t) * 1e3
        return out
    return w


def breakdown(eng, steps=6):
    """Median ms per phase over ``steps`` decode steps (each phase synchronized)."""
    import bitmatch.engine.model_runner as mr
    import bitmatch.models as models
    runner = eng.model_runner
    box, rows = {}, []
    # (owner, attribute, phase): instance attributes shadow the methods, module attributes are
    # the names model_runner looks up at call time
    # (the sampler and LM head run inside the graph of a decode step: their eager entries are
    # timed only where a step runs eagerly; ``finish`` is the step's readback)
    patches = [(runner, "run", "runner_total"), (runner.sampler, "device_step", "sampler_eager"),
               (runner.sampler, "finish", "readback"),
               (mr, "StepInputs", "step_inputs"), (models, "compute_logits", "lm_head")]
    if runner.graphs is not None:
        import bitmatch.engine.graphs as gr
        g = runner.graphs
        patches += [(g, "run", "graph_forward"), (g, "_param_key", "graph_param_key"),
                    (gr, "upload", "graph_uploads")]
        if getattr(g.family, "refresh_derived_weights", None) is not None:
            patches.append((g.family, "refresh_derived_weights", "graph_refresh_derived"))
    saved = [(obj, name, obj.__dict__.get(name, None), name in obj.__dict__) for obj, name, _ in patches]
    for obj, name, key in patches:
        setattr(obj, name, _timed(getattr(obj, name), box, key))
    try:
        for _ in range(steps):
            box.clear()
            _common.sync()
            t = time.perf_counter()
            eng.step()
            _common.sync()
            box["step_total"] = (time.perf_counter() - t) * 1e3
            rows.append(dict(box))
    finally:
        for obj, name, old, had in saved:
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
    keys = sorted({k for r in rows for k in r})
    med = {k: round(statistics.median(r.get(k, 0.0) for r in rows), 3) for k in keys}
    med["engine_bookkeeping"] = round(med["step_total"] - med.get("runner_total", 0.0), 3)
    return med


def plain_steps(eng, steps=8):
    ts = []
    for _ in range(steps):
        _common.sync()
        t = time.perf_counter()
        eng.step()
        _common.sync()
        ts.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(ts), 3)


def replay_ms(eng, iters=20):
    """GPU time of one replay of the last replayed graph (CUDA events, back to back)."""
    g = eng.model_runner.graphs
    if g is None or g.last_key is None:
        return None
    graph = g.graphs[g.last_key][0]
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    s.record()
    for _ in range(iters):
        graph.replay()
    e.record()
    torch.cuda.synchronize()
    back_to_back = s.elapsed_time(e) / iters
    cold = []  # one replay from an idle GPU, host wall time: the launch latency a step pays
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        cold.append((time.perf_counter() - t) * 1e3)
    return {"back_to_back_gpu_ms": round(back_to_back, 3), "one_replay_wall_ms": round(statistics.median(cold), 3)}


def main():
    import traceback

    import bitmatch
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--size", default="8b")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--hbm-tbps", type=float, default=None, help="roofline TB/s (default: the card's)")
    ap.add_argument("--engine-kw", default="", help="extra Engine keywords, k=v,k=v (ints)")
    ap.add_argument("--linear-sweep", default=None,
                    help="linear_decode.json: run with its winning tiles (benchmarks/ops/linear_decode.py)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rec = _common.Recorder(os.path.join(a.out, "engine_step.json"), a)
    if a.linear_sweep:
        from ops import linear_decode
        rec.data["linear_tables_applied"] = linear_decode.apply_sweep(a.linear_sweep)
    model = gpu_train.build_model(a.size)
    cfg = model.config
    per_tok = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    batches = [int(b) for b in a.batches.split(",")]
    Bmax = max(batches)
    extra = {k: int(v) for k, v in (kv.split("=") for kv in a.engine_kw.split(",") if kv)}
    eng = bitmatch.Engine(model, max_num_seqs=Bmax, max_num_batched_tokens=Bmax * a.prompt_len + Bmax,
                          kv_cache_bytes=int(Bmax * (a.prompt_len + a.new_tokens + 32) * per_tok * 1.1), **extra)
    out = {}
    for B in batches:
        g = torch.Generator().manual_seed(B)
        prompts = torch.randint(0, cfg.vocab_size, (B, a.prompt_len), generator=g).tolist()
        for i, p in enumerate(prompts):
            eng.add_request(p, bitmatch.SamplingParams(temperature=1.0, max_tokens=a.new_tokens,
                                                       ignore_eos=True, seed=i))
        eng.step()                                  # prefill
        for _ in range(3):
            eng.step()                              # compiles, graph capture
        r = {"B": B}
        try:
            r["plain_step_ms"] = plain_steps(eng)
            r["phases_ms"] = breakdown(eng)
            r["graph_replay_gpu_ms"] = replay_ms(eng)
            r["kernels"] = _common.top_kernels(eng.step, k=10)
        except Exception:
            r["error"] = traceback.format_exc()[-2000:]
            print(r["error"], flush=True)
        while eng.has_unfinished_requests():
            eng.step()
        roof, wb, kvb = roofline_ms(model, B, a.prompt_len + a.new_tokens // 2, _common.hbm_tbps(a.hbm_tbps))
        r.update(roofline_ms=round(roof, 3))
        if "plain_step_ms" in r:
            r["fraction_of_roofline"] = round(roof / r["plain_step_ms"], 3)
        out[f"B{B}"] = r
        print(r, flush=True)
        rec.put("steps", out)
    rec.data["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rec.flush()


if __name__ == "__main__":
    main()

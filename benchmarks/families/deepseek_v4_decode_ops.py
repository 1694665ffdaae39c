"""DeepSeek-V4 decode step op by op on CUDA: each linear's time in the step vs cold, per tile config and K split.

  python benchmarks/families/deepseek_v4_decode_ops.py --out DIR [--config mid] [--seq 512] [--decode-batch 64]
      [--sections step,linears,mix]

CUDA only. The engine's decode step at --decode-batch sequences (the model of
deepseek_v4_layer.py's --config), then:

- ``step``: the step's median wall ms (graphs on) and one profiled graph replay with every
  invariant-linear launch attributed to its (M, N, K, dtype, split) by launch order (the eager
  step's launch sequence, recorded by a spy: a graph replays its launches in capture order).
- ``linears``: each of those shapes timed **cold**, as in the step (its weight read from HBM, not
  L2): one CUDA graph of launches rotating over enough weight copies to exceed 3x L2, per tile
  config and per K split (``split`` 1 is the canonical order today; a split > 1 is another order,
  timed to size the change). Within a split every config's bits are checked against the first.
- ``mix``: the mHC mix projection (hc_pre's first launch) at the step's T and widths under
  hc_k_chunk 1024 (the order today), 512 and 256 (other orders), and its _finish launch.
Writes DIR/deepseek_v4_decode_ops_<config>.json (command, machine, versions, rows).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
import _common
from _common import machine_info
from families.deepseek_v4_layer import _decode_engine, _timed_steps, build

# (BM, BN, BK, GROUP_M, warps, stages) candidates per operand dtype: small output tiles for more
# programs, long K blocks for fewer sequential steps (fp32 operands need half the K block)
HALF_TILES = [(64, 64, 128, 8, 4, 4), (16, 32, 128, 8, 4, 4), (16, 16, 256, 8, 4, 4), (64, 32, 256, 8, 4, 3),
              (16, 64, 256, 8, 4, 3), (32, 32, 256, 8, 4, 3), (16, 16, 128, 8, 4, 4), (16, 32, 256, 8, 4, 4)]
F32_TILES = [(64, 64, 128, 8, 4, 4), (16, 16, 64, 8, 4, 2), (16, 16, 32, 8, 4, 2), (16, 32, 64, 8, 4, 2),
             (32, 16, 64, 8, 4, 2), (16, 16, 64, 8, 2, 2), (16, 16, 128, 8, 4, 1)]
L2 = 50 * 2 ** 20


def _engine(a):
    import bitmatch
    model = build(a.config, torch.bfloat16, "cuda")
    bitmatch.patch(model)
    eng = _decode_engine(a, model, a.decode_batch, 48)
    for _ in range(4):
        eng.step()
    return model, eng


def _linear_sequence(eng):
    """(M, N, K, dtype, split) of every invariant-linear launch of one eager decode step, in order."""
    from bitmatch.kernels.triton import linear as lin
    seq = []
    real = lin._launch

    def spy(x, weight, bias, cfg, split, out=None):
        seq.append((x.shape[0], weight.shape[0], x.shape[1], str(x.dtype).replace("torch.", ""), split,
                    tuple(cfg)))
        return real(x, weight, bias, cfg, split, out)
    runner = eng.model_runner
    graphs, runner.graphs = runner.graphs, None
    lin._launch = spy
    try:
        eng.step()
    finally:
        lin._launch, runner.graphs = real, graphs
    return seq


def _kernel_events(fn):
    """(name, device us) of every kernel one call of fn ran, in start order (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.end - e.time_range.start, e.time_range.start) for e in evs]


def step_section(a, eng, out):
    seq = _linear_sequence(eng)  # again: this step's own launches
    timed = _timed_steps(eng, 8, "cuda")
    evs = _kernel_events(eng.step)
    lin_ev = [e for e in evs if e[0] in ("_linear_kernel", "_reduce_kernel")]
    by_name = {}
    for n, us, _ in evs:
        r = by_name.setdefault(n[:80], [0, 0.0])
        r[0] += 1
        r[1] += us
    first, last = evs[0][2], evs[-1][2] + evs[-1][1]
    busy = sum(e[1] for e in evs)
    rows = {}
    kernels = [e for e in lin_ev if e[0] == "_linear_kernel"]
    matched = len(kernels) == len(seq)
    if matched:
        for (M, N, K, dt, split, cfg), ev in zip(seq, kernels):
            r = rows.setdefault(f"M{M}_N{N}_K{K}_{dt}_S{split}", {"calls": 0, "us": 0.0, "cfg": list(cfg)})
            r["calls"] += 1
            r["us"] += ev[1]
    out["results"]["step"] = {
        "batch": a.decode_batch, "step_ms": timed["median_ms"], "steps_ms": timed["steps_ms"],
        "kernels": len(evs), "kernel_busy_ms": busy / 1e3, "first_to_last_kernel_ms": (last - first) / 1e3,
        "by_kernel_ms": dict(sorted(((k, {"calls": c, "ms": round(us / 1e3, 4)}) for k, (c, us) in by_name.items()),
                                    key=lambda kv: -kv[1]["ms"])),
        "linear_launches_matched": matched, "linear_launches": len(kernels), "spy_launches": len(seq),
        "linear_by_shape": dict(sorted(rows.items(), key=lambda kv: -kv[1]["us"]))}
    return seq


def _cold_ms(fn_for, nbytes):
    """ms per call of fn_for(i), i rotating over enough copies that the working set is 3x L2, all
    calls in one CUDA graph (do_bench flushes L2 before each replay)."""
    import triton
    n = max(2, min(64, math.ceil(3 * L2 / max(nbytes, 1))))
    fns = [fn_for(i) for i in range(n)]
    g = _common.capture_graph(fns, n)
    t = triton.testing.do_bench(g.replay, warmup=5, rep=40, return_mode="median")
    del g
    return t / n


def linears_section(a, seq, out):
    from bitmatch.kernels.triton import linear as lin
    shapes = {}
    for M, N, K, dt, split, cfg in seq:
        shapes.setdefault((M, N, K, dt), [0, split, cfg])[0] += 1
    res = {}
    for (M, N, K, dt), (calls, split0, cfg0) in sorted(shapes.items(), key=lambda kv: -kv[1][0]):
        dtype = getattr(torch, dt)
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        nbytes = N * K * x.element_size()
        n = max(2, min(64, math.ceil(3 * L2 / nbytes)))
        ws = [torch.randn(N, K, device="cuda", dtype=dtype) * 0.02 for _ in range(n)]
        outs = torch.empty(n, M, N, device="cuda", dtype=dtype)
        row = {"calls_per_step": calls, "table_cfg": list(cfg0), "table_split": split0, "weight_copies": n,
               "splits": {}}
        tiles = [tuple(cfg0[:6])] + [t for t in (HALF_TILES if dtype != torch.float32 else F32_TILES)
                                     if t != tuple(cfg0[:6])]
        if N > 65536:
            tiles = tiles[:1]
        splits = [1] + [s for s in (2, 4) if K % s == 0 and (K // s) % 256 == 0 and N <= 65536]
        for s in splits:
            ref, cfgs = None, {}
            for t in tiles:
                for mode in (("fused",) if s == 1 else ("fused", "split")):
                    cfg = (*t, mode)
                    key = f"{t}/{mode}"
                    try:
                        o = lin._launch(x, ws[0], None, cfg, s)
                        same = True if ref is None else bool(torch.equal(o, ref))
                        ref = o if ref is None else ref
                        ms = _cold_ms(lambda i, cfg=cfg: (lambda: lin._launch(x, ws[i], None, cfg, s, out=outs[i])),
                                      nbytes)
                        cfgs[key] = {"us": round(ms * 1e3, 3), "bits_equal_first": same}
                    except Exception as exc:
                        cfgs[key] = {"error": f"{type(exc).__name__}: {exc}"[:160]}
            ok = {k: v["us"] for k, v in cfgs.items() if v.get("bits_equal_first")}
            best = min(ok, key=ok.get) if ok else None
            row["splits"][str(s)] = {"best": best, "best_us": ok.get(best), "configs": cfgs}
            print("linear", M, N, K, dt, "split", s, "best", best, ok.get(best), flush=True)
        res[f"M{M}_N{N}_K{K}_{dt}"] = row
        ws = outs = None
        torch.cuda.empty_cache()
        out["save"]()
    out["results"]["linears_cold"] = res


def mix_section(a, model, out):
    import triton

    from bitmatch.kernels import order
    from bitmatch.kernels.triton import mhc
    from bitmatch.models import family_of, unwrap_causal_lm
    lm = unwrap_causal_lm(model)
    spec = family_of(model).build_spec(lm)
    hc = lm.model.layers[0].attn_hc
    T, n, d = a.decode_batch, spec.hc_mult, spec.hidden_size
    fn, base, scale, eps = hc.fn, hc.base, hc.scale, float(hc.input_norm.eps)
    res = {"T": T, "hc_mult": n, "hidden": d}
    xs = [torch.randn(T, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
    rows = {}
    for chunk in (1024, 512, 256):
        with order.override(hc_k_chunk=chunk):
            def mix(i):
                return lambda: mhc._mixes(xs[i], fn, False)

            def pre(i):
                return lambda: mhc.hc_pre(xs[i], fn, base, scale, spec.hc_iters, spec.hc_eps, eps)
            try:
                rows[str(chunk)] = {"mix_us": round(_cold_ms(mix, 3 * L2) * 1e3, 3),
                                    "hc_pre_us": round(_cold_ms(pre, 3 * L2) * 1e3, 3),
                                    "programs": triton.cdiv(T, mhc.BLOCK_T) * triton.cdiv(n * d, chunk)}
            except Exception as exc:
                rows[str(chunk)] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print("mix", chunk, rows[str(chunk)], flush=True)
    res["hc_k_chunk"] = rows
    out["results"]["mix"] = res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="mid", choices=("flash4", "mid"))
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--sections", default="step,linears,mix")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("deepseek_v4_decode_ops.py: needs a CUDA device")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"deepseek_v4_decode_ops_{a.config}.json")
    out = {"command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
           "machine": {**machine_info("cuda"), "platform": platform.platform()},
           "setup": {"config": a.config, "seq": a.seq, "decode_batch": a.decode_batch}, "results": {}}

    def save():
        with open(path, "w") as f:
            json.dump({k: v for k, v in out.items() if k != "save"}, f, indent=1)
    out["save"] = save
    sections = a.sections.split(",")
    model, eng = _engine(a)
    seq = _linear_sequence(eng)
    for name, fn in (("step", lambda: step_section(a, eng, out)), ("mix", lambda: mix_section(a, model, out)),
                     ("linears", lambda: linears_section(a, seq, out))):
        if name in sections:
            try:
                fn()
            except Exception as exc:  # one section's failure keeps the others' rows
                out.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:1000]
                print("ERROR", name, repr(exc), flush=True)
            save()
    print("wrote", path)


if __name__ == "__main__":
    main()

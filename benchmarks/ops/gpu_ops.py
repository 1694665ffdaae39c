"""bitmatch Triton backend on the GPU: invariance harness + timings against the stock ops.

One run does (a) invariance checks on CUDA along every axis (batch: row alone vs in a batch at
many M; schedule: prefill vs chunked prefill vs paged decode at page sizes 8/16/32/128 and
shuffled block tables; launch: tile configs / split vs fused modes), each with a control on the
stock op, and (b) timings (triton.testing.do_bench medians, random inputs, inputs rotated past
the L2 cache) of every op against the stock op, as ratios stock_time / bitmatch_time.

  python benchmarks/ops/gpu_ops.py --out DIR [--quick] [--only A,B] [--skip A,B] [--budget-s S] [--sweep]
writes DIR/gpu_ops.json (command, machine, versions, every ratio, every mismatch count), after
every section (a summary included), so a run cut short keeps what it measured. Needs the
package installed (``pip install --no-deps --no-build-isolation .``) and a CUDA device.

The sections live beside this runner, one file per op family: ops_attention.py
(inv_attention_variants, sweep_decode, time_attention_variants, attention_backward; the
single-variant inv_attention / time_attention on --only), ops_linear.py (time_linear,
time_linear_tma, inv_linear, cublas_nosplit), ops_rowwise.py (inv_rowwise, time_rowwise,
time_fwd_bwd_public); default order, most decision-relevant first. --sweep adds the linear tile
sweep that tunes kernels/triton/linear.py's table for a new GPU. The settled attention sweeps
(prefill tiles, rowsum16 prefill) are retired: their figures stay in benchmarks/results/h200.json.
"""
import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
from _common import Recorder, ceilings, geomean
from ops import ops_attention, ops_linear, ops_rowwise


def load_kernels():
    """The Triton backend's modules, from the installed package (no checkout aliasing)."""
    import importlib
    import types
    try:
        import bitmatch.kernels.triton  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"benchmarks/ops/gpu_ops.py needs bitmatch installed with Triton ({exc}); from the "
                         "checkout: python -m pip install --no-deps --no-build-isolation .") from exc
    return types.SimpleNamespace(**{m: importlib.import_module(f"bitmatch.kernels.triton.{m}") for m in
                                    ("linear", "norm", "rotary", "activation", "attention", "logprobs")})


def summarize(data):
    s = data["sections"]
    summ = {}
    if "time_linear" in s:
        small, large = [], []
        for name, r in s["time_linear"].items():
            for M, e in r.items():
                M = int(M)
                (small if M <= 256 else large if M >= 1024 else []).append(e["ratio"])
        summ["linear_geomean_M<=256"] = geomean(small)
        summ["linear_geomean_M>=1024"] = geomean(large)
        summ["linear_min_M>=1024"] = min(large) if large else None
    if "time_linear_tma" in s and "time_linear" in s:
        best = []
        for name, r in s["time_linear"].items():
            for M, e in r.items():
                if int(M) >= 1024:
                    t = s["time_linear_tma"].get(name, {}).get(str(M)) or s["time_linear_tma"].get(name, {}).get(M)
                    best.append(max(e["ratio"], t["best_ratio"]) if t else e["ratio"])
        summ["linear_geomean_M>=1024_best_of_table_and_tma"] = geomean(best)
        summ["linear_min_M>=1024_best_of_table_and_tma"] = min(best) if best else None
    if "time_linear_tma" in s and "time_linear" not in s:  # a TMA-only run: best per shape and M
        best = {f"{name}_M{M}": e["best_ratio"] for name, r in s["time_linear_tma"].items() for M, e in r.items()}
        summ["linear_tma_best_vs_cublas"] = best
        summ["linear_tma_best_vs_cublas_geomean"] = geomean(list(best.values()))
    if "cublas_nosplit" in s and "time_linear" in s:
        rs = {}
        for name, r in s["time_linear"].items():
            for M, e in r.items():
                t = s["cublas_nosplit"][name][str(M)] if str(M) in s["cublas_nosplit"][name] else None
                if t:
                    rs[f"{name}_M{M}"] = t / e["ours_ms"]
        summ["linear_vs_cublas_nosplit"] = rs
        summ["linear_vs_cublas_nosplit_geomean_M<=256"] = geomean(
            [v for k, v in rs.items() if int(k.split("_M")[1]) <= 256])
    def att_summary(a):
        out = {}
        if a.get("prefill"):
            out["prefill_ratio_min"] = min(e["ratio"] for e in a["prefill"].values())
            out["prefill_ratios"] = {k: e["ratio"] for k, e in a["prefill"].items()}
        if a.get("decode"):
            d = a["decode"]
            out["decode_vs_roofline_min"] = min(e["ratio_vs_roofline"] for e in d.values())
            out["decode_vs_roofline_geomean"] = geomean([e["ratio_vs_roofline"] for e in d.values()])
            out["decode_vs_roofline_geomean_kv_bytes>=64MiB"] = geomean(
                [e["ratio_vs_roofline"] for e in d.values() if e["roofline_ms"] * 4.3e9 >= 64 * 2 ** 20])
            out["decode_vs_sdpa_geomean"] = geomean([e["ratio_vs_sdpa"] for e in d.values()])
            out["decode_vs_roofline"] = {k: e["ratio_vs_roofline"] for k, e in d.items()}
        return out

    if "time_attention" in s:
        summ.update(att_summary(s["time_attention"]))
    for name, a in s.get("time_attention_variants", {}).items():
        if isinstance(a, dict) and "error" not in a:
            summ[f"attention_{name}"] = att_summary(a)
    for name, r in s.get("inv_attention_variants", {}).items():
        bad = 0
        if isinstance(r, dict) and "error" not in r:
            for w in ("window=None", "window=300"):
                x = r.get(w, {})
                bad += x.get("prefill_alone_vs_batch_rows", 0)
                bad += sum(m["rows"] for m in x.get("prefill_tiles_modes", {}).values())
                bad += sum(v.get("decode_rows_mismatch", 0) + v.get("chunked_rows_mismatch", 0)
                           + v.get("mixed_batch_rows_mismatch", 0)
                           for kk, v in x.items() if kk.startswith("page"))
            summ[f"inv_attention_{name}_mismatching_rows"] = bad
        else:
            summ[f"inv_attention_{name}_mismatching_rows"] = "error"
    if "attention_backward" in s and s["attention_backward"].get("time"):
        t = {k: e for k, e in s["attention_backward"]["time"].items() if isinstance(e, dict)}
        summ["attention_bwd_vs_sdpa_flash"] = {k: e["ratio_bwd"] for k, e in t.items()}
        summ["attention_fwd_bwd_vs_sdpa_flash"] = {k: e["ratio_fwd_bwd"] for k, e in t.items()}
        summ["attention_bwd_geomean"] = geomean([e["ratio_bwd"] for e in t.values()])
        cud = {k: e["sdpa_cudnn_bwd_ms"] / e["ours_bwd_ms"] for k, e in t.items() if "sdpa_cudnn_bwd_ms" in e}
        if cud:  # cuDNN: what HF's SDPA picks on Hopper
            summ["attention_bwd_vs_sdpa_cudnn"] = cud
            summ["attention_fwd_bwd_vs_sdpa_cudnn"] = {
                k: e["sdpa_cudnn_fwd_bwd_ms"] / e["ours_fwd_bwd_ms"] for k, e in t.items() if "sdpa_cudnn_bwd_ms" in e}
        summ["attention_fwd_bwd_geomean"] = geomean([e["ratio_fwd_bwd"] for e in t.values()])
    cd = s.get("attention_bwd_cudnn") or {}
    speed = {k: e["cudnn_speedup"] for k, e in cd.items() if isinstance(e, dict) and "cudnn_speedup" in e}
    if speed:  # our Triton backward's time / cuDNN's, both fed our forward's output and lse
        summ["attention_bwd_cudnn_over_triton"] = speed
    if "time_rowwise" in s:
        summ["rowwise_ratios"] = {k: v["ratio"] for k, v in s["time_rowwise"].items()}
    data["summary"] = summ


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip", default="", help="comma list of sections to skip")
    ap.add_argument("--only", default="", help="comma list of sections to run")
    ap.add_argument("--cublas-only", default=None)
    ap.add_argument("--sweep", action="store_true", help="also the linear tile sweep (ops_linear.sweep_linear)")
    ap.add_argument("--sweep-ms", default="", help="comma list of M for the linear sweep; "
                    "also fixes SPLIT to the table's (graph-timed tile sweep only)")
    ap.add_argument("--variants", default="", help="comma list of ATT_VARIANTS to run "
                    "(default: all, in table order)")
    ap.add_argument("--budget-s", type=float, default=0, help="skip the sections that would start "
                    "after this many seconds (0: no limit), so a device time limit never cuts the JSON")
    ap.add_argument("--tma-ms", default="", help="comma list of M for time_linear_tma (default "
                    "512,1024,4096,16384)")
    ap.add_argument("--bwd-cases", default="", help="comma list of SxB for the attention backward "
                    "tile sweep (default 4096x4)")
    ap.add_argument("--bwd-times", default="", help="comma list of S or SxB for the backward "
                    "timings (default 512,1024,2048,4096,8192; B = 16384 / S)")
    args = ap.parse_args()
    if args.bwd_times:
        ops_attention.BWD_TIME_S = tuple(tuple(int(x) for x in v.split("x")) if "x" in v else int(v)
                                         for v in args.bwd_times.split(","))
    if args.bwd_cases:
        ops_attention.BWD_SWEEP_CASES = [tuple(int(v) for v in c.split("x")) for c in args.bwd_cases.split(",")]
    if args.tma_ms:
        ops_linear.TMA_MS = tuple(int(m) for m in args.tma_ms.split(","))
    if args.sweep_ms:
        ops_linear.SWEEP_MS = [int(m) for m in args.sweep_ms.split(",")]
        ops_linear.SWEEP_FIXED_SPLIT = True
    if args.cublas_only:
        ops_linear.cublas_only(args.cublas_only)
        return
    if args.variants:
        keep = args.variants.split(",")
        for name in list(ops_attention.ATT_VARIANTS):
            if name not in keep:
                del ops_attention.ATT_VARIANTS[name]
    os.makedirs(args.out, exist_ok=True)
    rec = Recorder(os.path.join(args.out, "gpu_ops.json"), args)
    run_t0 = time.time()
    K = load_kernels()
    active = K.attention.order.current()
    rec.data["canonical"] = {"stamp": active.stamp("triton"), "linear_config_table": K.linear.CONFIG_TABLE,
                             "attention_min_block_m_cuda": active.min_block_m_cuda}
    skip = set(args.skip.split(",")) if args.skip else set()
    only = set(args.only.split(",")) if args.only else None

    def want(name):
        return name not in skip and (only is None or name in only)

    torch.manual_seed(0)
    ceil = {"copy_bw_TBps": 4.3, "bf16_mm_TFLOPs": 770}
    try:
        ceil = ceilings()
        rec.put("ceilings", ceil)
    except Exception:
        rec.err("ceilings")
    # most decision-relevant first: a run cut by the device time limit still returns its JSON
    A, L, R = ops_attention, ops_linear, ops_rowwise
    steps = [("inv_attention_variants", lambda: A.inv_attention_variants(K, args.quick)),
             ("sweep_decode", lambda: A.sweep_decode(K, ceil)),
             ("time_attention_variants", lambda: A.time_attention_variants(K, args.quick, ceil)),
             ("attention_backward", lambda: A.attention_backward(K, args.quick)),
             ("attention_bwd_cudnn", lambda: A.attention_bwd_cudnn(K)),
             ("time_linear", lambda: L.time_linear(K, args.quick)),
             ("time_linear_tma", lambda: L.time_linear_tma(K)),
             ("inv_linear", lambda: L.inv_linear(K, args.quick)),
             ("inv_rowwise", lambda: R.inv_rowwise(K)),
             ("time_rowwise", lambda: R.time_rowwise(K)),
             ("time_fwd_bwd_public", lambda: R.time_fwd_bwd_public(K)),
             ("cublas_nosplit", lambda: L.cublas_nosplit_subprocess(args.out)),
             ("inv_attention", lambda: A.inv_attention(K, args.quick)),
             ("time_attention", lambda: A.time_attention(K, args.quick, ceil)),
             ("sweep_linear", lambda: L.sweep_linear(K))]
    # the variant sections replace the single-variant ones unless asked for by --only
    default_skip = {"inv_attention", "time_attention", "attention_bwd_cudnn"}
    for name, fn in steps:
        if not want(name) or (name == "sweep_linear" and not args.sweep):
            continue
        if only is None and name in default_skip:
            continue
        if args.budget_s and time.time() - run_t0 > args.budget_s:
            rec.data.setdefault("skipped_for_time", []).append(name)
            rec.flush()
            continue
        t0 = time.time()
        try:
            v = fn()
            rec.put(name, v)
        except Exception:
            rec.err(name)
        print(f"== {name} done in {time.time() - t0:.1f}s", flush=True)
        rec.data.setdefault("section_seconds", {})[name] = time.time() - t0
        try:  # a summary after every section: a run cut short still has one
            summarize(rec.data)
        except Exception:
            rec.data["summary_error"] = traceback.format_exc()[-1000:]
        rec.flush()
    try:
        summarize(rec.data)
    except Exception:
        rec.data["summary_error"] = traceback.format_exc()[-1000:]
    rec.data["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rec.flush()
    print(json.dumps(rec.data.get("summary", {}), indent=1, default=str))


if __name__ == "__main__":
    main()

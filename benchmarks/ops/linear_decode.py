"""Decode-sized linear on the GPU: cuBLAS vs the current selection vs a tile/mode sweep.

  python benchmarks/ops/linear_decode.py --out DIR [--ms 16,64,128,256,512] [--budget-s 160] [--shapes tp]
writes DIR/linear_decode.json (command, machine, versions, commit, per launch shape and M).

Shapes are the launches the engine issues for Qwen3-8B and Qwen3-1.7B (bf16): fused q/k/v runs
as one launch per split group (``linear_segments``: 8B q (4096, 4096) split 2 and k+v (2048, 4096)
split 1; 1.7B q+k+v (4096, 2048)), then o_proj, fused gate_up, down and lm_head. The 8B fused qkv
call as a whole is timed too (cuBLAS on the (6144, 4096) weight vs ``linear_segments``).

Per (shape, M): cuBLAS ``F.linear``, ``linear`` as selected now (the table), and candidates:
pointer-kernel configs (split and fused mode where SPLIT > 1) and persistent-TMA configs. Every
candidate's output is compared with the table's (``torch.equal``, rows differing counted): a
candidate that differs is reported and never chosen. Tile shape and mode are speed knobs only.

Timing: one CUDA graph of 20 back-to-back calls, inputs rotated over enough weight/activation
copies that they exceed 3x L2 (each call reads its weight from HBM, as a decode step does); the
graph is replayed once warm and then 5 times between CUDA events; the median / 20 is reported.
L2 is not flushed between replays (the rotation already evicts it). Kernels are compiled first
by a pool of processes (Triton's disk cache), so compile time stays out of the device minutes.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
from _common import capture_graph, machine_info

BF = torch.bfloat16
L2 = 50 * 2 ** 20
CALLS = 20

# name: (N, K) of one launch as the engine issues it
SHAPES = {
    "8b.q_or_o (4096,4096)": (4096, 4096),
    "8b.kv (2048,4096)": (2048, 4096),
    "8b.gate_up (24576,4096)": (24576, 4096),
    "8b.down (4096,12288)": (4096, 12288),
    "8b.lm_head (151936,4096)": (151936, 4096),
    "1.7b.qkv (4096,2048)": (4096, 2048),
    "1.7b.o (2048,2048)": (2048, 2048),
    "1.7b.gate_up (12288,2048)": (12288, 2048),
    "1.7b.down (2048,6144)": (2048, 6144),
    "1.7b.lm_head (151936,2048)": (151936, 2048),
}

# a tensor-parallel rank's shard in the gather layout (bitmatch/parallel/sharder.py): N / TP output rows
# with the full K, run in the full weight's K split; timed against a stock rank, cuBLAS on the
# (N, K / TP) column slice of the all-reduce layout (the same multiply-adds)
TP_SHAPES = {f"8b.{name} tp{tp} ({n // tp},{k})": (n // tp, k, n, tp)
             for name, (n, k) in (("o_proj", (4096, 4096)), ("down", (4096, 12288))) for tp in (2, 4, 8)}

# pointer-kernel tiles (BM, BN, BK, GROUP_M, warps, stages) per M; mode added per SPLIT
PTR = {
    16: [(16, 32, 128, 8, 4, 6), (16, 64, 128, 8, 4, 4), (16, 64, 256, 8, 4, 3),
         (16, 128, 128, 8, 4, 4), (16, 64, 128, 8, 4, 6)],
    64: [(64, 64, 128, 8, 4, 4), (64, 64, 64, 8, 4, 6), (64, 128, 64, 8, 4, 4),
         (64, 128, 128, 8, 4, 3), (32, 64, 128, 8, 4, 4), (64, 64, 256, 8, 4, 3)],
    128: [(64, 128, 64, 8, 4, 4), (64, 64, 64, 8, 4, 6), (128, 128, 64, 8, 8, 3),
          (128, 64, 64, 8, 4, 4), (64, 128, 128, 8, 4, 3), (64, 256, 64, 8, 8, 3)],
    256: [(128, 128, 64, 8, 8, 3), (128, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4),
          (128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 128, 128, 8, 8, 3)],
}
PTR[512] = PTR[256] + [(256, 128, 64, 8, 8, 3)]
# persistent TMA tiles (BM, BN, BK, GROUP_M, warps, stages), all M
TMA = [(128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (256, 128, 64, 8, 8, 3),
       (64, 128, 64, 8, 4, 4), (64, 256, 64, 8, 4, 3), (64, 128, 128, 8, 4, 3),
       (128, 128, 128, 8, 8, 3), (64, 64, 128, 8, 4, 4), (128, 64, 64, 8, 4, 4)]


def candidates(M, split):
    """(kind, cfg) pairs for this M: kind "ptr" (cfg ends in mode) or "tma"."""
    modes = ("split", "fused") if split > 1 else ("fused",)
    bucket = min((m for m in PTR if m >= M), default=max(PTR))
    out = [("ptr", c + (mode,)) for c in PTR[bucket] for mode in modes]
    return out + [("tma", c) for c in TMA]


def _lin():
    from bitmatch.kernels.triton import linear as lin
    return lin


def call(lin, kind, cfg, x, w, split):
    if kind == "ptr":
        return lin._launch(x, w, None, cfg, split)
    if kind == "tma":
        return lin._launch_tma(x, w, None, cfg, split)
    if kind == "table":
        return lin.linear(x, w, None, split=split)
    return F.linear(x, w)


def _compile_one(task):
    """Worker: compile one kernel variant (fills Triton's disk cache); returns an error or None."""
    kind, cfg, N, K, split = task
    try:
        lin = _lin()
        x = torch.zeros(16, K, device="cuda", dtype=BF)
        w = torch.zeros(N, K, device="cuda", dtype=BF)
        call(lin, kind, cfg, x, w, split)
        torch.cuda.synchronize()
        return None
    except Exception as e:
        return repr(e)[:200]


def precompile(ms, workers, shapes):
    """Compile every variant once, in parallel processes. All swept N, K, M and strides are
    multiples of 16, so one representative shape per SPLIT hits the same specialization."""
    lin = _lin()
    reps = {}
    for N, K, *full in shapes.values():
        reps.setdefault(lin.split_for(full[0] if full else N, K), (N, K))
    tasks = set()
    for s, (N, K) in reps.items():
        for M in ms:
            for kind, cfg in candidates(M, s):
                tasks.add((kind, cfg, N, K, s))
    import concurrent.futures as cf
    import multiprocessing as mp
    t0 = time.time()
    errs = {}
    tasks = sorted(tasks, key=str)
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        for t, e in zip(tasks, ex.map(_compile_one, tasks)):
            if e is not None:
                errs[str(t[:2]) + f" split={t[4]}"] = e
    return {"variants": len(tasks), "seconds": round(time.time() - t0, 1), "errors": errs}


def time_graph(fns):
    """Median ms per call of CALLS calls (rotating over fns) captured in one CUDA graph."""
    g = capture_graph(fns, CALLS)
    g.replay()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / CALLS)
    del g
    return sorted(ts)[len(ts) // 2]


def rows_differing(a, b):
    return int((a != b).reshape(a.shape[0], -1).any(-1).sum().item())


def sweep_shape(lin, N, K, ms, deadline, full_n=None, tp=1):
    split = lin.split_for(full_n or N, K)
    wbytes = N * K * 2
    n = max(1, min(CALLS, math.ceil(3 * L2 / wbytes)))
    ws = [torch.randn(N, K, device="cuda", dtype=BF) * 0.02 for _ in range(n)]
    res = {"N": N, "K": K, "split": split, "weight_copies": n}
    for M in ms:
        if time.time() > deadline:
            res[str(M)] = {"skipped": "budget"}
            continue
        xs = [torch.randn(M, K, device="cuda", dtype=BF) for _ in range(n)]
        ref = call(lin, "table", None, xs[0], ws[0], split)
        tcfg = lin.tma_config_for(M, N, K)
        table_cfg = ("tma", tcfg) if tcfg is not None else ("ptr", lin.config_for(M, N, K))

        def t(kind, cfg):
            return time_graph([(lambda i=i: call(lin, kind, cfg, xs[i], ws[i], split)) for i in range(n)])

        e = {"table_config": [table_cfg[0], list(table_cfg[1])], "cublas_ms": t("cublas", None),
             "table_ms": t("table", None), "candidates": []}
        if tp > 1:  # the stock rank: cuBLAS on its K / TP columns of the full weight
            wk = [torch.randn(full_n, K // tp, device="cuda", dtype=BF) for _ in range(n)]
            xk = [x[:, :K // tp].contiguous() for x in xs]
            e["stock_rank_cublas_ms"] = time_graph([(lambda i=i: F.linear(xk[i], wk[i])) for i in range(n)])
            wk = xk = None
        best = None
        for kind, cfg in candidates(M, split):
            c = {"kind": kind, "cfg": list(cfg)}
            try:
                c["rows_differing"] = rows_differing(call(lin, kind, cfg, xs[0], ws[0], split), ref)
                c["ms"] = t(kind, cfg)
                if c["rows_differing"] == 0 and (best is None or c["ms"] < best["ms"]):
                    best = c
            except Exception as ex:
                c["error"] = repr(ex)[:200]
            e["candidates"].append(c)
        e["cublas_over_table"] = e["cublas_ms"] / e["table_ms"]
        if tp > 1:
            e["rank_over_stock_rank"] = min(e["table_ms"], best["ms"] if best else 1e9) / e["stock_rank_cublas_ms"]
        if best is not None:
            e["best"] = {"kind": best["kind"], "cfg": best["cfg"], "ms": best["ms"]}
            e["best_ms"] = best["ms"]
            e["cublas_over_best"] = e["cublas_ms"] / best["ms"]
            e["table_over_best"] = e["table_ms"] / best["ms"]
            e["winner"] = e["table_over_best"] > 1.03
        e["rows_differing_max"] = max((c.get("rows_differing", 0) for c in e["candidates"]), default=0)
        e["TFLOPs_best"] = 2 * M * N * K / (min(e["table_ms"], e.get("best_ms", 1e9)) * 1e-3) / 1e12
        e["weight_TBps_best"] = wbytes / (min(e["table_ms"], e.get("best_ms", 1e9)) * 1e-3) / 1e12
        print(f"N={N} K={K} M={M}: cublas {e['cublas_ms']:.4f} table {e['table_ms']:.4f} "
              f"best {e.get('best_ms', float('nan')):.4f} {e.get('best', {}).get('kind')} "
              f"{e.get('best', {}).get('cfg')} maxdiff {e['rows_differing_max']}", flush=True)
        res[str(M)] = e
        xs = ref = None  # frees them now (not del: t() reads xs)
    ws = None
    torch.cuda.empty_cache()
    return res


def fused_qkv_8b(lin, ms):
    """The engine's 8B q/k/v call as a whole: linear_segments vs cuBLAS on the fused weight."""
    w = [torch.randn(6144, 4096, device="cuda", dtype=BF) * 0.02 for _ in range(3)]
    out = {}
    for M in ms:
        xs = [torch.randn(M, 4096, device="cuda", dtype=BF) for _ in range(3)]
        cb = time_graph([(lambda i=i: F.linear(xs[i], w[i])) for i in range(3)])
        us = time_graph([(lambda i=i: lin.linear_segments(xs[i], w[i], None, (4096, 1024, 1024)))
                         for i in range(3)])
        out[str(M)] = {"cublas_ms": cb, "table_ms": us, "cublas_over_table": cb / us}
    return out


def tables_from_sweep(lin, data):
    """{(N, K): CONFIG_TABLES rows} with each swept M bucket's fastest bitwise-equal candidate
    (where it beat the table by > 3%): the bucket of M is (the next smaller swept M, M]; rows
    outside the swept buckets keep the table's configs. A TMA winner becomes a "tma" row."""
    out = {}
    for shape in data["shapes"].values():
        wins = {}
        for m, e in shape.items():
            if m.isdigit() and e.get("winner"):
                b = e["best"]
                cfg = tuple(b["cfg"][:6]) + ("tma",) if b["kind"] == "tma" else tuple(b["cfg"])
                wins[int(m)] = cfg
        if not wins:
            continue
        N, K = shape["N"], shape["K"]
        swept = sorted(int(m) for m, e in shape.items() if m.isdigit())
        lows = {m: (swept[i - 1] if i else m // 2) for i, m in enumerate(swept)}
        old = lin.CONFIG_TABLES.get((N, K)) or lin.CONFIG_TABLE
        ends = sorted({r[0] for r in old} | {m for m in wins} | {lows[m] for m in wins})
        rows = []
        for end in ends:
            w = next((c for m, c in wins.items() if lows[m] < end <= m), None)
            cfg = w or lin.config_for(end, N, K, BF)
            if rows and tuple(rows[-1][1:]) == tuple(cfg):
                rows[-1] = (end, *cfg)
            else:
                rows.append((end, *cfg))
        out[(N, K)] = rows
    return out


def apply_sweep(path):
    """Patch this process's linear tables with a sweep's winners (a benchmark's what-if: the
    bits do not change, only the tiles); returns the patched {(N, K): rows}."""
    lin = _lin()
    with open(path) as f:
        tables = tables_from_sweep(lin, json.load(f))
    lin.CONFIG_TABLES.update(tables)
    return {f"{n},{k}": [list(r) for r in rows] for (n, k), rows in tables.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default=None, help="default 16,64,128,256,512 (decode), 512,4096 (tp)")
    ap.add_argument("--shapes", default="decode", choices=("decode", "tp"),
                    help="decode: the engine's launches; tp: a tensor-parallel rank's shards (gather layout)")
    ap.add_argument("--budget-s", type=float, default=160)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--commit", default=os.environ.get("BITMATCH_COMMIT", "unknown"))
    a = ap.parse_args()
    t0 = time.time()
    ms = [int(m) for m in (a.ms or ("16,64,128,256,512" if a.shapes == "decode" else "512,4096")).split(",")]
    shapes = SHAPES if a.shapes == "decode" else TP_SHAPES
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "linear_decode.json")
    data = {"command": " ".join(sys.argv), "machine": machine_info("cuda"), "commit": a.commit,
            "timing": f"CUDA graph of {CALLS} calls, inputs rotated over copies > 3x L2, median "
                      "of 5 event-timed replays / 20; L2 not flushed", "shapes": {}}
    try:
        data["precompile"] = precompile(ms, a.workers, shapes)
    except Exception as e:  # serial compiles in the sweep instead
        data["precompile"] = {"error": repr(e)[:300]}
    print("precompile", data["precompile"], flush=True)
    lin = _lin()
    deadline = t0 + a.budget_s
    if a.shapes == "decode":
        data["fused_qkv_8b"] = fused_qkv_8b(lin, ms)
    for name, (N, K, *full) in shapes.items():
        data["shapes"][name] = sweep_shape(lin, N, K, ms, deadline, *full)
        data["elapsed_s"] = round(time.time() - t0, 1)
        data["tables_from_sweep"] = {f"{n},{k}": [list(r) for r in rows]
                                     for (n, k), rows in tables_from_sweep(lin, data).items()}
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
    print("wrote", path, "in", data["elapsed_s"], "s", flush=True)


if __name__ == "__main__":
    main()

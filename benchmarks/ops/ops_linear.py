"""The invariant linear on the GPU vs cuBLAS (bits and time): a section of benchmarks/ops/gpu_ops.py's run.

Invariance along the batch axis and over every tile config of the table (control: cuBLAS), times
against cuBLAS at Qwen3-8B's shapes (graph-timed and eager), the persistent TMA kernel, and cuBLAS
with split-K disabled (a subprocess with a one-byte workspace)."""
import json
import math
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
from _common import BF, DEV, L2, MS, SHAPES, bench, rows_mismatch


def inv_linear(K, quick):
    res = {}
    lin = K.linear
    for name, (N, Kd) in SHAPES.items():
        Mfull = 2048 if name == "lm_head" else 4096
        g = torch.Generator(device=DEV).manual_seed(1)
        x = torch.randn(Mfull, Kd, device=DEV, dtype=BF, generator=g)
        w = torch.randn(N, Kd, device=DEV, dtype=BF, generator=g) * 0.02
        full = lin.linear(x, w)
        full_cb = F.linear(x, w)
        r = {"ours": {}, "cublas_control": {}}
        for M in [1, 2, 3, 5, 8, 16, 32, 33, 64, 100, 128, 256, 512, 1024, 2048]:
            if M > Mfull:
                continue
            off = 7 if M + 7 <= Mfull else 0
            xs = x[off:off + M].contiguous()
            r["ours"][M] = rows_mismatch(lin.linear(xs, w), full[off:off + M])
            r["cublas_control"][M] = rows_mismatch(F.linear(xs, w), full_cb[off:off + M])
        # every config of the table on the full batch, and split vs fused if the shape splits
        S = lin.split_for(N, Kd)
        cfg_m = {}
        for row in lin.CONFIG_TABLE:
            cfg = row[1:]
            for mode in ("fused", "split"):
                c = cfg[:-1] + (mode,)
                out = lin._launch(x[:512].contiguous(), w, None, c, S)
                cfg_m[str(c)] = rows_mismatch(out, full[:512])
        r["configs_vs_table"] = cfg_m
        r["split"] = S
        r["ours_same_as_cublas_M_full"] = rows_mismatch(full, full_cb)
        r["cublas_rows_differing_from_ours_at_M"] = {
            M: rows_mismatch(F.linear(x[:M].contiguous(), w), full[:M])
            for M in (1, 4, 16, 64, 256, 1024, 1500, 2048) if M <= Mfull}
        res[name] = r
        del x, w, full, full_cb
        torch.cuda.empty_cache()
    return res
def time_linear(K, quick, ms=MS):
    lin = K.linear
    out = {}
    for name, (N, Kd) in SHAPES.items():
        wbytes = N * Kd * 2
        nw = 1 if wbytes >= 3 * L2 else math.ceil(3 * L2 / wbytes)
        ws = [torch.randn(N, Kd, device=DEV, dtype=BF) * 0.02 for _ in range(min(nw, 4))]
        r = {}
        for M in ms:
            xs = [torch.randn(M, Kd, device=DEV, dtype=BF) for _ in range(len(ws))]
            nbytes = wbytes + M * Kd * 2 + M * N * 2
            t_cb = bench(lambda i: (lambda: F.linear(xs[i % len(xs)], ws[i % len(ws)])), nbytes)
            t_us = bench(lambda i: (lambda: lin.linear(xs[i % len(xs)], ws[i % len(ws)])), nbytes)
            e_cb = bench(lambda i: (lambda: F.linear(xs[i % len(xs)], ws[i % len(ws)])), nbytes,
                         graph=False)
            e_us = bench(lambda i: (lambda: lin.linear(xs[i % len(xs)], ws[i % len(ws)])), nbytes,
                         graph=False)
            r[M] = {"cublas_ms": t_cb, "ours_ms": t_us, "ratio": t_cb / t_us,
                    "ours_TFLOPs": 2 * M * N * Kd / (t_us * 1e-3) / 1e12,
                    "eager_cublas_ms": e_cb, "eager_ours_ms": e_us, "eager_ratio": e_cb / e_us}
            print(f"linear {name} M={M}: cublas {t_cb:.4f} ours {t_us:.4f} ratio {t_cb / t_us:.3f}",
                  flush=True)
            xs = None  # frees the inputs now (not del: the timed lambdas read xs)
        out[name] = r
        ws = None
        torch.cuda.empty_cache()
    return out


# the trainer's unfused Qwen3-8B projections (k and v; gate and up), which the engine fuses
TRAIN_SHAPES = {"k_v": (1024, 4096), "gate_or_up": (12288, 4096)}


TMA_MS = (512, 1024, 4096, 16384)


def time_linear_tma(K, ms=None):
    """Persistent TMA kernel (same canonical order) vs the table kernel and cuBLAS at large M:
    bits against the table kernel's output at the same M (0 = equal), and graph-timed ratios."""
    lin = K.linear
    ms = ms or TMA_MS
    out = {}
    for name, (N, Kd) in {**SHAPES, **TRAIN_SHAPES}.items():
        wbytes = N * Kd * 2
        nw = 1 if wbytes >= 3 * L2 else math.ceil(3 * L2 / wbytes)
        ws = [torch.randn(N, Kd, device=DEV, dtype=BF) * 0.02 for _ in range(min(nw, 4))]
        S = lin.split_for(N, Kd)
        r = {}
        for M in ms:
            xs = [torch.randn(M, Kd, device=DEV, dtype=BF) for _ in range(len(ws))]
            nbytes = wbytes + M * Kd * 2 + M * N * 2
            cfg_t = lin.config_for(M, N, Kd)
            ref = lin._launch(xs[0], ws[0], None, cfg_t, S)
            e = {"cublas_ms": bench(lambda i: (lambda: F.linear(xs[i % len(xs)], ws[i % len(ws)])), nbytes),
                 "table_ms": bench(lambda i: (lambda: lin._launch(xs[i % len(xs)], ws[i % len(ws)], None,
                                                                  cfg_t, S)), nbytes),
                 "tma": {}}
            e["table_ratio"] = e["cublas_ms"] / e["table_ms"]
            for c in lin.TMA_CONFIGS + (lin.TMA_FLAT_CONFIGS if S == 1 else []):
                try:
                    o = lin._launch_tma(xs[0], ws[0], None, c, S)
                    bad = rows_mismatch(o, ref)
                    t = bench(lambda i: (lambda: lin._launch_tma(xs[i % len(xs)], ws[i % len(ws)], None,
                                                                 c, S)), nbytes)
                    e["tma"][str(c)] = {"ms": t, "ratio": e["cublas_ms"] / t, "rows_differing_from_table": bad}
                except Exception as ex:
                    e["tma"][str(c)] = {"error": repr(ex)[:300]}
            ok = {c: v["ratio"] for c, v in e["tma"].items() if "ratio" in v and v["rows_differing_from_table"] == 0}
            if ok:
                e["best_tma"] = max(ok, key=lambda c: ok[c])
                e["best_ratio"] = max(e["table_ratio"], ok[e["best_tma"]])
            else:
                e["best_ratio"] = e["table_ratio"]
            print("linear_tma", name, M, json.dumps(e)[:500], flush=True)
            r[M] = e
            xs = ref = None
        out[name] = r
        ws = None
        torch.cuda.empty_cache()
    return out
def cublas_nosplit_subprocess(out_dir):
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":16:8", CUBLASLT_WORKSPACE_SIZE="1")
    path = os.path.join(out_dir, "cublas_nosplit.json")
    subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_ops.py"),
                    "--cublas-only", path], env=env,
                   check=True, timeout=240)
    with open(path) as f:
        return json.load(f)
def cublas_only(path):
    out = {}
    for name, (N, Kd) in SHAPES.items():
        wbytes = N * Kd * 2
        nw = 1 if wbytes >= 3 * L2 else math.ceil(3 * L2 / wbytes)
        ws = [torch.randn(N, Kd, device=DEV, dtype=BF) * 0.02 for _ in range(min(nw, 4))]
        r = {}
        for M in MS:
            xs = [torch.randn(M, Kd, device=DEV, dtype=BF) for _ in range(len(ws))]
            r[M] = bench(lambda i: (lambda: F.linear(xs[i % len(xs)], ws[i % len(ws)])),
                         wbytes + M * Kd * 2)
        out[name] = r
        ws = None
        torch.cuda.empty_cache()
    with open(path, "w") as f:
        json.dump(out, f)


# ------------------------------------------------------------------ sweep (opt-in: gpu_ops.py --sweep)
# The tool that tunes kernels/triton/linear.py's config table for a new GPU: every candidate tile
# per M bucket, graph-timed, each one's bits checked against the others of the same split.
SWEEP_MS = MS
SWEEP_FIXED_SPLIT = False  # --sweep-ms: time only the given M with the table's own split
SWEEP_CFGS = {
    "small": [(16, 64, 128, 8, 4, 4), (16, 32, 256, 8, 4, 4), (16, 128, 128, 8, 4, 4),
              (32, 64, 128, 8, 4, 4), (16, 64, 256, 8, 4, 3), (16, 32, 128, 8, 4, 6),
              (16, 64, 64, 8, 4, 8), (32, 32, 256, 8, 4, 4)],
    "mid": [(64, 64, 128, 8, 4, 4), (64, 128, 64, 8, 4, 4), (128, 64, 64, 8, 4, 4),
            (128, 128, 64, 8, 8, 3), (64, 256, 64, 8, 8, 3), (128, 128, 64, 8, 4, 4),
            (64, 32, 128, 8, 4, 4), (64, 64, 64, 8, 4, 6), (128, 32, 128, 8, 4, 4)],
    "large": [(128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (256, 128, 64, 8, 8, 3),
              (128, 256, 64, 8, 8, 4), (128, 128, 128, 8, 8, 3)],
}


def sweep_linear(K, ms=None):
    ms = ms or SWEEP_MS
    lin = K.linear
    res = {}
    for name, (N, Kd) in SHAPES.items():
        w = torch.randn(N, Kd, device=DEV, dtype=BF) * 0.02
        wbytes = N * Kd * 2
        nw = 1 if wbytes >= 3 * L2 else min(4, math.ceil(3 * L2 / wbytes))
        ws = [w] + [torch.randn_like(w) for _ in range(nw - 1)]
        splits = [1, 2, 4] if name not in ("lm_head", "gate_up") else [1, 2]
        if name == "down":
            splits = [1, 2, 3, 4]
        r = {}
        for M in ms:
            bucket = "small" if M <= 32 else ("mid" if M <= 512 else "large")
            xs = [torch.randn(M, Kd, device=DEV, dtype=BF) for _ in ws]
            t_cb = bench(lambda i: (lambda: F.linear(xs[i % len(xs)], ws[i % len(ws)])),
                         wbytes + M * Kd * 2, rep=40, warmup=10)
            entry = {"cublas_ms": t_cb, "best": {}}
            if SWEEP_FIXED_SPLIT:
                splits = [lin.split_for(N, Kd)]
            for S in splits:
                ref = None
                best = None
                modes = ["fused"] + (["split"] if S > 1 and M <= 1024 else [])
                for cfg in SWEEP_CFGS[bucket]:
                    for mode in modes:
                        c = cfg + (mode,)
                        try:
                            o = lin._launch(xs[0], w, None, c, S)
                            if ref is None:
                                ref = o
                            same = bool(torch.equal(o, ref))
                            t = bench(lambda i: (lambda: lin._launch(xs[i % len(xs)], ws[i % len(ws)],
                                                                     None, c, S)),
                                      wbytes + M * Kd * 2, rep=40, warmup=10)
                        except Exception as e:
                            print("sweep fail", name, M, c, S, repr(e)[:200], flush=True)
                            continue
                        if best is None or t < best[0]:
                            best = (t, c, same)
                        if not same:
                            entry.setdefault("bit_mismatch_cfgs", []).append([S, list(c)])
                if best:
                    entry["best"][S] = {"ms": best[0], "cfg": best[1], "ratio": t_cb / best[0]}
            print("sweep", name, M, json.dumps(entry["best"]), flush=True)
            r[M] = entry
            xs = None
        res[name] = r
        w = ws = None
        torch.cuda.empty_cache()
    return res

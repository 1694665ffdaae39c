"""Helpers the benchmark scripts share (each runs as a script: its folder is on sys.path):
the results writer, machine info, timing (eager wall, CUDA-graph replay, kernel profile, host
profile, host syncs) and the measured ceilings. GPU figures only count from a CUDA run."""
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of a script's logic only
BF = torch.bfloat16
L2 = 60 * 2 ** 20  # H200 L2 (bytes): timed inputs rotate over enough copies to exceed 3x this
# Qwen3-8B's linear shapes (N, K) and the token counts the op benchmarks time
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288), "lm_head": (151936, 4096)}
MS = [1, 8, 32, 64, 128, 256, 512, 1024, 4096, 16384]


def machine_info(device=None) -> dict:
    """Versions, the device and the commit a result came from (written into every benchmark's JSON)."""
    import transformers
    import triton
    device = device or DEV
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine()}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sm_count=p.multi_processor_count, mem_gib=round(p.total_memory / 2 ** 30, 1))
        try:
            info["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:
            pass
    try:
        info["git_head"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                          cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
    except Exception:
        pass
    return info


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def empty_cache():
    if DEV == "cuda":
        torch.cuda.empty_cache()


class Recorder:
    """One JSON file, rewritten after every put: a run cut short keeps what it measured."""

    def __init__(self, path, args, extra=None):
        self.path = path
        self.data = {"command": "python " + " ".join(sys.argv), "args": vars(args),
                     "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "machine": machine_info(), "sections": {}, "errors": {}, **(extra or {})}
        self.flush()

    def put(self, key, value):
        self.data["sections"][key] = value
        self.flush()

    def err(self, key):
        self.data["errors"][key] = traceback.format_exc()[-3000:]
        print("ERROR in", key, traceback.format_exc(), flush=True)
        self.flush()

    def flush(self):
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1, default=str)


def cuda_ms(fn, iters=10, warmup=3):
    """Median wall ms of fn() over iters calls, synchronized (eager: launch overhead included)."""
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def top_kernels(fn, k=12):
    """The k CUDA kernels with the most self time in one call of fn (torch profiler), in ms."""
    from torch.profiler import ProfilerActivity, profile
    if DEV != "cuda":
        return None
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t:
            rows.append((t / 1e3, e.count, e.key[:90]))
    rows.sort(reverse=True)
    return {"total_kernel_ms": round(sum(r[0] for r in rows), 2),
            "top": [{"ms": round(t, 2), "calls": c, "name": n} for t, c, n in rows[:k]]}


def host_profile(fn, k=30):
    """Where the host spends one call of fn (cProfile, after a warm call): the k functions with the
    most own time, and the total. A step whose host time exceeds its kernel time is launch-bound."""
    import cProfile
    import pstats
    fn()
    sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    fn()
    prof.disable()
    sync()
    wall = (time.perf_counter() - t0) * 1e3
    st = pstats.Stats(prof)
    rows = sorted(((v[2], v[3], v[1], f"{os.path.basename(f[0])}:{f[1]}({f[2]})") for f, v in st.stats.items()),
                  reverse=True)
    return {"wall_ms_profiled": round(wall, 2), "host_ms": round(sum(r[0] for r in rows) * 1e3, 2),
            "top_own": [{"own_ms": round(t * 1e3, 2), "cum_ms": round(c * 1e3, 2), "calls": n, "fn": name}
                        for t, c, n, name in rows[:k]],
            "top_cum": [{"cum_ms": round(c * 1e3, 2), "calls": n, "fn": name}
                        for _, c, n, name in sorted(rows, key=lambda r: -r[1])[:k]]}


def host_syncs(fn, k=8):
    """Host syncs in one call of fn (torch's sync debug mode), with the k most frequent call sites."""
    import collections
    import warnings
    if DEV != "cuda":
        return None
    torch.cuda.set_sync_debug_mode(1)
    try:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            fn()
            sync()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    sites = collections.Counter(f"{os.path.basename(w.filename)}:{w.lineno}" for w in got
                                if "synchroniz" in str(w.message))
    return {"count": sum(sites.values()), "top_sites": sites.most_common(k)}


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None
def bench(make_fn, bytes_per_call, rep=100, warmup=25, n=None, graph=True):
    """Median ms per call. Inputs rotate over n copies (enough to exceed 3x L2). graph=True:
    the calls (>= 8 back to back over the rotated copies, or 1 if a call moves > 3x L2) are
    captured in one CUDA graph and the replay is timed with do_bench (which flushes L2 before
    each replay), so Python launch overhead is excluded for both sides; graph=False: plain
    do_bench of one eager call (includes launch overhead)."""
    import triton
    if n is None:
        n = 1 if bytes_per_call >= 3 * L2 else min(16, math.ceil(3 * L2 / max(bytes_per_call, 1)))
    fns = [make_fn(i) for i in range(n)]
    if graph:
        try:
            calls = 1 if bytes_per_call >= 3 * L2 else max(n, 8)
            st = torch.cuda.Stream()
            st.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(st):
                for f in fns:
                    f()
            torch.cuda.current_stream().wait_stream(st)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(calls):
                    fns[i % n]()
            t = triton.testing.do_bench(g.replay, warmup=warmup, rep=rep, return_mode="median")
            del g
            return t / calls
        except Exception as e:  # fall back to eager timing, recorded by the caller's key
            print("graph capture failed, eager timing:", repr(e)[:200], flush=True)
            torch.cuda.synchronize()
    state = [0]

    def run():
        fns[state[0] % n]()
        state[0] += 1

    return triton.testing.do_bench(run, warmup=warmup, rep=rep, return_mode="median")


def ceilings():
    """The measured copy bandwidth and bf16 matmul rate of this device (the rooflines' ceilings)."""
    a = torch.empty(2 * 2 ** 30, dtype=torch.uint8, device=DEV).random_()
    b = torch.empty_like(a)
    import triton
    t = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=50, return_mode="median")
    bw = 2 * a.numel() / (t * 1e-3)
    a = b = None
    x = torch.randn(8192, 8192, device=DEV, dtype=BF)
    y = torch.randn(8192, 8192, device=DEV, dtype=BF)
    t2 = triton.testing.do_bench(lambda: x @ y, warmup=10, rep=50, return_mode="median")
    return {"copy_bw_TBps": bw / 1e12, "bf16_mm_TFLOPs": 2 * 8192 ** 3 / (t2 * 1e-3) / 1e12}


def rows_mismatch(a, b):
    """Rows of a that differ from b in any element's bits (==: the bits of finite values)."""
    return int((a != b).reshape(a.shape[0], -1).any(-1).sum().item())


def triton_bench(fn, rep=60, warmup=15):
    """Eager median (do_bench flushes L2 before each call); for ms-scale autograd calls."""
    import triton
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")

"""Helpers the benchmark scripts share (each script puts benchmarks/, this file's folder, on sys.path):
the results writer, machine info, timing (eager wall, CUDA-graph replay, kernel profile, host
profile, host syncs) and the measured ceilings. GPU figures only count from a CUDA run."""
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import types

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
    import gc
    gc.collect()   # a failed run's frames (its models) go now, not at some later collection
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
def capture_graph(fns, calls):
    """One CUDA graph of ``calls`` calls rotating over ``fns`` (each warmed once on a side stream
    first, as torch asks)."""
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
            fns[i % len(fns)]()
    return g


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
            g = capture_graph(fns, calls)
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


# the decode rooflines' bandwidth per card: what the project has used for the H200 since its first
# runs, and the H100 SXM's nominal HBM3 rate (a roofline at the H200's rate would flatter an H100)
HBM_TBPS = {"H200": 4.3, "H100": 3.35}


def hbm_tbps(given=None) -> float:
    """The roofline bandwidth: ``given`` (--hbm-tbps) or this card's entry in HBM_TBPS."""
    if given is not None:
        return float(given)
    if DEV != "cuda":
        return HBM_TBPS["H200"]  # a CPU smoke run: the script's logic only
    name = torch.cuda.get_device_name()
    for card, v in HBM_TBPS.items():
        if card in name:
            return v
    raise SystemExit(f"no roofline bandwidth known for {name!r}: pass --hbm-tbps")


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


def load_mamba_ssm(src):
    """(ssd_combined, selective_state_update modules, note) from an unpacked mamba-ssm sdist at
    ``src`` (its Triton kernels need only torch, triton and einops): the package and its ops
    folders enter sys.modules as stubs, so the package's __init__ (which imports the compiled
    selective_scan_cuda) never runs; modules None when not importable. Done before transformers
    imports a Mamba model, HF's kernel lookup finds these Triton kernels too."""
    if not src:
        return None, None, "no --mamba-src given"
    root = os.path.abspath(src)
    pkg = os.path.join(root, "mamba_ssm")
    if not os.path.isdir(pkg):
        return None, None, f"{pkg} is not a directory"
    sys.path.insert(0, root)
    for name, path in (("mamba_ssm", pkg), ("mamba_ssm.ops", os.path.join(pkg, "ops")),
                       ("mamba_ssm.ops.triton", os.path.join(pkg, "ops", "triton"))):
        if name not in sys.modules:  # a stub: its __init__ (compiled extensions) never runs
            mod = types.ModuleType(name)
            mod.__path__ = [path]
            sys.modules[name] = mod
    try:
        import mamba_ssm.ops.triton.selective_state_update as ssu
        import mamba_ssm.ops.triton.ssd_combined as ssd
    except Exception as exc:  # noqa: BLE001 - reported in the JSON, the rest still runs
        return None, None, f"import failed: {exc!r}"
    info = os.path.join(root, "PKG-INFO")
    lines = []
    if os.path.exists(info):
        with open(info) as f:
            lines = f.read().splitlines()
    ver = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Version:")), "?")
    return ssd, ssu, f"mamba_ssm {ver} from {root}"



def override_scan_config(ssd_mod, over: dict, applies, flag: str):
    """Swap ``ssd_mod.config_for`` (the Triton Mamba scan's) for one that merges ``over`` into the
    configs of the calls ``applies(dtype, kw)`` picks; returns the original, to restore. A key the
    config does not have is refused, naming ``flag``: the launcher reads only its own keys, so a
    misspelled knob would time the default silently."""
    base = ssd_mod.config_for
    unknown = set(over) - set(base(torch.bfloat16, 64, 128, 128))
    if unknown:
        raise SystemExit(f"{flag}: unknown scan config keys {sorted(unknown)}")
    ssd_mod.config_for = lambda dtype, *a, **kw: (
        {**base(dtype, *a, **kw), **over} if applies(dtype, kw) else base(dtype, *a, **kw))
    return base

# ------------------------------------------------------------------ engine runs (rollout benchmarks)
def engine(model, device, **kw):
    """A bitmatch.Engine; on CPU its decode steps run the graph simulation (the CPU tests' one)."""
    import bitmatch
    eng = bitmatch.Engine(model, **kw)
    if device.type == "cpu" and not kw.get("enforce_eager"):
        eng.model_runner.simulate_buckets = True
    return eng


def graph_use(eng):
    r = eng.model_runner
    if r.graphs is not None:
        return {"captures": r.graphs.num_captures, "replays": r.graphs.num_replays}
    return {"graphs": None, "simulated_steps": r.num_simulated_steps}


DIFF_CONFIGS = (("64 seqs, chunked 512", dict(max_num_seqs=64, max_num_batched_tokens=512)),
                ("3 seqs, block 32, 97-token steps", dict(max_num_seqs=3, max_num_batched_tokens=97, block_size=32)))


def engine_diff(model, hf, prompts, device, temperature, n_new, control=None,
                control_key="control_stock_hf_mismatches"):
    """The engine's sampled-token logprobs vs ``bitmatch.token_logprobs(model)`` of the same sequences in
    other batches and order, at each of DIFF_CONFIGS; the control (want > 0) is stock ``hf``'s
    log-softmax, or ``control(ids, mask)``: token logprobs aligned as token_logprobs' (another trainer)."""
    import bitmatch
    from bitmatch.testing.models import pad_batch

    if control is None and hf is not None:
        def control(ids, mask):
            lp = torch.log_softmax(hf(input_ids=ids, attention_mask=mask).logits.float() / temperature, -1)
            return lp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    rows = []
    for label, kw in DIFF_CONFIGS:
        eng = engine(model, device, kv_cache_bytes=1 << 30, **kw)
        params = [bitmatch.SamplingParams(temperature=temperature, max_tokens=n_new, ignore_eos=True, seed=i)
                  for i in range(len(prompts))]
        outs = eng.generate(prompts, params, use_tqdm=False)
        seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
        mism = tot = ctrl = 0
        for s in range(0, len(outs), 5):
            idx = list(range(s, min(s + 5, len(outs))))[::-1]   # other batch, other order than the engine's
            ids, mask = pad_batch([seqs[i] for i in idx], "right")
            ids, mask = ids.to(device), mask.to(device)
            with torch.no_grad():
                lp = bitmatch.token_logprobs(model, ids, mask, temperature=temperature)
                other = None if control is None else control(ids, mask)
            for b, i in enumerate(idx):
                o = outs[i]
                p, c = len(o.prompt_token_ids), len(o.outputs[0].token_ids)
                got = torch.tensor(o.outputs[0].logprobs, device=device)
                mism += int((got != lp[b, p - 1:p + c - 1]).sum())
                if other is not None:
                    ctrl += int((got != other[b, p - 1:p + c - 1]).sum())
                tot += c
        r = eng.model_runner  # graphs (or their CPU simulation) replayed: the engine may run a mode eagerly
        on = bool(r.graphs.num_replays) if r.graphs is not None else r.num_simulated_steps > 0
        rows.append({"config": label, "graphs_on": on, "tokens": tot, "mismatches": mism,
                     control_key: ctrl if control is not None else None, **graph_use(eng)})
        print("diff", rows[-1], flush=True)
        eng.close()
    return rows


def engine_run(eng, prompts, params):
    """(wall s, per-step ms, [(tokens, logprobs)] in request order) of one generate, stepped by hand."""
    ids = [eng.add_request(p, params(i)) for i, p in enumerate(prompts)]
    sync()
    t0 = time.perf_counter()
    steps, done = [], {}
    while eng.has_unfinished_requests():
        s = time.perf_counter()
        for o in eng.step():  # the requests that finished in this step
            done[o.request_id] = (list(o.outputs[0].token_ids), list(o.outputs[0].logprobs))
        sync()
        steps.append((time.perf_counter() - s) * 1e3)
    return time.perf_counter() - t0, steps, [done[i] for i in ids]


def decode_ms(steps, n_new):
    dec = steps[1:n_new]  # step 0 is the whole prefill (the step budget holds every prompt)
    return statistics.median(dec) if dec else None


def step_syncs(eng, prompts, params):
    """Host syncs of one pure-decode step (torch's sync debug mode)."""
    for i, p in enumerate(prompts):
        eng.add_request(p, params(i))
    eng.step()
    eng.step()
    res = host_syncs(eng.step)
    while eng.has_unfinished_requests():
        eng.step()
    return res


def hf_generate(hf, ids, n_new):
    sync()
    t0 = time.perf_counter()
    hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new,
                do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    sync()
    return time.perf_counter() - t0


def rollout_row(graphs, eager, hf, ids, n_new, device, params, warm, extra=None) -> dict:
    """One rollout batch (prompts ``ids`` [B, L], ``n_new`` tokens each, ``params(i)`` per request):
    the engine with decode graphs (twice warmed: compiles, captures), the same engine eager (and
    whether its outputs equal the graphs' bit for bit), ``extra(prompts)`` (more keys, e.g. a stock
    variant of the engine), then HF ``generate``; wall times, decode step medians, tokens/s, ratios."""
    B, L = ids.shape
    prompts = ids.tolist()
    r = {"B": B, "prompt_len": L, "new_tokens": n_new}
    with torch.no_grad():
        engine_run(graphs, prompts, warm)
        engine_run(graphs, prompts, warm)
        wall, steps, toks_g = engine_run(graphs, prompts, params)
        r.update(graphs_wall_s=wall, graphs_decode_ms=decode_ms(steps, n_new), prefill_step_ms=steps[0],
                 graphs=graph_use(graphs))
        engine_run(eager, prompts, warm)
        wall, steps, toks_e = engine_run(eager, prompts, params)
        r.update(eager_wall_s=wall, eager_decode_ms=decode_ms(steps, n_new),
                 graphs_vs_eager_bits_equal=toks_g == toks_e)
        if extra is not None:
            r.update(extra(prompts))
        hf_generate(hf, ids[:, :16].to(device), 2)
        r["hf_generate_wall_s"] = hf_generate(hf, ids.to(device), n_new)
    toks = B * n_new
    r.update(tokens_per_s=toks / r["graphs_wall_s"], eager_tokens_per_s=toks / r["eager_wall_s"],
             hf_generate_tokens_per_s=toks / r["hf_generate_wall_s"],
             vs_hf_generate=r["hf_generate_wall_s"] / r["graphs_wall_s"],
             graphs_vs_eager=r["eager_wall_s"] / r["graphs_wall_s"])
    return r

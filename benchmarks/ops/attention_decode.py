"""Decode attention on the GPU: the old kernel vs the current one, side by side in one run.

Qwen3-8B head shapes (32 q heads, 8 kv heads, head_dim 128, bf16), a paged cache of 16-token
pages behind a shuffled block table, every sequence at the same context. Each variant is timed
as a CUDA graph of many decode launches (warm, median of replays; inputs rotated so small cases
do not sit in L2) and reported as a fraction of the K/V-read floor: bytes = B*ctx*Hkv*D*2*2 over
the device-to-device copy bandwidth measured in the same run (and over 4.3 TB/s nominal).
Checks, on CUDA: old == new bits on every case and launch config; decode row == the prefill
kernel's last row of the same sequence (contiguous K/V); a graph captured for max_seq_len 8192
(16 partitions, mostly empty) == the exact-length launch; SDPA (fp32) within tolerance.

Usage (device): python3 benchmarks/ops/attention_decode.py --out DIR --old OLD_attention.py
OLD_attention.py: the previous kernels/triton/attention.py (git show REV:kernels/triton/attention.py).
"""
import argparse
import functools
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
from _common import capture_graph

HQ, HKV, D, PAGE = 32, 8, 128, 16
NOMINAL_TBPS = 4.3


def load_old(path):
    """The old kernel module, imported inside bitmatch.kernels.triton so its relative imports work."""
    name = "bitmatch.kernels.triton._attention_old"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def copy_bandwidth():
    """Device-to-device copy of 2 GiB: (read + write) bytes / time, TB/s."""
    x = torch.empty(2 ** 30, dtype=torch.int16, device="cuda").random_()
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    del x, y
    return 2 * 2 ** 31 / statistics.median(ts) / 1e12


def make_case(B, ctx, nrot, seed):
    """nrot independent (q, block table) sets over one cache; seq_lens all = ctx."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    per = -(-ctx // PAGE)
    nblocks = nrot * B * per
    kc = torch.randn(nblocks, PAGE, HKV, D, device="cuda", generator=g).to(torch.bfloat16)
    vc = torch.randn(nblocks, PAGE, HKV, D, device="cuda", generator=g).to(torch.bfloat16)
    perm = torch.randperm(nblocks, device="cuda", generator=g).to(torch.int32)
    bts = [perm[i * B * per:(i + 1) * B * per].view(B, per).contiguous() for i in range(nrot)]
    qs = [torch.randn(B, HQ, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(nrot)]
    sl = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    return kc, vc, bts, qs, sl


def time_graph(fn, nrot, n_launch, replays=8):
    """Median ms per launch of a CUDA graph holding n_launch calls fn(i % nrot)."""
    fn(0)
    torch.cuda.synchronize()
    graph = capture_graph([functools.partial(fn, i) for i in range(nrot)], n_launch)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / n_launch)
    del graph
    return statistics.median(ts)


def sdpa_err(out, q, kc, vc, bt, ctx, scale, rows=4):
    """max |ours - SDPA fp32| over the first rows sequences."""
    err = 0.0
    for b in range(rows):
        k = kc[bt[b].long()].reshape(-1, HKV, D)[:ctx].float()
        v = vc[bt[b].long()].reshape(-1, HKV, D)[:ctx].float()
        k = k.repeat_interleave(HQ // HKV, 1).transpose(0, 1)
        v = v.repeat_interleave(HQ // HKV, 1).transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(q[b].float()[:, None], k, v, scale=scale)
        err = max(err, (out[b].float() - ref[:, 0]).abs().max().item())
    return err


def prefill_mismatch(att, q, kc, vc, bt, ctx, scale, out, rows=2):
    """Decode rows vs the contiguous prefill kernel's last row (elements differing)."""
    bad = 0
    for b in range(rows):
        k = kc[bt[b].long()].reshape(-1, HKV, D)[:ctx].contiguous()
        v = vc[bt[b].long()].reshape(-1, HKV, D)[:ctx].contiguous()
        qf = torch.randn(ctx, HQ, D, device="cuda").to(torch.bfloat16)
        qf[-1] = q[b]
        cu = torch.tensor([0, ctx], dtype=torch.int32, device="cuda")
        ref = att.attention_prefill(qf, k, v, cu, scale, True, None, max_seqlen=ctx)
        bad += int((ref[-1] != out[b]).sum())
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--old", help="the previous kernels/triton/attention.py")
    ap.add_argument("--old-commit", default="")
    ap.add_argument("--commit", default="")
    ap.add_argument("--configs", default="4x3,4x4,8x3,8x4", help="num_warps x num_stages of the new kernel")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--ctxs", default="512,2048,8192")
    args = ap.parse_args()
    from bitmatch.kernels.triton import attention as new
    old = load_old(args.old) if args.old else None
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",") if c]
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.3f} TB/s", flush=True)
    scale = D ** -0.5
    cases = [(B, ctx, ctx) for B in map(int, args.batches.split(",")) for ctx in map(int, args.ctxs.split(","))]
    cases += [(64, 544, 8192), (256, 544, 8192)]   # the engine's graphs: captured for 8192, ctx ~544
    res = {}
    for B, ctx, cap in cases:
        kv_bytes = B * ctx * HKV * D * 2 * 2
        nrot = max(1, min(128, -(-200 * 2 ** 20 // kv_bytes)))
        kc, vc, bts, qs, sl = make_case(B, ctx, nrot, seed=B * 10007 + ctx)
        floor_ms = kv_bytes / (bw * 1e12) * 1e3
        n_launch = max(4, min(200, int(10 / max(floor_ms, 1e-3))))
        r = {"B": B, "ctx": ctx, "max_seq_len": cap, "kv_bytes": kv_bytes, "floor_ms": floor_ms,
             "floor_nominal_ms": kv_bytes / (NOMINAL_TBPS * 1e12) * 1e3, "launches_per_graph": n_launch}

        def call(mod, launch=None):
            kw = {} if launch is None else {"launch": launch}
            return lambda i: mod.attention_decode(qs[i], kc, vc, bts[i], sl, scale, max_query_len=1,
                                                  max_seq_len=cap, **kw)
        ref = call(new)(0)
        if old is not None:
            o = call(old)(0)
            r["old_vs_new_elements_differing"] = int((o != ref).sum())
            r["old_ms"] = time_graph(call(old), nrot, n_launch)
            r["old_frac_floor"] = floor_ms / r["old_ms"]
        r["new"] = {}
        for w, st in configs:
            launch = dict(num_warps=w, num_stages=st)
            try:
                o = call(new, launch)(0)
                t = time_graph(call(new, launch), nrot, n_launch)
                r["new"][f"w{w}s{st}"] = {"ms": t, "frac_floor": floor_ms / t,
                                          "elements_differing_from_default": int((o != ref).sum())}
            except Exception as e:  # a config that does not fit (shared memory) is reported
                r["new"][f"w{w}s{st}"] = repr(e)[:200]
        dflt = f"w{new.DECODE_WARPS}s{new.DECODE_STAGES}"
        if not isinstance(r["new"].get(dflt), dict):
            r["new"][dflt] = {"ms": time_graph(call(new), nrot, n_launch), "elements_differing_from_default": 0}
            r["new"][dflt]["frac_floor"] = floor_ms / r["new"][dflt]["ms"]
        r["new_default_ms"] = r["new"][dflt]["ms"]
        r["new_default_frac_floor"] = r["new"][dflt]["frac_floor"]
        if cap != ctx:
            exact = new.attention_decode(qs[0], kc, vc, bts[0], sl, scale, max_query_len=1, max_seq_len=ctx)
            r["capture_len_vs_exact_elements_differing"] = int((exact != ref).sum())
        if B >= 2 and ctx <= 2048:
            r["decode_vs_prefill_elements_differing"] = prefill_mismatch(new, qs[0], kc, vc, bts[0], ctx,
                                                                         scale, ref)
        r["sdpa_fp32_max_abs_err"] = sdpa_err(ref, qs[0], kc, vc, bts[0], ctx, scale, rows=min(B, 4))
        res[f"B{B}_ctx{ctx}_cap{cap}"] = r
        best = max((v["frac_floor"] for v in r["new"].values() if isinstance(v, dict)), default=0)
        print(f"B={B:4d} ctx={ctx:5d} cap={cap:5d} floor {floor_ms * 1e3:8.1f} us | old "
              f"{r.get('old_frac_floor', 0):.3f} | new default {r['new_default_frac_floor']:.3f} best {best:.3f} "
              f"| diff old/new {r.get('old_vs_new_elements_differing')} sdpa {r['sdpa_fp32_max_abs_err']:.2e} "
              f"prefill {r.get('decode_vs_prefill_elements_differing')} "
              f"cap {r.get('capture_len_vs_exact_elements_differing')}",
              flush=True)
        for k in [k for k, v in r["new"].items() if isinstance(v, dict)]:
            print(f"    {k}: {r['new'][k]['ms'] * 1e3:8.1f} us {r['new'][k]['frac_floor']:.3f} "
                  f"diff {r['new'][k]['elements_differing_from_default']}", flush=True)
        kc = vc = bts = qs = None  # frees them now (not del: call() reads these names)
        torch.cuda.empty_cache()
    commit = args.commit
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except OSError:
            commit = ""
    import triton
    doc = {"command": " ".join(sys.argv), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": {"gpu": torch.cuda.get_device_name(), "host": platform.node(),
                       "copy_bandwidth_TBps": bw},
           "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
           "git_commit": commit, "old_commit": args.old_commit,
           "defaults": {"DECODE_WARPS": new.DECODE_WARPS, "DECODE_STAGES": new.DECODE_STAGES},
           "shapes": {"Hq": HQ, "Hkv": HKV, "D": D, "page": PAGE, "dtype": "bfloat16"}, "cases": res}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "attention_decode_h200.json"), "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()

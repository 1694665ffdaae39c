"""The sampler on the GPU: the fused Triton categorical_sample against the torch reference.

  python benchmarks/ops/sampler.py --out DIR [--batches 1,64,256] [--reps 30]
writes DIR/sampler.json (command, machine, versions, commit, every check and timing).

Checks, per batch size B at V = 151,936 (bf16 logits, per-row std 3-5, some peaky rows, mixed T):
- bits: the Triton kernel's int64 weights == torch-on-CUDA's (``_int_weights``) on every entry;
  tokens Triton == torch-on-CUDA on every row, == the CPU reference on a few rows copied over;
  uniforms u ~ U[0,1), u at 0 and just below 1, and u on both sides of cdf boundaries (where a
  weight off by one unit changes the token); greedy rows == torch argmax; BLOCK 1024/2048/4096
  and 1/3/64 chunks per row give the same tokens (speed knobs); exp64's float64 bits and top-p's
  int64 weights over sorted rows (Triton int_weights) == torch on CUDA; top_k_top_p_mask == CPU.
- control: the same kernels compiled with FMA contraction on (enable_fp_fusion=True: exp64's
  float64 bits and the int64 weights) and the x * (1/T) variant: mismatches counted (checks
  that can fail).
- capture: Sampler.device_step captured in a CUDA graph (mixed greedy / top-k / top-p / T
  rows) and replayed == eager.
Timings (CUDA events, warm, median of --reps): ``Sampler.__call__``, ``device_step`` alone, its
CUDA-graph replay, and the bare kernel vs the torch weights path. (The sampler before its
host/device split is frozen once, in tests/test_sampler_triton.py; its times against the split
one stay in benchmarks/results/sampler_h200*.json.)
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

import bitmatch.kernels as K
from bitmatch.engine.sampling import Sampler, SamplingParams, reported_logprobs
from bitmatch.kernels import sampling as S
from bitmatch.kernels.triton import sampling as TS

V = 151936
F64 = torch.float64


def make_logits(b, gen, dev):
    std = 3.0 + 2.0 * torch.rand(b, 1, generator=gen)
    x = torch.randn(b, V, generator=gen) * std
    peaky = (torch.rand(b, generator=gen) < 0.3).tolist()  # confident rows: a few tokens far ahead
    spikes = torch.randint(0, V, (b, 3), generator=gen)
    for i in range(b):
        if peaky[i]:
            x[i, spikes[i]] += torch.tensor([25.0, 20.0, 18.0])
    x[0, 1000:1003] = x[0].max() + 1.0  # ties at the max (greedy: lowest index)
    return x.to(torch.bfloat16).to(dev)


def params_for(b, kind):
    if kind == "plain":
        return [SamplingParams(temperature=1.0) for _ in range(b)]
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
             SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_p=0.95),
             SamplingParams(temperature=1.3)]
    return [kinds[i % len(kinds)] for i in range(b)]


def time_ms(fn, reps, host=False):
    """Median ms over reps (after 3 warm calls): CUDA events, or a host clock around a sync."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        if host:
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) * 1e3)
        else:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def boundary_uniforms(logits, temps, rows):
    """u just below and just above a cdf boundary of each row (torch weights): a token that moves
    by one position if any weight before the boundary is off by a unit."""
    z = S.scaled_logits(logits[rows], temps[rows])
    w = S._int_weights(z, z.amax(-1, keepdim=True), S._weight_bits(V))
    cdf = torch.cumsum(w, -1)
    total = cdf[:, -1]
    # the boundary after the row's most probable token and after a random low-probability one
    js = torch.stack([w.argmax(-1), torch.randint(0, V - 1, (len(rows),), device=logits.device)], 1)
    c = cdf.gather(1, js).to(F64)
    tot = total.to(F64).unsqueeze(1)
    u = torch.cat([(c - 0.5) / tot, (c + 0.5) / tot], 1)  # r = c - 1 (token j), r = c (token j+1)
    return u.reshape(-1), [r for r in rows for _ in range(4)]


def _splits_same(logits, temps, u, bits, tok, ref):
    """Tokens for several chunk counts per row (a speed knob), sampled and greedy rows."""
    b = logits.shape[0]
    g = torch.arange(b, device=logits.device) % 3 == 0
    ref_g = torch.where(g, logits.float().argmax(-1), ref)
    return all(torch.equal(TS.categorical_sample(logits, temps, u, None, bits, split=sp), tok) and
               torch.equal(TS.categorical_sample(logits, temps, u, g, bits, split=sp), ref_g) for sp in (1, 3, 64))


def check_batch(b, gen, dev, res):
    logits = make_logits(b, gen, dev)
    temps = torch.tensor([[0.6, 0.8, 1.0, 1.3, 0.9][i % 5] for i in range(b)], dtype=torch.float32, device=dev)
    u = K.uniform_noise(torch.arange(b, device=dev) * 7919 + 3, torch.full((b,), 5, device=dev))
    u[0] = 0.0
    if b > 1:
        u[1] = 1.0 - 2.0 ** -53
    bits = S._weight_bits(V)
    tok, w = TS.categorical_sample(logits, temps, u, None, bits, return_weights=True)
    ref = S.categorical_sample_reference(logits, temps, u)
    z = S.scaled_logits(logits, temps)
    w_ref = S._int_weights(z, z.amax(-1, keepdim=True), bits)
    r = {"B": b, "weights_mismatch_vs_torch_cuda": int((w != w_ref).sum()),
         "tokens_mismatch_vs_torch_cuda": int((tok != ref).sum()),
         "tokens_via_public_op_equal": bool(torch.equal(K.categorical_sample(logits, temps, u), tok))}
    rows = list(range(min(b, 6)))
    cpu = S.categorical_sample_reference(logits[rows].cpu(), temps[rows].cpu(), u[rows].cpu())
    r["cpu_rows"] = len(rows)
    r["tokens_mismatch_vs_cpu"] = int((cpu != tok[rows].cpu()).sum())
    zc = S.scaled_logits(logits[rows].cpu(), temps[rows].cpu())
    r["weights_mismatch_vs_cpu"] = int((S._int_weights(zc, zc.amax(-1, keepdim=True), bits) != w[rows].cpu()).sum())
    # boundary uniforms: the sensitive case
    brows = list(range(min(b, 16)))
    ub, rr = boundary_uniforms(logits, temps, brows)
    lb, tb = logits[rr], temps[rr]
    tk_b = TS.categorical_sample(lb, tb, ub, None, bits)
    r["boundary_draws"] = len(rr)
    r["boundary_tokens_mismatch_vs_torch_cuda"] = int((tk_b != S.categorical_sample_reference(lb, tb, ub)).sum())
    # greedy rows (odd rows) against torch's argmax
    g = torch.arange(b, device=dev) % 2 == 1
    tg = TS.categorical_sample(logits, temps, u, g, bits)
    r["greedy_mismatch_vs_torch"] = int((tg != torch.where(g, logits.float().argmax(-1), ref)).sum())
    r["block_sizes_same_tokens"] = all(
        torch.equal(TS.categorical_sample(logits, temps, u, None, bits, block=blk), tok) for blk in (1024, 4096))
    r["splits_same_tokens"] = _splits_same(logits, temps, u, bits, tok, ref)
    # top-p's weights over sorted rows (the Triton elementwise kernel) and the whole mask vs CPU
    vals = torch.sort(z, dim=-1, descending=True, stable=True)[0]
    r["int_weights_sorted_mismatch_vs_torch_cuda"] = int(
        (TS.int_weights(vals, vals[:, :1], bits) != S._int_weights(vals, vals[:, :1], bits)).sum())
    # exp64 itself, float64 bits: Triton vs _exact.exp64 on CUDA; the FMA-contracted build as control
    e_ref = S._exact.exp64(vals.to(F64) - vals[:, :1].to(F64))
    r["exp64_bits_mismatch_vs_torch_cuda"] = int(
        (TS.int_weights(vals, vals[:, :1], bits, _raw_exp=True) != e_ref).sum())
    r["control_fma_exp64_bits_mismatch"] = int(
        (TS.int_weights(vals, vals[:, :1], bits, _raw_exp=True, _fp_fusion=True) != e_ref).sum())
    r["exp64_entries"] = e_ref.numel()
    del vals, e_ref
    kk = torch.tensor([[50, -1, 0, 1000][i % 4] for i in range(b)], device=dev)
    pp = torch.tensor([[0.9, 0.95, 0.5, 1.0][i % 4] for i in range(b)], dtype=torch.float32, device=dev)
    mask = K.top_k_top_p_mask(logits, temps, kk, pp)
    mrows = list(range(min(b, 4)))
    r["mask_rows_mismatch_vs_cpu"] = int((K.top_k_top_p_mask(logits[mrows].cpu(), temps[mrows].cpu(), kk[mrows].cpu(),
                                                            pp[mrows].cpu()) != mask[mrows].cpu()).any(-1).sum())
    r["mask_kept_mean"] = float(mask.sum(-1).double().mean())
    del mask
    # controls: FMA contraction on, and x * (1/T)
    _, w_fma = TS.categorical_sample(logits, temps, u, None, bits, return_weights=True, _fp_fusion=True)
    _, w_rcp = TS.categorical_sample(logits, temps, u, None, bits, return_weights=True, _variant=1)
    r["control_fma_weights_mismatch"] = int((w_fma != w_ref).sum())
    r["control_fma_boundary_tokens_mismatch"] = int(
        (TS.categorical_sample(lb, tb, ub, None, bits, _fp_fusion=True) != tk_b).sum())
    r["control_recip_T_weights_mismatch"] = int((w_rcp != w_ref).sum())
    r["control_recip_T_boundary_tokens_mismatch"] = int(
        (TS.categorical_sample(lb, tb, ub, None, bits, _variant=1) != tk_b).sum())
    del w, w_ref, w_fma, w_rcp, z
    return logits, r


def graph_check(logits, res):
    b = logits.shape[0]
    params = params_for(b, "mixed")
    s = Sampler()
    flags = Sampler.flags(params)
    f32, i64 = Sampler.pack(params, [11 * i for i in range(b)], [3] * b, logits.device)
    eager = s.device_step(logits, f32, i64, *flags)
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for _ in range(2):
            s.device_step(logits, f32, i64, *flags)
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = s.device_step(logits, f32, i64, *flags)
    g.replay()
    torch.cuda.synchronize()
    res["graph_equal_eager"] = bool(torch.equal(out, eager))
    return g, out, (f32, i64, flags)


def time_batch(logits, g, reps, res):
    b = logits.shape[0]
    seeds, idx = [11 * i for i in range(b)], [3] * b
    s = Sampler()
    for kind in ("plain", "mixed"):
        params = params_for(b, kind)
        flags = Sampler.flags(params)
        f32, i64 = Sampler.pack(params, seeds, idx, logits.device)
        t = {"new_call_ms": time_ms(lambda: s(logits, params, seeds, idx), reps, host=True),
             "new_device_step_ms": time_ms(lambda: s.device_step(logits, f32, i64, *flags), reps)}
        res[f"time_{kind}"] = t
    res["time_mixed"]["graph_replay_ms"] = time_ms(g.replay, reps)
    temps = torch.ones(b, device=logits.device)
    u = torch.rand(b, device=logits.device, dtype=F64)
    kt = {"torch_ms": time_ms(lambda: S.categorical_sample_reference(logits, temps, u), reps),
          "triton_ms": time_ms(lambda: K.categorical_sample(logits, temps, u), reps)}
    for blk in (1024, 4096):
        kt[f"triton_block{blk}_ms"] = time_ms(
            lambda: TS.categorical_sample(logits, temps, u, None, S._weight_bits(V), block=blk), reps)
    kt["triton_split1_ms"] = time_ms(
        lambda: TS.categorical_sample(logits, temps, u, None, S._weight_bits(V), split=1), reps)
    kk = torch.full((b,), 50, device=logits.device)
    pp = torch.full((b,), 0.9, device=logits.device)
    kt["top_k_top_p_mask_ms"] = time_ms(lambda: K.top_k_top_p_mask(logits, temps, kk, pp), reps)
    tok = K.categorical_sample(logits, temps, u)
    kt["token_logprobs_ms"] = time_ms(lambda: reported_logprobs(logits, tok, temps), reps)  # not the sampler's kernel
    kt["argmax_ms"] = time_ms(lambda: logits.float().argmax(-1), reps)
    kt["speedup"] = kt["torch_ms"] / kt["triton_ms"]
    kt["read_roofline_ms_2pass_at_4.3TBps"] = 2 * b * V * 2 / 4.3e12 * 1e3
    res["time_kernel_T1"] = kt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--dry-run-cpu", type=int, default=0, metavar="V",
                    help="checks only, on CPU tensors at this vocabulary (needs TRITON_INTERPRET=1)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    global V
    if a.dry_run_cpu:
        V = a.dry_run_cpu
    dev = torch.device("cpu" if a.dry_run_cpu else "cuda")
    import triton
    try:
        commit = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "HEAD"],
                                capture_output=True, text=True).stdout.strip() or None
    except Exception:
        commit = None
    out = {"command": " ".join(["python", *sys.argv]),
           "machine": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu (interpreter dry run)",
           "host": platform.node(), "versions": {"torch": torch.__version__, "triton": triton.__version__,
                                                 "python": platform.python_version()},
           "commit": commit or os.environ.get("BITMATCH_COMMIT"), "V": V, "results": []}
    gen = torch.Generator().manual_seed(0)
    path = os.path.join(a.out, "sampler.json")
    for b in [int(x) for x in a.batches.split(",")]:
        t0 = time.time()
        logits, r = check_batch(b, gen, dev, out)
        print(json.dumps(r), flush=True)
        if dev.type == "cpu":
            out["results"].append(r)
            continue
        g, _, _ = graph_check(logits, r)
        time_batch(logits, g, a.reps, r)
        r["wall_s"] = time.time() - t0
        out["results"].append(r)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        del g, logits
        torch.cuda.empty_cache()
    if dev.type == "cpu":
        print(json.dumps(out["results"]))
        return
    print(f"{'B':>4} {'w!=':>4} {'tok!=':>5} {'cpu!=':>5} {'bnd!=':>5} {'fma_w!=':>8} {'rcp_w!=':>8} "
          f"{'graph':>5} {'new ms':>7} {'step':>6} {'graph':>6} {'krn torch':>9} {'krn trit':>8} {'split1':>6} "
          f"{'mixNew':>6} {'mask':>6} {'iw!=':>4} {'msk!=':>5} {'splits':>6} {'e64!=':>5} {'fmaE!=':>7}")
    for r in out["results"]:
        tp, tm, kt = r["time_plain"], r["time_mixed"], r["time_kernel_T1"]
        print(f"{r['B']:>4} {r['weights_mismatch_vs_torch_cuda']:>4} {r['tokens_mismatch_vs_torch_cuda']:>5} "
              f"{r['tokens_mismatch_vs_cpu']:>5} {r['boundary_tokens_mismatch_vs_torch_cuda']:>5} "
              f"{r['control_fma_weights_mismatch']:>8} {r['control_recip_T_weights_mismatch']:>8} "
              f"{str(r['graph_equal_eager']):>5} {tp['new_call_ms']:7.3f} "
              f"{tp['new_device_step_ms']:6.3f} {tm['graph_replay_ms']:6.3f} "
              f"{kt['torch_ms']:9.3f} {kt['triton_ms']:8.3f} "
              f"{kt['triton_split1_ms']:6.3f} {tm['new_call_ms']:6.2f} "
              f"{kt['top_k_top_p_mask_ms']:6.2f} {r['int_weights_sorted_mismatch_vs_torch_cuda']:>4} "
              f"{r['mask_rows_mismatch_vs_cpu']:>5} {str(r['splits_same_tokens']):>6} "
              f"{r['exp64_bits_mismatch_vs_torch_cuda']:>5} {r['control_fma_exp64_bits_mismatch']:>7}")
    print(json.dumps({k: v for k, v in out.items() if k != "results"}))


if __name__ == "__main__":
    main()

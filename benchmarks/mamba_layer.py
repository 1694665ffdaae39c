"""The bitmatch Mamba2 SSD scan (kernels.mamba_chunk_scan, Triton, canonical chunk schedule) against
HF's torch path (transformers' Nemotron-H ``mamba2_selective_state_update`` for one-token decode,
``mamba2_chunk_scan`` for prefill), side by side in one run on CUDA, plus the invariance checks there.

  python benchmarks/mamba_layer.py --out DIR [--batches 1,64,256] [--contexts 1024,4096,8192]
      [--prefill 1024,4096,8192] [--heads 128 --head-dim 64 --state 128 --groups 8 --chunk 128]

What is timed: the SSM core of one Mamba2 layer (the part whose prefill and decode disagree on the
stock path): our decode = one launch per step (open-chunk replay from the buffer, the boundary state
advanced when a chunk closes, the open-chunk buffer copy), averaged over the Q consecutive positions
of one chunk starting at the context length, so every fill level of the buffer and one chunk close
are in the mean; HF's decode = its recurrent update on the same shapes (fp32 state, bf16 inputs).
in_proj / conv1d / gated norm / out_proj are not in the timing (conv1d and the gated norm have no
Triton kernel yet). Ratios: ours / HF for decode (target <= 2), HF / ours for prefill (target >= 0.8).
Checks on CUDA: prefill == chunked prefill == token-by-token decode bit for bit at full shapes,
sequences packed vs alone, and the control (HF's chunked scan vs its recurrent step differ).
"""
import argparse
import json
import os
import platform
import sys
import time

import torch


def machine_info():
    import triton
    import transformers
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sm_count=p.multi_processor_count)
    return info


def timed(fn, reps, sync):
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t) / reps


def inputs(T, a, dev, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    bf = torch.bfloat16
    x = torch.randn(T, a.heads, a.head_dim, generator=g).to(dev, bf)
    dt = (torch.randn(T, a.heads, generator=g) - 2).to(dev, bf)
    B = torch.randn(T, a.groups, a.state, generator=g).to(dev, bf)
    C = torch.randn(T, a.groups, a.state, generator=g).to(dev, bf)
    return x, dt, B, C


def params(a, dev):
    g = torch.Generator(device="cpu").manual_seed(1)
    A = (-torch.rand(a.heads, generator=g) * 4 - 0.5).to(dev)
    D = torch.randn(a.heads, generator=g).to(dev)
    db = (torch.randn(a.heads, generator=g) * 0.1).to(dev, torch.bfloat16)
    return A, D, db


def cache_for(nb, a, dev):
    bf = torch.bfloat16
    return (torch.zeros(nb, a.heads, a.head_dim, a.state, device=dev),
            torch.zeros(nb, a.chunk, a.heads, a.head_dim, device=dev, dtype=bf),
            torch.zeros(nb, a.chunk, a.groups, a.state, device=dev, dtype=bf),
            torch.zeros(nb, a.chunk, a.heads, device=dev))


def checks(K, hf, a, dev):
    """Bitwise schedule and batch invariance of our scan at the benchmark shapes; the HF control."""
    A, D, db = params(a, dev)
    lens = (a.chunk * 2 + 37, a.chunk + 1, 45)
    seqs = [inputs(n, a, dev, seed=10 + i) for i, n in enumerate(lens)]
    out = {}

    def one(s, start=None, cache=None, slot=0):
        n = s[0].shape[0]
        kw = {} if cache is None else dict(seq_start=torch.tensor([start], device=dev), cache=cache,
                                           state_slots=torch.tensor([slot], device=dev))
        return K.mamba_chunk_scan(s[0], s[1], A, s[2], s[3], a.chunk, torch.tensor([0, n], device=dev), D=D,
                                  dt_bias=db, dt_min=1e-3, **kw)
    alone = [one(s) for s in seqs]
    cat = [torch.cat([s[j] for s in seqs]) for j in range(4)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev)
    packed = K.mamba_chunk_scan(cat[0], cat[1], A, cat[2], cat[3], a.chunk, cu, D=D, dt_bias=db, dt_min=1e-3)
    out["packed_vs_alone_equal"] = all(torch.equal(packed[int(cu[i]):int(cu[i + 1])], alone[i]) for i in range(3))
    s, n = seqs[0], lens[0]
    cuts = [n // 5, n // 3, 1, n // 3]
    for name, splits in (("decode", [n - 40] + [1] * 40), ("chunked", cuts + [n - sum(cuts)])):
        cache, at, parts = cache_for(4, a, dev), 0, []
        for k in splits:
            parts.append(one(tuple(t[at:at + k] for t in s), at, cache, slot=2))
            at += k
        y = torch.cat(parts)
        out[f"prefill_vs_{name}_equal"] = bool(torch.equal(y, alone[0]))
        out[f"prefill_vs_{name}_max_abs"] = float((y - alone[0]).abs().max())
    # parity with HF's chunked scan (fp32 math on bf16 inputs), and the control
    ref = hf.mamba2_chunk_scan(s[0][None], s[1][None], A, s[2][None], s[3][None], a.chunk, D=D, dt_bias=db,
                               dt_softplus=True, dt_limit=(1e-3, float("inf")))[0]
    out["parity_vs_hf_max_abs"] = float((alone[0] - ref).abs().max())
    out["hf_output_max_abs"] = float(ref.abs().max())
    st = torch.zeros(1, a.heads, a.head_dim, a.state, device=dev)
    rec = [hf_step(hf, st, tuple(t[i:i + 1] for t in s), A, D, db, a) for i in range(n)]
    out["control_hf_chunked_vs_recurrent_equal"] = bool(torch.equal(torch.cat(rec).float(), ref.float()))
    out["control_hf_max_abs"] = float((torch.cat(rec).float() - ref.float()).abs().max())
    return out


def hf_step(hf, state, tok, A, D, db, a):
    x, dt, B, C = tok
    Bn, H, P, N = x.shape[0], a.heads, a.head_dim, a.state
    return hf.mamba2_selective_state_update(
        state, x, dt[:, :, None].expand(Bn, H, P), A[:, None, None].expand(H, P, N), B, C,
        D[:, None].expand(H, P), dt_bias=db[:, None].expand(H, P), dt_softplus=True)


def bench_decode(K, hf, a, dev, nb, ctx, sync):
    A, D, db = params(a, dev)
    x, dt, B, C = inputs(nb, a, dev, seed=3)
    cache = cache_for(nb, a, dev)
    cache[0].normal_(0, 0.1)
    for t in cache[1:]:
        t.normal_(0, 1.0)
    cache[3].uniform_(0.01, 0.1)
    cu = torch.arange(nb + 1, device=dev)
    slots = torch.arange(nb, device=dev)
    starts = [torch.full((nb,), ctx + i, device=dev, dtype=torch.long) for i in range(a.chunk)]

    def ours():
        for st in starts:
            K.mamba_chunk_scan(x, dt, A, B, C, a.chunk, cu, D=D, dt_bias=db, dt_min=1e-3, seq_start=st,
                               cache=cache, state_slots=slots)
    state = torch.zeros(nb, a.heads, a.head_dim, a.state, device=dev).normal_(0, 0.1)

    def stock():
        for _ in range(a.chunk):
            hf_step(hf, state, (x, dt, B, C), A, D, db, a)
    t_ours = timed(ours, a.reps, sync) / a.chunk
    t_hf = timed(stock, a.reps, sync) / a.chunk
    return {"batch": nb, "context": ctx, "ours_ms_per_token": t_ours * 1e3, "hf_recurrent_ms_per_token": t_hf * 1e3,
            "ratio_ours_over_hf": t_ours / t_hf}


def bench_prefill(K, hf, a, dev, T, sync):
    A, D, db = params(a, dev)
    x, dt, B, C = inputs(T, a, dev, seed=4)
    cu = torch.tensor([0, T], device=dev)
    t_ours = timed(lambda: K.mamba_chunk_scan(x, dt, A, B, C, a.chunk, cu, D=D, dt_bias=db, dt_min=1e-3), a.reps,
                   sync)
    t_hf = timed(lambda: hf.mamba2_chunk_scan(x[None], dt[None], A, B[None], C[None], a.chunk, D=D, dt_bias=db,
                                              dt_softplus=True, dt_limit=(1e-3, float("inf"))), a.reps, sync)
    return {"tokens": T, "ours_ms": t_ours * 1e3, "hf_chunked_ms": t_hf * 1e3, "ratio_hf_over_ours": t_hf / t_ours}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--prefill", default="1024,4096,8192")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--state", type=int, default=128)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    import bitmatch.kernels as K
    from transformers.models.nemotron_h import modeling_nemotron_h as hf

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    os.makedirs(a.out, exist_ok=True)
    res = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "machine": machine_info(),
           "commit": a.commit, "shapes": {k: getattr(a, k) for k in ("heads", "head_dim", "state", "groups", "chunk")},
           "mamba_ssm": "not installed on the device (no selective_state_update baseline)", "checks": None,
           "decode": [], "prefill": []}
    path = os.path.join(a.out, "mamba_layer.json")

    def dump():
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    t0 = time.time()
    res["checks"] = checks(K, hf, a, dev)
    print("checks", res["checks"], f"{time.time() - t0:.1f}s", flush=True)
    dump()
    for nb in map(int, a.batches.split(",")):
        for ctx in map(int, a.contexts.split(",")):
            r = bench_decode(K, hf, a, dev, nb, ctx, sync)
            res["decode"].append(r)
            print("decode", r, flush=True)
            dump()
    for T in map(int, a.prefill.split(",")):
        r = bench_prefill(K, hf, a, dev, T, sync)
        res["prefill"].append(r)
        print("prefill", r, flush=True)
        dump()
    print("wall", time.time() - t0)


if __name__ == "__main__":
    main()

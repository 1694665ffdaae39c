"""Block-FP8 (W8A8) linear on the GPU: bitmatch's ``fp8_linear`` vs torch's FP8 GEMMs (bits across M, time).

Its rows across M, its tiles, and its time beside torch's FP8 GEMMs, at Qwen3-8B's shapes.

  python benchmarks/ops/fp8_linear.py --out DIR                  # CUDA (H100 / H200), about 1-2 minutes
  python benchmarks/ops/fp8_linear.py --out DIR --device cpu     # tiny shapes in Triton's interpreter: the logic only

writes DIR/fp8_linear.json (command, machine, versions, commit; sections below; errors by key).

- ``invariance``: per weight (N, K) (o_proj 4096x4096, gate_up 12288x4096, down 4096x12288), one
  seeded batch X of 512 rows; for every M in 1..512 ``fp8_linear(X[:M])`` against the rows of
  ``fp8_linear(X)`` (the claim: 0 mismatching rows at every M), and the same for cuBLAS's blockwise
  ``scaled_mm`` on the same fp8 operands (a control: its kernel choice follows M).
- ``tiles``: the GEMM at several tile configs (all BM >= 64: wgmma) at M = 1, 64, 256, 512: rows
  differing from the table's config (the claim: 0; tiles are speed knobs only).
- ``time_ms`` at T = 1, 64, 256, 4096 tokens: ``fp8_linear`` (activation quantizer + GEMM), the GEMM
  alone and the quantizer alone; torch's blockwise ``scaled_mm`` (1x128 activations, 128x128
  weights, cuBLAS: Hopper with CUDA >= 12.9 only), per-tensor ``torch._scaled_mm``, both on
  pre-quantized operands; bitmatch's bf16 ``linear`` and cuBLAS bf16 ``F.linear`` on the bf16
  weight. CUDA-graph replays over rotated inputs (benchmarks/_common.py ``bench``).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
SHAPES = {"o (4096,4096)": (4096, 4096), "gate_up (12288,4096)": (12288, 4096), "down (4096,12288)": (4096, 12288)}
SMOKE_SHAPES = {"tiny (192,384)": (192, 384), "tiny (130,300)": (130, 300)}
TOKENS = (1, 64, 256, 4096)
EXTRA_TILES = [(64, 32, 8, 4, 4), (64, 128, 8, 4, 3), (128, 64, 8, 4, 4), (128, 256, 8, 8, 3)]


def scaled_mm_blockwise(torch, xq, sx, wq, sw, out_dtype):
    """cuBLAS's DeepSeek recipe through torch: 1x128 activation scales outer-dim-major, 128x128
    weight scales as [L4, N/128] (K groups padded to a multiple of 4, K-major), M padded to a
    multiple of 4 (cuBLASLt's rule, as vLLM's torch backend does)."""
    M = xq.shape[0]
    pad = -M % 4
    if pad:
        xq = torch.cat([xq, xq.new_zeros(pad, xq.shape[1])])
        sx = torch.cat([sx, sx.new_ones(pad, sx.shape[1])])
    sa = sx.t().contiguous().t()
    sb = torch.nn.functional.pad(sw, (0, -sw.shape[1] % 4)).t()
    F = torch.nn.functional
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        ST = F.ScalingType
        out = F.scaled_mm(xq, wq.t(), sa, ST.BlockWise1x128, sb, ST.BlockWise128x128, output_dtype=out_dtype)
    else:
        out = torch._scaled_mm(xq, wq.t(), sa, sb, out_dtype=out_dtype)
    return out[:M]


def per_tensor(torch, t):
    """Per-tensor e4m3 codes and scale; rows padded to a multiple of 16 (cuBLAS's FP8 rule)."""
    s = t.float().abs().amax().clamp(min=1e-10) / 448.0
    q = (t.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return torch.cat([q, q.new_zeros(-q.shape[0] % 16, q.shape[1])]), s


def rows_by_m(_common, fn, full, max_m):
    """{total, Ms with a mismatch}: fn(M)'s rows against the full batch's first M rows, M = 1..max_m."""
    bad = {M: _common.rows_mismatch(fn(M), full[:M]) for M in range(1, max_m + 1)}
    return {"rows_mismatching_total": sum(bad.values()), "m_with_mismatch": [m for m, v in bad.items() if v][:64]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--max-m", type=int, default=None, help="largest M of the invariance sweep (default 512; cpu 20)")
    ap.add_argument("--budget-s", type=float, default=110.0, help="stop timing once the run has taken this long")
    a = ap.parse_args(argv)
    t_start = time.time()
    # before triton is imported: the CPU run is Triton's interpreter on CPU tensors
    os.environ["TRITON_INTERPRET"] = "1" if a.device == "cpu" else "0"
    import torch
    import torch.nn.functional as F

    import _common
    import bitmatch.kernels as K
    from bitmatch.kernels.fp8 import quantize_fp8_blocks
    from bitmatch.kernels.triton import fp8 as TF

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("fp8_linear: no CUDA device; pass --device cpu for the interpreter's smoke run")
    dev, smoke, BF = torch.device(a.device), a.device == "cpu", torch.bfloat16
    shapes, tokens = (SMOKE_SHAPES, (1, 8)) if smoke else (SHAPES, TOKENS)
    max_m = a.max_m or (20 if smoke else 512)
    os.makedirs(a.out, exist_ok=True)
    rec = _common.Recorder(os.path.join(a.out, "fp8_linear.json"), a,
                           {"claims": "invariance: 0 rows at every M; tiles: 0 rows differing from the table"})
    inv, tiles, times = {}, {}, {}

    def timer(make, n, bytes_per_call):
        """ms per call, rotating over n weight copies (a decode step reads its weight from HBM)."""
        if smoke:
            return _common.cuda_ms(make(0), iters=2, warmup=1)
        return _common.bench(make, bytes_per_call, n=n)

    def run_shape(name, N, Kd):
        g = torch.Generator(device="cpu").manual_seed(0)
        w = (torch.randn(N, Kd, generator=g) * 0.02).to(dev, BF)
        x = torch.randn(max(max_m, 64), Kd, generator=g).to(dev, BF)
        wq, ws = quantize_fp8_blocks(w)
        xq, sx = K.quantize_fp8_groups(x)
        try:
            full = K.fp8_linear(x, wq, ws)
            r = rows_by_m(_common, lambda M: K.fp8_linear(x[:M], wq, ws), full, max_m)
            if not smoke:
                try:
                    full_cb = scaled_mm_blockwise(torch, xq, sx, wq, ws, BF)
                    r["control_scaled_mm_blockwise"] = rows_by_m(
                        _common, lambda M: scaled_mm_blockwise(torch, xq[:M], sx[:M], wq, ws, BF), full_cb, max_m)
                except Exception as e:
                    r["control_scaled_mm_blockwise"] = f"unavailable: {e!r}"[:300]
            inv[name] = r
            rec.put("invariance", inv)
        except Exception:
            rec.err(f"invariance {name}")
        try:
            cfgs = sorted({row[1:] for row in TF.CONFIG_TABLE} | set(EXTRA_TILES))
            t = {}
            for M in (1, 8) if smoke else (1, 64, 256, 512):
                want = TF.linear(xq[:M], sx[:M], wq, ws, None, BF)
                t[M] = {str(c): _common.rows_mismatch(TF.linear(xq[:M], sx[:M], wq, ws, None, BF, cfg=c), want)
                        for c in cfgs}
            tiles[name] = t
            rec.put("tiles", tiles)
        except Exception:
            rec.err(f"tiles {name}")
        for T in tokens:
            if time.time() - t_start > a.budget_s:
                rec.put("budget_stop", f"timing stopped at {name} T={T} after {a.budget_s} s")
                return
            try:
                times[f"{name} T={T}"] = time_row(T, N, Kd, w, wq, ws, g)
                rec.put("time_ms", times)
            except Exception:
                rec.err(f"time {name} T={T}")

    def time_row(T, N, Kd, w, wq, ws, g):
        xt = torch.randn(T, Kd, generator=g).to(dev, BF)
        xtq, sxt = K.quantize_fp8_groups(xt)
        pq, ps = per_tensor(torch, xt)
        wpq, wps = per_tensor(torch, w)
        fp8_bytes = N * Kd + T * Kd * 2 + T * N * 2
        n = 1 if smoke else min(16, max(1, -(-3 * _common.L2 // fp8_bytes)))
        cp = [(wq, ws, w, wpq)] + [(wq.clone(), ws.clone(), w.clone(), wpq.clone()) for _ in range(n - 1)]
        cands = {
            "bitmatch_fp8_linear": lambda i: lambda: K.fp8_linear(xt, cp[i][0], cp[i][1]),
            "bitmatch_fp8_gemm_only": lambda i: lambda: TF.linear(xtq, sxt, cp[i][0], cp[i][1], None, BF),
            "bitmatch_fp8_quant_only": lambda i: lambda: K.quantize_fp8_groups(xt),
            "torch_scaled_mm_blockwise": lambda i: lambda: scaled_mm_blockwise(torch, xtq, sxt, cp[i][0], cp[i][1], BF),
            "torch_scaled_mm_per_tensor": lambda i: lambda: torch._scaled_mm(pq, cp[i][3].t(), ps, wps, out_dtype=BF),
            "bitmatch_bf16_linear": lambda i: lambda: K.linear(xt, cp[i][2]),
            "cublas_bf16_linear": lambda i: lambda: F.linear(xt, cp[i][2]),
        }
        row = {"weight_copies": n}
        for cname, make in cands.items():
            quant = "quant_only" in cname
            nb = T * Kd * 2 if quant else fp8_bytes + (N * Kd if "bf16" in cname else 0)
            try:
                row[cname] = round(timer(make, 1 if quant else n, nb), 5)
            except Exception as e:
                row[cname] = f"error: {e!r}"[:300]
        gemm, ref = row.get("bitmatch_fp8_gemm_only"), row.get("torch_scaled_mm_blockwise")
        if isinstance(gemm, float) and isinstance(ref, float):
            row["gemm_speed_vs_scaled_mm_blockwise"] = round(ref / gemm, 3)
        return row

    # the CPU run forces the Triton backend onto CPU tensors (the interpreter); CUDA tensors take it anyway
    with K.use_backend("triton" if smoke else None):
        for name, (N, Kd) in shapes.items():
            run_shape(name, N, Kd)
    rec.put("wall_s", round(time.time() - t_start, 1))
    print(f"wrote {rec.path}")


if __name__ == "__main__":
    main()

"""Golden bits on the GPU: each op's output hash on CUDA vs an earlier run's (``--expect``), beside the stamp.

tests/test_golden_bits.py's fixed inputs, every op of the op table run on CUDA (the Triton backend),
the xxh3 of each output's bytes beside the CUDA stamp.

The interpreter's golden file (tests/golden_bits.json) pins the structure of the canonical order;
these hashes pin the GPU's own bits (real tensor-core dots, fp32 exp): a change of a kernel that
keeps the stamp shows here as an op whose hash moved. Each case runs twice in the run (the bits
must repeat), and ``--expect FILE`` compares with an earlier run's JSON: an op whose hash changed
while the stamp did not is reported (exit status 1), and so is a stamp change (the file to commit
next).

  python benchmarks/ops/golden_gpu.py --out DIR [--expect benchmarks/results/golden_gpu_h200.json]
  python benchmarks/ops/golden_gpu.py --out DIR --device cpu    # the interpreter: a smoke test

The test module builds its inputs with CPU factories (seeded CPU generators); a TorchFunctionMode
moves every tensor a factory returns to the device, for calls made from the test module's own
code only (the ops' internal host tensors stay where the op puts them).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--expect", default=None, help="an earlier golden_gpu JSON to compare with")
    ap.add_argument("--explain", default="", help="comma list of ops: also run each op's cases on "
                    "CPU with the reference backend and list the elements whose bits differ")
    a = ap.parse_args(argv)
    # before triton is imported; on CUDA explicitly off: the test module below sets it to 1 when
    # unset (for pytest), which would run every kernel in the interpreter on the device's CPU
    os.environ["TRITON_INTERPRET"] = "1" if a.device == "cpu" else "0"
    import torch
    from torch.overrides import TorchFunctionMode

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from triton.runtime.interpreter import InterpretedFunction

    import bitmatch.kernels as K
    import test_golden_bits as G
    from bitmatch.kernels import order
    from bitmatch.kernels.triton import linear as triton_linear

    interpreted = isinstance(triton_linear._linear_kernel, InterpretedFunction)
    if interpreted != (a.device == "cpu"):
        raise SystemExit(f"golden_gpu: Triton's interpreter is {'on' if interpreted else 'off'} for --device "
                         f"{a.device} (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} "
                         "when triton was imported)")

    factories = {torch.randn, torch.rand, torch.randint, torch.randperm, torch.tensor, torch.zeros, torch.ones,
                 torch.full, torch.arange, torch.empty}
    dev = torch.device(a.device)

    class InputsOnDevice(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in factories and isinstance(out, torch.Tensor) and out.device != dev:
                f = sys._getframe(1)
                while f is not None and f.f_globals.get("__name__", "").startswith("torch"):
                    f = f.f_back
                if f is not None and f.f_globals.get("__name__") == G.__name__:
                    return out.to(dev)
            return out

    def run(op, shape):
        torch.manual_seed(0)
        with torch.no_grad(), K.use_backend("triton"), InputsOnDevice():
            return G.bits_hash(G.CASES[op][shape]())

    t0 = time.time()
    bits, errors, unstable = {}, {}, []
    for op in sorted(G.CASES):
        for shape in G.CASES[op]:
            try:
                h1, h2 = run(op, shape), run(op, shape)
            except Exception as e:  # recorded per op: the others still run
                errors[f"{op} / {shape}"] = f"{type(e).__name__}: {e}"[:500]
                continue
            bits.setdefault(op, {})[shape] = h1
            if h1 != h2:
                unstable.append(f"{op} / {shape}")
    explained = {}
    for op in filter(None, a.explain.split(",")):
        for shape, case in G.CASES.get(op, {}).items():
            torch.manual_seed(0)
            with torch.no_grad(), K.use_backend("triton"), InputsOnDevice():
                got = case()
            torch.manual_seed(0)
            with torch.no_grad(), K.use_backend("reference"):
                ref = case()
            explained[f"{op} / {shape}"] = _differences(got, ref)
    stamp = order.stamp("triton")
    res = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "machine": {"platform": platform.platform(), "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu (interpreter)"},
           "stamp": stamp, "interpreter": interpreted, "bits": bits, "errors": errors, "not_repeating": unstable,
           "cases": sum(len(v) for v in bits.values()), "seconds": round(time.time() - t0, 1)}
    if explained:
        if dev.type == "cuda":
            explained["fp32_to_bf16_probe"] = _conversion_probe(torch)
        res["explained"] = explained
        print(json.dumps(explained)[:3000])
    bad = bool(errors or unstable)
    if a.expect:
        old = json.load(open(a.expect))
        moved = sorted(f"{op} / {s}" for op, v in bits.items() for s, h in v.items()
                       if old.get("bits", {}).get(op, {}).get(s) not in (None, h))
        same_stamp = old.get("stamp", {}).get("fingerprint") == stamp["fingerprint"]
        res["compared_with"] = {"file": a.expect, "same_stamp": same_stamp, "changed": moved}
        bad |= bool(moved) and same_stamp
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"golden_gpu_{'h200' if dev.type == 'cuda' else 'cpu'}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    print(json.dumps({k: res[k] for k in ("cases", "errors", "not_repeating", "seconds")}), res.get("compared_with"))
    print("wrote", path)
    return 1 if bad else 0


def _conversion_probe(torch):
    """How this machine's Triton converts fp32 -> bf16 (``.to``, the default rounding, and each
    explicit mode) on values whose nearest-even and toward-zero results differ, beside torch's
    conversion (all equal when the kernels are compiled; the interpreter truncates)."""
    import triton
    import triton.language as tl

    @triton.jit
    def conv(x_ptr, y_ptr, z_ptr, w_ptr, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        m = o < n
        v = tl.load(x_ptr + o, mask=m)
        tl.store(y_ptr + o, v.to(tl.bfloat16), mask=m)
        tl.store(z_ptr + o, v.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=m)
        tl.store(w_ptr + o, v.to(tl.bfloat16, fp_downcast_rounding="rtz"), mask=m)

    x = torch.tensor([0.99999553, 1.0 + 3 * 2.0 ** -9, -3.5156251, 0.5827536, 1.0 + 2.0 ** -8],
                     dtype=torch.float32, device="cuda")
    outs = [torch.empty(x.shape, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    conv[(1,)](x, *outs, x.numel(), BLOCK=8)
    ref = x.to(torch.bfloat16)
    res = {"inputs": x.tolist(), "torch_rn": ref.float().tolist()}
    for name, o in zip(("default", "rtne", "rtz"), outs):
        res[name] = o.float().tolist()
        res[f"{name}_equals_torch"] = bool(torch.equal(o, ref))
    return res


def _differences(got, ref, limit=24):
    """The device output against the CPU reference's, element by element: how many differ and
    the first ``limit`` of them (flat index, both values as floats and as raw bits)."""
    import torch
    gs = got if isinstance(got, (tuple, list)) else (got,)
    rs = ref if isinstance(ref, (tuple, list)) else (ref,)
    out = []
    for g, r in zip(gs, rs):
        if not isinstance(g, torch.Tensor):
            out.append({"equal": g == r})
            continue
        g = g.detach().cpu().contiguous()
        r = r.detach().cpu().contiguous()
        if g.shape != r.shape or g.dtype != r.dtype:
            out.append({"shape_or_dtype_differs": [str(g.shape), str(r.shape), str(g.dtype), str(r.dtype)]})
            continue
        ib = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[g.element_size()]
        gb, rb = g.reshape(-1).view(ib), r.reshape(-1).view(ib)
        idx = (gb != rb).nonzero().flatten()
        out.append({"shape": list(g.shape), "dtype": str(g.dtype), "differing": int(idx.numel()),
                     "first": [{"i": int(i), "device": float(g.reshape(-1)[i]), "reference": float(r.reshape(-1)[i]),
                                "device_bits": int(gb[i]), "reference_bits": int(rb[i])} for i in idx[:limit]]})
    return out


if __name__ == "__main__":
    sys.exit(main())

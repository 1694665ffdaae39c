"""Engine memory on the GPU: memory_allocated after each closed (or dropped) engine vs the model's alone.

Builds ``--engines`` engines one after another over one model (Qwen3-1.7B's shape, random bf16
weights built on the device; ``--tiny``: the tiny Qwen3), each with CUDA graphs (decode steps
replayed), close each (``Engine.close()``, its ``with`` block, or a plain ``del`` in turn:
``--mode``), and record ``torch.cuda.memory_allocated`` while it is held and after it is gone, with
the cycle collector off. Passes when after every engine the allocated memory is back at the model's
(+ ``--tolerance-mib``) and no engine or KV cache tensor is alive. ``--stock-every K`` runs every
K-th engine under a stock-ops override (``kernels.override``, eager: the stock ops are not graph
safe), as the long run that ended with 60 GB allocated did.

    python benchmarks/engine/engine_memory.py --out benchmarks/results/engine_memory_h100.json
    python benchmarks/engine/engine_memory.py --device cpu --tiny --out /tmp/engine_memory.json   # CI smoke

Writes JSON to ``--out``: the device, torch version, command, the model's bytes and one record per
engine; exits 1 when it does not pass."""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
import time
import weakref

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import bitmatch  # noqa: E402
import bitmatch.kernels as K  # noqa: E402
from bitmatch.kernels.table import stock_for  # noqa: E402
from bitmatch.testing.models import random_prompts, tiny_model  # noqa: E402

# Qwen3-1.7B's shape (hidden 2048, 28 layers, GQA 16/8, head 128, tied embeddings)
QWEN3_1_7B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def build_model(device: str, tiny: bool):
    """bf16 random weights on ``device`` (built there: no host copy of a 1.7B model)."""
    if tiny:
        return tiny_model("qwen3-hd64-gqa4-tied", dtype=torch.bfloat16, seed=0).to(device)
    import transformers
    cfg = transformers.Qwen3Config(**QWEN3_1_7B)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def allocated(device: str) -> int | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def tensors_of(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from tensors_of(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from tensors_of(v)


def run_engine(model, i: int, args, stock: bool) -> tuple[dict, list, weakref.ref]:
    """Build engine ``i``, generate, drop it as ``--mode`` says; (record, cache weakrefs, engine weakref)."""
    mode = args.mode if args.mode != "mixed" else ("close", "with", "del")[i % 3]
    kw = dict(max_num_seqs=args.batch, enforce_eager=stock or args.device != "cuda",
              gpu_memory_utilization=args.gpu_memory_utilization)
    if args.device != "cuda":
        kw.update(num_gpu_blocks=64)
    prompts = random_prompts(args.batch, 8 if args.tiny else 16, 24 if args.tiny else 64, seed=i, vocab_hi=100)
    sp = bitmatch.SamplingParams(temperature=0.7, max_tokens=args.max_tokens, ignore_eos=True, seed=i)
    t0 = time.perf_counter()
    eng = bitmatch.Engine(model, **kw)
    ctx = K.override(stock_for(["linear"])) if stock else contextlib.nullcontext()
    with ctx:
        eng.generate(prompts, sp, use_tqdm=False)
    held = allocated(args.device)
    graphs = eng.model_runner.graphs
    rec = dict(engine=i, mode=mode, stock_override=stock, cuda_graphs=graphs is not None,
               graph_captures=0 if graphs is None else graphs.num_captures,
               graph_replays=0 if graphs is None else graphs.num_replays,
               num_gpu_blocks=eng.num_gpu_blocks, allocated_while_held=held)
    caches = [weakref.ref(t) for t in tensors_of(eng.model_runner.caches)]
    ref = weakref.ref(eng)
    if mode == "close":
        eng.close()
    elif mode == "with":
        with eng:
            pass
    elif mode != "del":
        raise ValueError(f"--mode must be close, with, del or mixed, got {args.mode!r}")
    del eng, graphs
    rec.update(allocated_after=allocated(args.device), seconds=round(time.perf_counter() - t0, 3))
    return rec, caches, ref


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON report's path")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="the tiny Qwen3 instead of the 1.7B shape (a smoke run)")
    ap.add_argument("--engines", type=int, default=10)
    ap.add_argument("--mode", default="mixed", help="close | with | del | mixed (the three in turn)")
    ap.add_argument("--stock-every", type=int, default=0, help="every K-th engine under a stock-ops override")
    ap.add_argument("--batch", type=int, default=None, help="prompts per engine (default 8; --tiny: 2)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per prompt (default 32; --tiny: 4)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--tolerance-mib", type=float, default=64.0)
    args = ap.parse_args(argv)
    args.batch = args.batch or (2 if args.tiny else 8)
    args.max_tokens = args.max_tokens or (4 if args.tiny else 32)

    model = build_model(args.device, args.tiny)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    base = allocated(args.device)
    tol = int(args.tolerance_mib * 2 ** 20)
    records, failures = [], []
    gc.collect()
    gc.disable()   # freed means freed by reference counting, as after `del engine` in a training loop
    try:
        for i in range(args.engines):
            stock = bool(args.stock_every) and i % args.stock_every == args.stock_every - 1
            rec, caches, ref = run_engine(model, i, args, stock)
            rec["engine_alive_after_close"] = ref() is not None
            rec["kv_cache_alive_after_close"] = any(c() is not None for c in caches)
            if rec["allocated_after"] is not None:
                rec["excess_bytes"] = rec["allocated_after"] - base
                # what this engine left behind beyond the one before it (a leak grows it every engine)
                prev = records[-1]["allocated_after"] if records else base
                rec["growth_bytes"] = rec["allocated_after"] - prev
            bad = rec["engine_alive_after_close"] or rec["kv_cache_alive_after_close"] or \
                rec.get("excess_bytes", 0) > tol
            rec["passed"] = not bad
            if bad:
                failures.append(i)
            records.append(rec)
            print(json.dumps(rec), flush=True)
    finally:
        gc.enable()
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else (platform.processor() or platform.machine())
    report = {"device": dev_name, "device_type": args.device, "torch": torch.__version__,
              "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "model": "tiny qwen3-hd64-gqa4-tied" if args.tiny else "qwen3-1.7B shape (random bf16)",
              "model_bytes": model_bytes, "allocated_with_model": base, "tolerance_bytes": tol,
              "engines": records, "failed_engines": failures, "passed": not failures}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"engine_memory: {'PASS' if not failures else 'FAIL at engines ' + str(failures)}; "
          f"model {model_bytes / 2 ** 30:.2f} GiB, report {args.out}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())

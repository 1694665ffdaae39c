"""Kernel launches in one engine decode step (DeepSeek-V4 structure), Triton vs torch, counted on CPU.

With CUDA graphs a decode step's host cost is gone, but every kernel node still costs the GPU
a launch slot and a minimum duration: a step of ~1,500 tiny kernels is latency-bound however
fast each one is. This counts what one decode step launches: the Triton backend runs under
TRITON_INTERPRET=1 (each Triton kernel call is one launch), and every torch op outside the
interpreter that launches a kernel on a GPU (views, metadata and empty allocations excluded) is
one more. The model has the DeepSeek-V4 mid config's layer structure (sliding / CSA / HCA / CSA /
HCA / CSA, two hash-MoE then learned-MoE layers, 4 mHC streams, 20 Sinkhorn iterations, 4 output
groups) at tiny widths: the counts depend on the structure, not the widths.

  python benchmarks/engine/launch_census.py --out DIR [--batch 4]
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
from _common import machine_info  # noqa: E402

# torch ops that launch nothing on a GPU: views, metadata, allocations without a fill
NO_LAUNCH = {"view", "_unsafe_view", "reshape", "expand", "as_strided", "select", "slice", "unsqueeze", "squeeze",
             "permute", "transpose", "t", "detach", "alias", "unbind", "split", "chunk", "split_with_sizes", "empty",
             "empty_strided", "empty_like", "narrow", "lift_fresh", "view_as", "flatten", "unflatten", "movedim",
             "diagonal", "expand_as", "_reshape_alias", "numel", "dim", "sym_size", "sym_numel", "sym_stride",
             "sym_storage_offset", "size", "stride", "contiguous", "scalar_tensor", "is_nonzero"}
MID_STRUCTURE = dict(hidden_size=64, num_hidden_layers=6, hc_mult=4, hc_sinkhorn_iters=20, o_groups=4,
                     layer_types=["sliding_attention"] + ["compressed_sparse_attention",
                                                          "heavily_compressed_attention"] * 2
                     + ["compressed_sparse_attention"],
                     mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 4, n_routed_experts=8, num_experts_per_tok=2)


def _site():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for fr in reversed(traceback.extract_stack()[:-3]):
        if fr.filename.startswith(root) and "benchmarks" not in fr.filename:
            return f"{os.path.relpath(fr.filename, root)}:{fr.lineno}"
    return "?"


def census(batch: int) -> dict:
    import triton.runtime.interpreter as interp

    import bitmatch
    import bitmatch.kernels as K
    import bitmatch.models as M
    from bitmatch.engine import Engine, SamplingParams, graphs, model_runner as mr
    from bitmatch.models.deepseek_v4_tiny import tiny_model
    from bitmatch.testing.models import random_prompts

    triton_calls, torch_ops = collections.Counter(), collections.Counter()
    on = [False]
    orig_run = interp.InterpretedFunction.run

    def run(self, *a, grid, warmup, **kw):
        if on[0] and not warmup:
            triton_calls[self.fn.__name__] += 1
        return orig_run(self, *a, grid=grid, warmup=warmup, **kw)

    def in_interpreter():
        return any(f"triton{os.sep}runtime{os.sep}interpreter.py" in fr.filename for fr in traceback.extract_stack())

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if on[0] and name not in NO_LAUNCH and not in_interpreter():
                torch_ops[(name, _site())] += 1
            return func(*args, **(kwargs or {}))

    model = bitmatch.patch(tiny_model(torch.bfloat16, seed=1, **MID_STRUCTURE))
    seen = []
    orig = M.forward_hidden

    def spy(m, ids, ctx, *a, **kw):  # the second pure-decode step (the first builds rope tables)
        if ctx.max_query_len != 1:
            return orig(m, ids, ctx, *a, **kw)
        seen.append(1)
        with K.use_backend("triton"):
            if len(seen) != 2:
                return orig(m, ids, ctx, *a, **kw).to(torch.bfloat16)
            on[0] = True
            try:
                with Count():
                    out = orig(m, ids, ctx, *a, **kw)
            finally:
                on[0] = False
            return out.to(torch.bfloat16)
    saved = [(mod, mod.forward_hidden) for mod in (M, mr, graphs)]
    interp.InterpretedFunction.run = run
    try:
        for mod, _ in saved:
            mod.forward_hidden = spy
        eng = Engine(model, num_gpu_blocks=96, max_num_seqs=8)
        eng.model_runner.simulate_buckets = True
        eng.generate(random_prompts(batch, 20, 30, seed=3),
                     SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=0), use_tqdm=False)
    finally:
        interp.InterpretedFunction.run = orig_run
        for mod, f in saved:
            mod.forward_hidden = f
    by_op, by_file = collections.Counter(), collections.Counter()
    for (op, site), n in torch_ops.items():
        by_op[op] += n
        by_file[site.rsplit(":", 1)[0]] += n
    return {"triton_launches": sum(triton_calls.values()), "torch_launches": sum(torch_ops.values()),
            "launches": sum(triton_calls.values()) + sum(torch_ops.values()),
            "triton_by_kernel": dict(triton_calls.most_common()), "torch_by_op": dict(by_op.most_common()),
            "torch_by_file": dict(by_file.most_common()),
            "torch_by_site": {f"{op} {site}": n for (op, site), n in torch_ops.most_common(40)}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for launch_census.json")
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = {"command": "launch_census.py " + " ".join(sys.argv[1:]), "machine": machine_info("cpu"),
           "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
           "setup": {"model": "DeepSeek-V4, the mid config's layer structure at hidden 64", "batch": args.batch,
                     "step": "the second pure-decode step, Triton backend under TRITON_INTERPRET=1"},
           "results": census(args.batch)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "launch_census.json"), "w") as f:
        json.dump(res, f, indent=1)
    r = res["results"]
    print(f"launches per decode step: {r['launches']} ({r['triton_launches']} Triton, {r['torch_launches']} torch)")


if __name__ == "__main__":
    main()

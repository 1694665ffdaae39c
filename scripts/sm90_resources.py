"""Compile Triton kernels for the H200 (sm_90a) on a machine without a GPU and report what ptxas
says: registers per thread, spill stores, stack frame, shared memory. A kernel that does not
compile for sm_90a, spills, or needs more shared memory than a Hopper SM has (228 KiB) shows up
here before any GPU time is spent; speed still needs the GPU.

  python scripts/sm90_resources.py                 (every preset)
  python scripts/sm90_resources.py sink_fwd sink_bwd

Triton's own ptxas (the one its wheel carries) compiles and reports; nothing runs.
"""
from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget


def resources(fn, types: dict, constexprs: dict, num_warps: int, num_stages: int = 2) -> dict:
    """Compile ``fn`` (a @triton.jit function) with argument ``types`` (name -> '*bf16', 'i32', ...)
    and ``constexprs``; ptxas's report for sm_90a."""
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: types.get(n, "constexpr") for n in names}
    missing = [n for n in names if sig[n] == "constexpr" and n not in constexprs]
    if missing:
        raise ValueError(f"{fn.fn.__name__}: give a type or a constexpr for {missing}")
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs={n: constexprs[n] for n in names if n in constexprs})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(c.asm["ptx"])
    try:
        report = subprocess.run([ptxas, "-v", "-arch=sm_90a", f.name, "-o", os.devnull],
                                capture_output=True, text=True).stderr
    finally:
        os.unlink(f.name)

    def num(pattern):
        m = re.search(pattern, report)
        return int(m.group(1)) if m else None
    return {"registers": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "stack_frame": num(r"(\d+) bytes stack frame"), "shared_bytes": c.metadata.shared,
            "num_warps": num_warps, "num_stages": num_stages}


def _sink(backward: bool):
    from bitmatch.kernels.triton import compressed_attention as CA
    from bitmatch.kernels.triton import compressed_attention_bwd as CB
    types = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "ent_ptr": "*bf16", "sel_ptr": "*i32", "sink_ptr": "*fp32",
             "o_ptr": "*bf16", "lse_ptr": "*fp32", "pos_ptr": "*i64", "start_ptr": "*i64", "seq_ptr": "*i64",
             "bt_ptr": "*i32", "bt_stride": "i32", "page_size": "i32", "H": "i32", "n_sel": "i32",
             "qk_scale": "fp32", "window": "i32", "rate": "i32", "do_ptr": "*bf16", "dq_ptr": "*fp32",
             "dkv_ptr": "*fp32", "dent_ptr": "*fp32", "dsink_ptr": "*fp32", "sm_scale": "fp32"}
    out = {}
    for mode, label in ((0, "window"), (1, "hca"), (2, "csa")):
        for paged in ((False,) if backward else (False, True)):
            if backward:
                kc = dict(D=512, BLOCK_D=512, BLOCK_H=CB.BWD_BLOCK_H, BLOCK_N=CB.BWD_BLOCK_N, PAGED=paged, MODE=mode,
                          INTERP=False, PREC="tf32")
                out[f"{label}"] = resources(CB._sink_rows_bwd_kernel, types, kc, CB.BWD_WARPS)
            else:
                kc = dict(D=512, BLOCK_D=512, BLOCK_H=CA.BLOCK_H, BLOCK_N=CA.BLOCK_N, PAGED=paged, MODE=mode,
                          INTERP=False, PREC="tf32", STORE_LSE=True)
                out[f"{label}{'/paged' if paged else '/packed'}"] = resources(CA._sink_rows_kernel, types, kc, CA.WARPS)
    return out


# name -> (what, builder): DeepSeek-V4-Flash widths (head_dim 512, bf16) for the sink attention
PRESETS = {
    "sink_fwd": ("sink_attention_rows forward, V4-Flash widths", lambda: _sink(False)),
    "sink_bwd": ("sink_attention_rows backward, V4-Flash widths", lambda: _sink(True)),
}


def main(argv=None):
    names = (argv if argv is not None else sys.argv[1:]) or list(PRESETS)
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        raise SystemExit(f"unknown preset(s) {unknown}; known: {', '.join(PRESETS)}")
    out = {n: {"what": PRESETS[n][0], "kernels": PRESETS[n][1]()} for n in names}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()

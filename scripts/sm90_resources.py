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


def resources(fn, types: dict, constexprs: dict, num_warps: int, num_stages: int = 2,
              divisible=(), aligned: bool = True, unaligned=()) -> dict:
    """Compile ``fn`` (a @triton.jit function) with argument ``types`` (name -> '*bf16', 'i32', ...)
    and ``constexprs``; ptxas's report for sm_90a. As a launch specialises them: pointers 16-byte
    aligned (``aligned``) and the integer arguments named in ``divisible`` multiples of 16. Without
    those hints the loads are not vectorised and every element keeps its own 64-bit pointer, which
    reports far more registers and spills than the kernel has on the GPU. ``unaligned``: pointers
    the kernel declares ``do_not_specialize_on_alignment``."""
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: types.get(n, "constexpr") for n in names}
    missing = [n for n in names if sig[n] == "constexpr" and n not in constexprs]
    if missing:
        raise ValueError(f"{fn.fn.__name__}: give a type or a constexpr for {missing}")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if (aligned and sig[n].startswith("*") and n not in unaligned) or n in divisible}
    src = triton.compiler.ASTSource(fn=fn, signature=sig,
                                    constexprs={n: constexprs[n] for n in names if n in constexprs}, attrs=attrs)
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
    from bitmatch.kernels.triton import compressed_attention as CA, compressed_attention_bwd as CB
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


_MOE_TYPES = {**{n: "*bf16" for n in ("x_ptr", "w_ptr", "a_ptr", "h_ptr", "g_ptr", "w_in_ptr", "w_out_ptr", "aw_ptr",
                                        "dh_ptr", "y_ptr")},
              **{n: "*i64" for n in ("tok_ptr", "tile_end_ptr", "counts_ptr", "row_start_ptr", "order_ptr")},
              "wflat_ptr": "*fp32", "dwp_ptr": "*fp32", "dxr_ptr": "*fp32", "T": "i32", "H": "i32", "I": "i32",
              "E": "i32", "K_CHUNK": "i32", "limit": "fp32", "store_h": "i32", "S": "i32", "N_IN": "i32"}


def _moe():
    """The grouped expert GEMMs at each row of their config tables (widths multiples of 16)."""
    from bitmatch.kernels.triton import moe as TM, moe_bwd as TB
    dv, out = ("H", "I", "K_CHUNK", "N_IN"), {}
    for act, name in ((0, "swiglu"), (1, "relu2")):
        for bound, BM, BN1, _, BK, warps, stages in TM.CONFIG_TABLE:
            kc = dict(ACT=act, HAS_LIMIT=False, SPLIT=1, BM=BM, BN=BN1, BK=BK, BLOCK_E=64, EVEN_K=True,
                      INTERP=False, PREC="tf32")
            out[f"gemm_in/{name}/BM{BM}"] = resources(TM._gemm_in_kernel, _MOE_TYPES, kc, warps, stages, divisible=dv)
        for bound, (BM, BN, BK, warps, stages), _ in TB.BWD_CONFIG:
            for has_h in (False, True):
                kc = dict(ACT=act, HAS_LIMIT=act == 0, HAS_H=has_h, BM=BM, BN=BN, BK=BK, BLOCK_E=64, INTERP=False,
                          PREC="tf32")
                out[f"act_bwd/{name}/BM{BM}/{'saved_h' if has_h else 'recompute'}"] = resources(
                    TB._act_bwd_kernel, _MOE_TYPES, kc, warps, stages, divisible=dv)
    for bound, (BM, BN, BK, warps, stages), _ in TB.BWD_CONFIG:
        kc = dict(BM=BM, BN=2 * BN, BK=BK, BLOCK_E=64, INTERP=False, PREC="tf32")
        out[f"dx/BM{BM}"] = resources(TB._dx_kernel, _MOE_TYPES, kc, warps, stages, divisible=dv)
    return out


def _ssd():
    """The Mamba2 SSD scan at Nemotron-H 8B widths (its fixed config)."""
    import torch

    from bitmatch.kernels.triton import mamba_ssd as MS
    names = ["x_ptr", "dt_ptr", "bias_ptr", "B_ptr", "C_ptr", "xb_ptr", "bb_ptr"]
    types = {**{n: "*bf16" for n in names}, **{n: "*fp32" for n in ("A_ptr", "D_ptr", "y_ptr", "S_ptr", "db_ptr",
                                                                      "dtp_ptr")},
             **{n: "*i32" for n in ("cu_ptr", "start_ptr", "slot_ptr")}, "dt_lo": "fp32", "has_cache": "i32"}
    cfg = MS.config_for(torch.bfloat16, 64, 128, 128)
    kc = dict(H=128, P=64, G=8, N=128, Q=128, BM=cfg["BM"], BK=cfg["BK"], BP=cfg["BP"], HAS_BIAS=True, HAS_D=True,
              INTERP=False, PREC="tf32")
    return {"ssd/bf16": resources(MS._ssd_kernel, types, kc, cfg["num_warps"], cfg["num_stages"],
                                  unaligned=MS._NO_ALIGN)}


# name -> (what, builder): DeepSeek-V4-Flash widths (head_dim 512, bf16) for the sink attention
PRESETS = {
    "sink_fwd": ("sink_attention_rows forward, V4-Flash widths", lambda: _sink(False)),
    "sink_bwd": ("sink_attention_rows backward, V4-Flash widths", lambda: _sink(True)),
    "moe": ("grouped expert GEMMs, forward and backward, every config-table row", _moe),
    "mamba_ssd": ("Mamba2 SSD scan, Nemotron-H 8B widths", _ssd),
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

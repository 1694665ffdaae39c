"""One renderer per op / kernel benchmark: a result JSON -> markdown lines."""
from __future__ import annotations

import json

from results_format import date_of, fmt, get, header, machine_of, table


def r_gpu_ops(d):
    s = d.get("summary", {})
    att = s.get("attention_rowsum16", {})
    rows = [
        ["linear vs cuBLAS, geomean M <= 256", s.get("linear_geomean_M<=256")],
        ["linear vs cuBLAS, geomean M >= 1024 (best of tile table and TMA)",
         s.get("linear_geomean_M>=1024_best_of_table_and_tma")],
        ["linear vs cuBLAS, lowest M >= 1024 (best of tile table and TMA)",
         s.get("linear_min_M>=1024_best_of_table_and_tma")],
        ["linear vs cuBLAS with split-K off, geomean M <= 256", s.get("linear_vs_cublas_nosplit_geomean_M<=256")],
        ["attention prefill vs SDPA flash, lowest", att.get("prefill_ratio_min")],
        ["attention decode / K/V-read roofline, geomean", att.get("decode_vs_roofline_geomean")],
        ["attention decode / roofline, geomean at K/V >= 64 MiB",
         att.get("decode_vs_roofline_geomean_kv_bytes>=64MiB")],
        ["attention decode vs SDPA flash, geomean", att.get("decode_vs_sdpa_geomean")],
        ["attention backward vs SDPA flash backward, geomean", s.get("attention_bwd_geomean")],
        ["attention fwd+bwd vs SDPA flash, geomean", s.get("attention_fwd_bwd_geomean")],
        ["attention rows differing alone vs batched (invariance)", s.get("inv_attention_rowsum16_mismatching_rows")],
    ]
    for k, v in (s.get("attention_bwd_vs_sdpa_cudnn") or {}).items():
        rows.append([f"attention backward vs SDPA cuDNN backward, {k}", v])
    for k, v in (s.get("attention_fwd_bwd_vs_sdpa_cudnn") or {}).items():
        rows.append([f"attention fwd+bwd vs SDPA cuDNN, {k}", v])
    for k, v in (s.get("attention_bwd_cudnn_over_triton") or {}).items():
        rows.append([f"attention backward on cuDNN (from our forward) vs our Triton backward, lengths {k}", v])
    for k, v in (s.get("linear_tma_best_vs_cublas") or {}).items():
        rows.append([f"linear vs cuBLAS, {k} (best bit-equal TMA config)", v])
    rows = [r for r in rows if r[1] is not None]
    rowwise = s.get("rowwise_ratios", {})
    for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "apply_rotary", "token_logprobs", "full_logprobs"):
        vals = [v for k, v in rowwise.items() if k.startswith(op + "_")]
        if vals:
            rows.append([f"{op} vs torch eager (range over sizes)", f"{fmt(min(vals))}-{fmt(max(vals))}"])
    out = header(d) + ["Ratio = stock time / bitmatch time, same run (> 1: bitmatch faster).", ""]
    out += table(["what", "ratio"], rows)
    for k in ("followup_run", "followup_run_2"):
        f = d.get(k)
        a = get(f, "summary", "attention_rowsum16", default=None)
        if isinstance(a, dict):
            out += ["", f"Follow-up `{k}` (`{f.get('command', '-')}`, {date_of(f)}): attention decode / roofline "
                    f"geomean {fmt(a.get('decode_vs_roofline_geomean'))}, at K/V >= 64 MiB "
                    f"{fmt(a.get('decode_vs_roofline_geomean_kv_bytes>=64MiB'))}; prefill vs SDPA flash lowest "
                    f"{fmt(a.get('prefill_ratio_min'))}; rows differing "
                    f"{fmt(get(f, 'summary', 'inv_attention_rowsum16_mismatching_rows'))}."]
    return out


def r_launch_census(d):
    r, b = d.get("results", {}), get(d, "baseline", "results", default={})
    rows = [["kernel launches per decode step", b.get("launches"), r.get("launches")],
            ["Triton launches", b.get("triton_launches"), r.get("triton_launches")],
            ["torch launches", b.get("torch_launches"), r.get("torch_launches")]]
    out = header(d) + [f"Counted on CPU (no GPU timing): {get(d, 'setup', 'model', default='-')}, batch "
                       f"{get(d, 'setup', 'batch', default='-')}; baseline: commit "
                       f"`{str(get(d, 'baseline', 'commit', default='-'))[:10]}`, the same script.", ""]
    out += table(["what", "baseline", "this run"], rows)
    top = list(r.get("triton_by_kernel", {}).items())[:8] + list(r.get("torch_by_op", {}).items())[:8]
    return out + ["", "Largest counts in this run: " + ", ".join(f"`{k}` {v}" for k, v in top) + "."]


def r_attention_decode(d):
    rows = []
    for name, c in d.get("cases", {}).items():
        rows.append([c.get("B"), c.get("ctx"), c.get("max_seq_len"), c.get("old_frac_floor"),
                     c.get("new_default_frac_floor"), c.get("old_vs_new_elements_differing")])
    return header(d) + ["Fraction of the K/V-read floor (higher is better); old = the kernel before the change.",
                        ""] + \
        table(["B", "context", "captured for", "old / floor", "new / floor", "elements differing old vs new"], rows)


def _check_rows(c):
    rows = c.get("rows", [])
    ops = [r for r in rows if not r.get("control")]
    ctl = [r for r in rows if r.get("control")]
    return [c.get("command"), f"{sum(1 for r in ops if not r.get('mismatch_found'))} of {len(ops)}",
            f"{sum(1 for r in ctl if r.get('mismatch_found'))} of {len(ctl)}", c.get("exit_code")]


def r_check_cuda(d):
    out = [f"- machine: {machine_of(d)}", f"- date: {date_of(d)}", ""]
    rows = [_check_rows(d[k]) for k in ("check", "check_family_dense") if isinstance(d.get(k), dict)]
    return out + table(["command", "ops with 0 mismatches", "stock controls that mismatch", "exit code"], rows)


def r_moe_layer(d):
    rows = []
    for tokens, r in d.get("runs", {}).items():
        q = r.get("ratio_stock_over_ours", {})
        rows.append([tokens, q.get("hf_grouped_mm_layer"), q.get("torch_grouped_mm_layer"), q.get("hf_eager_layer"),
                     r.get("ours_alone_vs_batch_rows_differ")])
    out = header(d) + ["Whole MoE layer (route + experts + combine); ratio = stock time / bitmatch time.", ""]
    out += table(["tokens", "vs HF grouped_mm", "vs torch._grouped_mm", "vs HF eager", "rows differ alone vs batch"],
                 rows)
    bwd = d.get("backward")
    if isinstance(bwd, dict):
        out += ["", "Forward + backward:", ""]
        out += table(["tokens", "vs HF grouped_mm layer", "vs torch._grouped_mm layer", "run to run identical"],
                     [[t, get(b, "ratio_stock_over_ours", "hf_grouped_mm_layer_fwd_bwd"),
                       get(b, "ratio_stock_over_ours", "torch_grouped_mm_layer_fwd_bwd"),
                       b.get("bwd_run_to_run_identical")]
                      for t, b in bwd.items()])
    return out


def dsv4_decode_lines(k, dec, tiles):
    """The decode step (ms, roofline, the graph replay's top kernels) and the decode-linear tile sweep."""
    out = []
    if dec:
        out += ["", f"Decode step ({k}, B = {fmt(dec.get('batch'))}, {fmt(dec.get('context_tokens'))} tokens of "
                f"context): {fmt(dec.get('step_ms'))} ms, {fmt(dec.get('fraction_of_roofline'))} of the weight + "
                f"cache roofline ({fmt(dec.get('roofline_ms'))} ms at {fmt(dec.get('hbm_tbps'))} TB/s); steps "
                f"{fmt(dec.get('steps_ms'))} ms, graph captures after each {fmt(dec.get('captures_after_each_step'))}."]
        top = get(dec, "profile", "graph_step", "top")
        if top:
            out += ["", f"One graph replay's kernels (total {fmt(get(dec, 'profile', 'graph_step', 'total_kernel_ms'))}"
                    " ms):", ""] + table(["kernel", "calls", "ms"], [[e["name"][:60], e["calls"],
                                                                      e["ms"]] for e in top])
    if tiles:
        rows = [[s, v.get("calls_per_step"), fmt(v.get("table_cfg")), v.get("table_ms"), v.get("best"),
                 v.get("best_ms")]
                for s, v in tiles.get("shapes", {}).items()]
        out += ["", f"Decode linears ({k}): each shape graph-timed alone over the decode tiles, bits equal to the "
                "table's for every candidate:", ""]
        out += table(["shape", "calls per step", "table tiles", "table ms", "fastest bit-equal tiles", "its ms"], rows)
        steps = [[n, v.get("median_ms"), fmt(v.get("steps_ms"))] for n, v in tiles.get("decode_steps", {}).items()]
        out += ["", "The decode step side by side in one engine:", ""] + table(["variant", "median ms", "steps ms"],
                                                                               steps)
    return out


def r_dsv4_decode_ops(d):
    """deepseek_v4_decode_ops.py: the step's kernels, its linears by shape, cold linears per split, mix."""
    res, out = d.get("results", {}), header(d)
    st = res.get("step")
    if st:
        out += [f"Decode step (B = {fmt(st.get('batch'))}): {fmt(st.get('step_ms'))} ms median (graphs), "
                f"{fmt(st.get('kernels'))} kernels busy {fmt(st.get('kernel_busy_ms'))} ms in one profiled replay.", ""]
        out += table(["kernel", "calls", "ms"], [[k[:60], v.get("calls"), v.get("ms")]
                                                 for k, v in list(st.get("by_kernel_ms", {}).items())[:12]])
        out += ["",
                "The invariant linear's launches of that replay by shape (launch order matched to an eager "
                "step's):", ""]
        out += table(["shape", "calls", "us per call", "tiles"],
                     [[k, v["calls"], v["us"] / v["calls"], fmt(v.get("cfg"))]
                      for k, v in st.get("linear_by_shape", {}).items()])
    cold = res.get("linears_cold")
    if cold:
        out += ["", "Each linear shape cold (weights rotated past L2, one CUDA graph), the fastest bit-equal tiles "
                "per K split (split 1: the order of that run; others: other orders):", ""]
        out += table(["shape", "calls per step", "split 1 us", "split 2 us", "split 4 us", "split 1 tiles"],
                     [[k, v.get("calls_per_step"), get(v, "splits", "1", "best_us"), get(v, "splits", "2", "best_us"),
                       get(v, "splits", "4", "best_us"), get(v, "splits", "1", "best")] for k, v in cold.items()])
    mix = res.get("mix")
    if mix:
        out += ["", f"mHC mix at T = {fmt(mix.get('T'))} per K chunk (hc_k_chunk):", ""]
        out += table(["hc_k_chunk", "programs", "mix us", "hc_pre us"],
                     [[k, v.get("programs"), v.get("mix_us"), v.get("hc_pre_us")] for k, v in mix.get("hc_k_chunk",
                                                                                                      {}).items()])
    if d.get("note"):
        out += ["", f"Note: {fmt(d['note'])}"]
    return out


def r_mamba_ssd(d):
    out = header(d) + [f"Kernels: {fmt(d.get('kernels'))}", ""]
    rows, checks = [], []
    for name, s in d.get("shapes", {}).items():
        c = s.get("checks") or {}   # None: a run with --no-checks
        checks.append([name, c.get("prefill_vs_chunked_equal"), c.get("prefill_vs_decode_equal"),
                       c.get("prefill_vs_token_by_token_equal"), c.get("packed_vs_alone_equal")])
        for r in s.get("prefill", []):
            rows.append([name, f"prefill {r.get('tokens')} tokens", r.get("ours_ms"), r.get("mamba_ssm_ms"),
                         r.get("ratio_mamba_ssm_over_ours")])
        for r in s.get("decode", []):
            rows.append([name, f"decode step B = {r.get('batch')} (eager / graph)",
                         f"{fmt(r.get('ours_ms'))} / {fmt(r.get('ours_graph_ms'))}",
                         f"{fmt(r.get('mamba_ssm_ms'))} / {fmt(r.get('mamba_ssm_graph_ms'))}",
                         f"{fmt(r.get('ratio_ours_over_mamba_ssm'))} / "
                         f"{fmt(r.get('ratio_graph_ours_over_mamba_ssm'))}"])
        for r in s.get("backward", []):
            if "ours_fwd_bwd_ms" not in r:
                continue
            rows.append([name, f"forward + backward {r.get('tokens')} tokens (largest gradient error vs fp32 torch: "
                         f"ours {fmt(max((r.get('ours_grad_rel_err') or {0: None}).values()))}, mamba_ssm "
                         f"{fmt(max((r.get('mamba_ssm_grad_rel_err') or {0: None}).values()))})",
                         r.get("ours_fwd_bwd_ms"), r.get("mamba_ssm_fwd_bwd_ms"), r.get("ratio_mamba_ssm_over_ours")])
    out += table(["shape", "what", "bitmatch ms", "mamba_ssm ms",
                  "ratio (prefill, backward: theirs / ours; decode: ours / theirs)"], rows)
    out += [""] + table(["shape", "prefill == chunked", "prefill == decode", "prefill == token by token",
                         "packed == alone"], checks)
    var = []   # launch-config variants of the same run (bitmatch only), bits checked against the prefill
    for name, s in d.get("shapes", {}).items():
        for key in ("variants", "decode_variants"):
            for v in s.get(key, []):
                times = [f"prefill {r.get('tokens')}: {fmt(r.get('ours_ms'))}" for r in v.get("prefill", [])]
                times += [f"decode B = {r.get('batch')}: {fmt(r.get('ours_graph_ms'))}" for r in v.get("decode", [])]
                var.append([name, fmt(v.get("override")) + (" (decode calls)" if key == "decode_variants" else ""),
                            v.get("prefill_vs_decode_equal"), "; ".join(times) or v.get("error", "")])
    if var:
        out += ["", "Config variants of this run (bitmatch ms; decode graph-timed):", ""]
        out += table(["shape", "override", "prefill == decode", "ms"], var)
    if d.get("note"):
        out += ["", f"Note: {d['note']}"]
    return out


def r_mamba(d):
    c = d.get("checks", {})
    out = header(d) + [f"One SSM layer (shapes {fmt(d.get('shapes'))}): prefill == decode "
                       f"{fmt(c.get('prefill_vs_decode_equal'))}, prefill == chunked "
                       f"{fmt(c.get('prefill_vs_chunked_equal'))}; "
                       f"control HF chunked == recurrent {fmt(c.get('control_hf_chunked_vs_recurrent_equal'))}.", ""]
    out += table(["decode batch", "context", "bitmatch / HF recurrent time (lower is better)"],
                 [[r.get("batch"), r.get("context"), r.get("ratio_ours_over_hf")] for r in d.get("decode", [])])
    out += [""] + table(["prefill tokens", "HF chunked time / bitmatch time"],
                        [[r.get("tokens"), r.get("ratio_hf_over_ours")] for r in d.get("prefill", [])])
    return out


def r_sampler(d):
    rows = []
    for r in d.get("results", []):
        rows.append([r.get("B"), get(r, "time_kernel_T1", "speedup"), r.get("tokens_mismatch_vs_torch_cuda"),
                     r.get("tokens_mismatch_vs_cpu"), r.get("control_recip_T_weights_mismatch"),
                     r.get("graph_equal_eager")])
    out = header(d)
    if d.get("run"):
        out += [f"Run: {fmt(d['run'])}", ""]
    return out + table(["B", "Triton sampler vs torch (speedup)", "tokens differing vs torch CUDA",
                        "tokens differing vs CPU", "control x*(1/T): weights differing", "graph == eager"], rows)


def r_fp8_linear(d):
    """benchmarks/ops/fp8_linear.py: M-invariance of the FP8 linear (and of torch's block-wise _scaled_mm), ms."""
    sec = d.get("sections", d)
    inv = [[shape, r.get("rows_mismatching_total"), (r.get("control_scaled_mm_blockwise") or {}).get(
        "rows_mismatching_total")] for shape, r in (sec.get("invariance") or {}).items()]
    tiles = {shape: sum(v for by_m in t.values() for v in by_m.values())
             for shape, t in (sec.get("tiles") or {}).items()}
    out = header(d) + ["Rows that differ between a batch and its row slices, M = 1..512 (want 0; the control "
                       "is torch's block-wise `_scaled_mm`); tiles differing from the default tile, every M: "
                       f"{fmt(tiles)}.", ""]
    out += table(["weight [N, K]", "bitmatch fp8_linear rows differing", "_scaled_mm block-wise rows differing"], inv)
    cols = ("bitmatch_fp8_linear", "bitmatch_fp8_gemm_only", "bitmatch_fp8_quant_only", "torch_scaled_mm_blockwise",
            "torch_scaled_mm_per_tensor", "bitmatch_bf16_linear", "cublas_bf16_linear",
            "gemm_speed_vs_scaled_mm_blockwise")
    rows = [[k] + [t.get(c) for c in cols] for k, t in (sec.get("time_ms") or {}).items()]
    return out + ["", "ms per call (the last column: block-wise _scaled_mm ms / bitmatch GEMM ms)", ""] + \
        table(["shape, T", *cols], rows)


def r_mhc(d):
    rows = []
    for n, r in sorted(d.get("runs", {}).items(), key=lambda kv: int(kv[0])):
        for op, t in r.get("ms", {}).items():
            q = t.get("ratio_vs_fused", {})
            rows.append([n, op, t.get("fused"), q.get("composed"), q.get("hf")])
    inv = {k: v for r in d.get("runs", {}).values() for k, v in r.get("invariance_cases_differing", {}).items()}
    return header(d) + ["ms of the fused Triton kernels; ratio = other ms / fused ms (> 1: fused faster). "
                        f"Batch-invariance cases differing: {fmt(inv)}.", ""] + \
        table(["tokens", "op", "fused ms", "previous composition / fused", "HF modules / fused"], rows)


def r_golden_gpu(d):
    note = d.get("interpreter_note")
    out = header(d) + ([f"**{note}**",
                        ""] if note else []) + [f"{fmt(d.get('cases'))} cases of every op in the op table on "
                                                f"CUDA, each run twice; not repeating: "
                       f"{fmt(d.get('not_repeating'))}; errors: {fmt(d.get('errors'))}; stamp "
                       f"{fmt(get(d, 'stamp', 'fingerprint'))}.", ""]
    return out + table(["op", "case", "xxh3 of the output bytes"],
                       [[op, s, h] for op, v in sorted(d.get("bits", {}).items()) for s, h in v.items()])


def r_cpu_ops(d):
    g = d.get("geomean_ratio_by_op", {})
    return header(d) + ["Ratio = stock time / bitmatch time (the exact CPU reference; < 1: slower).", ""] + \
        table(["op", "geomean ratio"], [[k, v] for k, v in g.items()])


def r_probe(d) -> list[str]:
    """A one-question GPU probe: what it asked, how, the answer."""
    m = d.get("machine") or {}
    out = [f"- Question: {d.get('what', '-')}", f"- Command: `{d.get('command', '-')}`",
           f"- Machine: {m.get('gpu', '-')}, torch {d.get('torch') or m.get('torch', '-')}"]
    res = d.get("result", d.get("diag"))
    if res is not None:
        out.append(f"- Measured: `{json.dumps(res)[:600]}`")
    out.append(f"- Answer: {d.get('conclusion', '-')}")
    return out

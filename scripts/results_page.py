"""Generate docs/results.md from benchmarks/results/*.json (one table per benchmark file) and the
README's headline lines (one per family, between its generated-block markers).

    python scripts/results_page.py            # rewrite docs/results.md and the README's block
    python scripts/results_page.py --check    # exit 1 if either differs from what the JSON gives

Every figure on the page and in the README's block is read from the JSON, never typed. The files
have one shape per benchmark, so each known benchmark has its own renderer (``RENDERERS``); a file
is matched to the longest known name its stem starts with (``sampler_h200_run1.json`` ->
``sampler_h200``), so a new run of a known benchmark renders without an edit here. The README's
lines read the files ``HEADLINES`` names (the vLLM line: the newest ``vllm_gpu_h100_run<N>.json``).
Files of no known benchmark are listed by name at the end; a known file whose shape a renderer
cannot read is listed with the error (never silently dropped).
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "results.md"


# ----------------------------------------------------------------------------- formatting

def fmt(x) -> str:
    """3 significant digits for floats, ints as they are, bools as yes / no, missing as '-'."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return str(x)
        return f"{x:.3g}"
    if isinstance(x, (list, tuple)):
        return " x ".join(fmt(v) for v in x)
    return str(x).replace("|", "\\|").replace("\n", " ")


def get(d, *path, default=None):
    """d[path[0]][path[1]]...; ``default`` where any step is missing."""
    for k in path:
        if isinstance(d, dict) and k in d:
            d = d[k]
        elif isinstance(d, list) and isinstance(k, int) and -len(d) <= k < len(d):
            d = d[k]
        else:
            return default
    return d


def table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return out


def machine_of(d) -> str:
    m = d.get("machine")
    if isinstance(m, str):
        cores = f", {d['cpus']} cores" if d.get("cpus") else ""
        return m + cores + (f", torch {d['torch']}" if d.get("torch") else "")
    if not isinstance(m, dict):
        m = {}
    v = d.get("versions") if isinstance(d.get("versions"), dict) else {}
    parts = [m.get("gpu") or d.get("device") or m.get("cpu") or m.get("processor") or m.get("platform")]
    cores = m.get("cores") or m.get("cpu_count") or d.get("cpus")
    if cores and not m.get("gpu"):
        parts.append(f"{cores} cores")
    torch = m.get("torch") or v.get("torch") or d.get("torch")
    if torch:
        parts.append(f"torch {torch}")
    triton = m.get("triton") or v.get("triton")
    if triton:
        parts.append(f"triton {triton}")
    return ", ".join(str(p) for p in parts if p) or "-"


def date_of(d) -> str:
    for k in ("started_utc", "date_utc", "time_utc", "finished_utc"):
        if d.get(k):
            return str(d[k])
    return "-"


def header(d, command=None) -> list[str]:
    cmd = command or d.get("command") or "-"
    return [f"- command: `{cmd}`", f"- machine: {machine_of(d)}", f"- date: {date_of(d)}", ""]


# ----------------------------------------------------------------------------- renderers (one per benchmark)

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


def _latest_runs_by_section(runs: dict) -> dict:
    latest = {}
    for name, r in runs.items():
        for sec in (r.get("sections") or {}):
            latest[sec] = name
    return latest


def r_gpu_e2e(d):
    runs = d.get("runs", {})
    latest = {k: v for k, v in _latest_runs_by_section(runs).items()
              if k in ("diff", "train", "cuda_controls", "lora") or k.startswith("rollout")}
    out = ["Ratios: stock time / bitmatch time unless named otherwise; each section from the latest run holding it.",
           ""]
    used = sorted(set(latest.values()))
    for name in used:
        r = runs[name]
        out.append(f"- `{name}`: `{r.get('command', '-')}`; {machine_of(r)}; {date_of(r)}")
    out.append("")
    diff = get(runs, latest.get("diff"), "sections", "diff")
    if isinstance(diff, dict):
        out.append(f"**Diff** (`{latest['diff']}`): engine vs `token_logprobs` {fmt(diff.get('total_mismatches'))} "
                   f"mismatches of {fmt(diff.get('total_tokens'))} sampled tokens; stock HF trainer "
                   f"{fmt(diff.get('total_control_mismatches'))} of {fmt(diff.get('total_tokens'))}; same "
                   f"tokens across "
                   f"configs: {fmt(diff.get('same_tokens_across_configs'))}.")
        out.append("")
    for sec in sorted(s for s in latest if s.startswith("rollout")):
        by_size = get(runs, latest[sec], "sections", sec, default={})
        sizes = by_size.items() if sec == "rollout" else [(sec.split(":", 1)[-1], by_size)]
        for size, bs in sizes:
            if not isinstance(bs, dict):
                continue
            rows = []
            for bname, b in sorted(bs.items(), key=lambda kv: get(kv[1], "B", default=0) or 0):
                if not isinstance(b, dict):
                    continue
                rows.append([b.get("B"), b.get("decode_fraction_of_roofline"), b.get("tokens_per_s_vs_stock_ops"),
                             b.get("tokens_per_s_vs_hf_generate"), b.get("decode_step_vs_hf"),
                             b.get("graph_decode_speedup_vs_eager")])
            out.append(f"**Rollout, {size}** (`{latest[sec]}`)")
            out.append("")
            out += table(["B", "decode step / roofline", "tokens/s vs same engine on stock ops",
                          "tokens/s vs HF generate", "decode step vs HF's", "graphs vs eager decode"], rows)
            out.append("")
    lora = get(runs, latest.get("lora"), "sections", "lora")
    if isinstance(lora, dict):
        out.append(f"**LoRA rollout vs the same model merged** (`{latest['lora']}`)")
        out.append("")
        out += table(["size", "B", "rank", "tokens/s LoRA / merged", "decode speed LoRA / merged",
                      "LoRA graphs vs eager", "Diff (mismatches / tokens)"],
                     [[k, v.get("B"), v.get("rank"), v.get("tokens_per_s_lora_vs_merged"),
                       v.get("decode_step_lora_vs_merged"), v.get("tokens_per_s_lora_graphs_vs_eager"),
                       f"{fmt(v.get('diff_mismatches'))} / {fmt(v.get('diff_tokens'))}"]
                      for k, v in lora.items() if isinstance(v, dict)])
        out.append("")
    train = get(runs, latest.get("train"), "sections", "train")
    if isinstance(train, dict):
        out.append(f"**Training, `token_logprobs` fwd+bwd vs stock HF** (`{latest['train']}`)")
        out.append("")
        out += table(["size", "batch", "tokens/s ratio", "peak memory ratio"],
                     [[k, v.get("batch"), v.get("tokens_per_s_ratio"), v.get("peak_memory_ratio")]
                      for k, v in train.items() if isinstance(v, dict)])
        out.append("")
    ctl = get(runs, latest.get("cuda_controls"), "sections", "cuda_controls")
    if isinstance(ctl, dict):
        checks = ctl.get("check_controls", {})
        hit = sum(1 for v in checks.values() if isinstance(v, dict) and v.get("mismatch_found"))
        out.append(f"**CUDA controls** (`{latest['cuda_controls']}`): {hit} of {len(checks)} stock controls found a "
                   f"mismatch ({', '.join(k.replace('control: ', '') for k in checks)}); bitmatch's linear at small M "
                   f"vs M = 4096: {fmt(ctl.get('bitmatch_linear_rows_differing'))} rows differ.")
    return out


def r_engine_step(d):
    rows = []
    for name, b in get(d, "sections", "steps", default={}).items():
        ph = b.get("phases_ms", {})
        rows.append([b.get("B"), b.get("plain_step_ms"), get(b, "graph_replay_gpu_ms", "back_to_back_gpu_ms"),
                     ph.get("step_inputs"), ph.get("graph_uploads"), ph.get("readback"), ph.get("engine_bookkeeping"),
                     b.get("roofline_ms"), b.get("fraction_of_roofline")])
    return header(d) + table(["B", "step ms", "graph GPU ms", "schedule + inputs ms", "uploads ms", "readback ms",
                              "bookkeeping ms", "roofline ms", "step / roofline"], rows)



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


def r_moe_e2e(d):
    a = d.get("args", {})
    secs = d.get("sections", {})
    out = header(d) + [f"Random weights: hidden {fmt(a.get('hidden'))}, {fmt(a.get('layers'))} layers, "
                       f"{fmt(a.get('experts'))} experts top-{fmt(a.get('top_k'))}.", ""]
    if secs.get("diff"):  # a run of some sections only (--sections train) has no rows here
        out += table(["Diff config", "CUDA graphs", "tokens", "mismatches", "stock HF mismatches"],
                     [[c.get("config"), c.get("graphs_on"), c.get("tokens"), c.get("mismatches"),
                       c.get("control_stock_hf_mismatches")] for c in secs["diff"]]) + [""]
    if secs.get("rollout"):
        out += table(["rollout B", "tokens/s vs engine with HF's MoE block", "vs HF generate", "graphs vs eager",
                      "graphs == eager bits"],
                     [[b.get("B"), b.get("vs_stock_moe_block"), b.get("vs_hf_generate"), b.get("graphs_vs_eager"),
                       b.get("graphs_vs_eager_bits_equal")] for b in secs["rollout"].values()])
    t = secs.get("train")
    if isinstance(t, dict):
        syncs = t.get("host_syncs_ours")
        out += ["", f"Training fwd+bwd vs stock HF (batch {fmt(t.get('batch'))}): tokens/s ratio "
                f"{fmt(t.get('tokens_per_s_ratio'))}, peak memory ratio {fmt(t.get('peak_memory_ratio'))}"
                + (f", host syncs per step {fmt(syncs.get('count'))}" if isinstance(syncs, dict) else "") + "."]
    return out


def r_nemotron_h_e2e(d):
    """benchmarks/nemotron_h_e2e.py: Diff with graphs, rollout and training vs HF with the Mamba kernels."""
    a, secs = d.get("args", {}), d.get("sections", {})
    kern = d.get("hf_kernels") or {}
    out = header(d) + [f"Random weights: hidden {fmt(a.get('hidden'))}, blocks {fmt(a.get('blocks'))}, Mamba "
                       f"{fmt(a.get('mamba_heads'))} heads x {fmt(a.get('mamba_head_dim'))}, chunk "
                       f"{fmt(a.get('chunk'))}"
                       + (f" (ours scans in chunks of {d['scan_chunk']})"
                          if d.get("scan_chunk") not in (None, a.get("chunk")) else "")
                       + ". HF's Mamba functions ran: " + "; ".join(f"{k}: {v}" for k, v in kern.items()) + ".", ""]
    if secs.get("diff"):
        out += table(["Diff config", "CUDA graphs", "tokens", "mismatches", "stock HF mismatches"],
                     [[c.get("config"), c.get("graphs_on"), c.get("tokens"), c.get("mismatches"),
                       c.get("control_stock_hf_mismatches")] for c in secs["diff"]]) + [""]
    if secs.get("rollout"):
        out += table(["rollout B", "tokens/s vs HF generate", "graphs vs eager", "graphs == eager bits"],
                     [[b.get("B"), b.get("vs_hf_generate"), b.get("graphs_vs_eager"),
                       b.get("graphs_vs_eager_bits_equal")]
                      for b in secs["rollout"].values() if isinstance(b, dict)])
    t = secs.get("train")
    if isinstance(t, dict):
        out += ["", f"Training fwd+bwd vs HF (batch {fmt(t.get('batch'))}): tokens/s ratio "
                f"{fmt(t.get('tokens_per_s_ratio'))}, peak memory ratio {fmt(t.get('peak_memory_ratio'))}."]
        ga = t.get("grad_agreement")
        if isinstance(ga, dict):
            out += [f"Gradients vs HF's (same weights, bf16 forwards that differ by rounding): median max-relative "
                    f"difference {fmt(ga.get('median_rel_err'))} over {fmt(ga.get('params'))} parameters; largest: "
                    + ", ".join(f"{k} {fmt(v)}" for k, v in (ga.get("worst") or {}).items()) + "."]
    return out


def r_gpu_train(d):
    """benchmarks/gpu_train.py --sections train: bitmatch vs stock HF and vs HF + Liger."""
    rows = []
    for size, t in get(d, "sections", "train", default={}).items():
        if not isinstance(t, dict):
            continue
        syncs = t.get("host_syncs_ours")
        rows.append([size, t.get("batch"), t.get("tokens_per_s_ratio"), t.get("peak_memory_ratio"),
                     t.get("tokens_per_s_ratio_vs_liger"), t.get("peak_memory_ratio_vs_liger"),
                     syncs.get("count") if isinstance(syncs, dict) else None])
    out = header(d) + ["Ratio = bitmatch tokens/s / baseline tokens/s; memory = bitmatch peak / baseline peak.", ""] + \
        table(["model", "batch", "vs stock HF", "memory vs HF", "vs HF + Liger", "memory vs HF + Liger",
               "host syncs per step"], rows)
    return out + (["", f"Note: {fmt(d['note'])}"] if d.get("note") else [])


def r_tp_layout(d):
    """benchmarks/tp_layout.py --world N: TP = N gather layout and stock all-reduce layout vs TP = 1."""
    r = get(d, "sections", "tp_layout", default={})
    n = r.get("world")
    rows = []
    for layout in ("gather", "allreduce"):
        x = r.get(f"tp{n}_{layout}", {})
        roll = x.get("rollout", {})
        rows.append([layout, x.get("trainer_logprob_mismatches"), x.get("of"), roll.get("token_mismatches"),
                     roll.get("logprob_mismatches_on_equal_tokens"), x.get("forward_ms"), roll.get("tokens_per_s")])
    return header(d) + [f"TP = {fmt(n)} over {fmt(r.get('backend'))}; TP = 1 forward "
                        f"{fmt(r.get('tp1_forward_ms'))} ms, "
                        f"rollout {fmt(get(r, 'tp1_rollout_graphs', 'tokens_per_s'))} tokens/s with CUDA graphs, "
                        f"{fmt(get(r, 'tp1_rollout_eager', 'tokens_per_s'))} eager. Gather / stock: forward time "
                        f"{fmt(r.get('forward_gather_over_allreduce_time'))}, rollout tokens/s "
                        f"{fmt(r.get('rollout_gather_over_allreduce_tokens_per_s'))}.", ""] + \
        table(["layout", "trainer logprobs differing from TP = 1", "of", "rollout tokens differing",
               "rollout logprobs differing", "forward ms", "rollout tokens/s (eager)"], rows)


def r_tp_dp_ep(d):
    """benchmarks/tp_layout.py --layout dp_ep: data-parallel attention + EP vs one process, stock EP."""
    r = get(d, "sections", "dp_ep", default={})
    rows = []
    for key, label in (("slot_order", "slot-order combine (bitmatch)"),
                       ("stock_allreduce", "stock: partials all-reduced")):
        x = r.get(key, {})
        per_rank = "; ".join("/".join(str(v) for v in m) for m in x.get("mismatches_per_rank") or [])
        rows.append([label, per_rank or None, x.get("of"), x.get("forward_ms"),
                     get(x, "rollout", "tokens_per_s")])
    return header(d) + [f"EP = {fmt(r.get('world'))} over {fmt(r.get('backend'))}, {fmt(r.get('tokens_per_rank'))} "
                        f"tokens per rank; one process holding every expert: forward "
                        f"{fmt(r.get('one_process_forward_ms'))} ms, "
                        f"rollout {fmt(get(r, 'one_process_rollout', 'tokens_per_s'))} tokens/s (eager). Slot order / "
                        f"stock forward time {fmt(r.get('forward_slot_order_over_stock_time'))}.", ""] + \
        table(["EP combine", "mismatches per rank: trainer / rollout tokens / rollout logprobs", "of", "forward ms",
               "rollout tokens/s"], rows)


def r_tp_shard_linear(d):
    """benchmarks/tp_layout.py --world 1: a TP rank's row-parallel linear in the two layouts, one GPU."""
    rows = [[r.get("linear"), r.get("tokens"), r.get("tp"), r.get("gather_rows_ms"), r.get("stock_cols_cublas_ms"),
             r.get("gather_over_stock_cublas_time"), r.get("gather_over_tp1_share_time")]
            for r in get(d, "sections", "shard_linear", default=[])]
    return header(d) + ["gather: [T, K] x [N / TP, K] on bitmatch's linear (full K); stock: [T, K / TP] x [N, K / TP] "
                        "on cuBLAS, before its all-reduce.", ""] + \
        table(["linear", "tokens", "TP", "gather ms", "stock ms", "gather / stock time", "gather / (TP = 1 / TP)"],
              rows)


def _dsv4_rows(name, r):
    q, res = r.get("ratios", {}), r.get("results", {})
    return [name, get(r, "setup", "config"), q.get("train_bitmatch_over_hf"), q.get("rollout_bitmatch_over_hf"),
            get(res, "diff", "mismatches", default=None) if isinstance(res.get("diff"), dict) else None,
            get(res, "diff", "tokens") if isinstance(res.get("diff"), dict) else res.get("diff_zero_tokens")]


def r_deepseek_v4(d):
    runs = d.get("runs") or {"run": d}
    first = next(iter(runs.values()))
    out = header(first) + ["Ratio = bitmatch tokens/s / HF's own implementation's tokens/s (< 1: slower).", ""]
    out += table(["run", "config", "train fwd+bwd", "engine decode vs HF generate", "Diff mismatches", "tokens"],
                 [_dsv4_rows(k, r) for k, r in runs.items()])
    blocks = [(k, r) for k, r in runs.items() if get(r, "results", "attention_block")]
    for k, r in blocks:
        rows = [[lt, b.get("decode_us_per_token"), b.get("prefill_us_per_token"),
                 b.get("engine_vs_trainer_rows_differing")]
                for lt, b in get(r, "results", "attention_block").items()]
        out += ["", f"Attention block alone ({k}: one layer of each type, trainer prefill vs engine decode):", ""]
        out += table(["layer type / decode batch", "decode us per token", "prefill us per token",
                      "engine vs trainer rows differing"], rows)
    for k, r in runs.items():
        out += _dsv4_decode(k, get(r, "results", "decode_step"), get(r, "results", "tiles"))
    if d.get("note"):
        out += ["", f"Note: {fmt(d['note'])}"]
    return out


def _dsv4_decode(k, dec, tiles):
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


def r_sync_h200(d):
    rows = [[r.get("shape"), r.get("rollout_GB"), r.get("device_copy_s"), r.get("publish_inprocess_s"),
             r.get("publish_full_rewrite_s"), r.get("verify_s"), r.get("publish_ipc_s"),
             r.get("publish_tcp_loopback_s"),
             r.get("flipped_bit_caught")] for r in d.get("results", [])]
    return header(d) + ["Seconds, best of repeats; fp32 trainer -> bf16 rollout on one GPU.", ""] + \
        table(["shape", "rollout GB", "device copy", "publish in process", "publish full rewrite", "verify",
               "publish via CUDA IPC", "publish via TCP loopback", "flipped bit caught"], rows)


def r_engine_memory(d):
    rows = [[r.get("engine"), r.get("mode"), r.get("stock_override"), r.get("cuda_graphs"),
             (r.get("allocated_while_held") or 0) / 2 ** 30, (r.get("allocated_after") or 0) / 2 ** 30,
             (r.get("growth_bytes") or 0) / 2 ** 20, r.get("engine_alive_after_close"), r.get("passed")]
            for r in d.get("engines", d.get("records", []))]
    return header(d) + table(["engine", "dropped by", "stock ops", "CUDA graphs", "GiB while held", "GiB after",
                              "growth MiB", "engine alive after", "passed"], rows)


def r_vllm_gpu(d):
    """benchmarks/vllm_gpu.py: Diff of each engine row vs token_logprobs; decode speed by mode."""
    rows = []
    for fam, runs in sorted((k.split("/", 1)[1], v) for k, v in d.get("sections", {}).items() if k.startswith("diff/")):
        for label, r in runs.items():
            where = ", ".join(f"{k} {v}" for k, v in (r.get("mismatches_where") or {}).items() if v)
            rows.append([fam, label, r.get("tokens"), r.get("mismatches"), r.get("max_abs_diff"),
                         r.get("cached_tokens"), where or None, r.get("error") or r.get("skipped")])
    out = header(d) + table(["family", "engine", "tokens", "mismatches", "max abs diff", "prefix-cached tokens",
                             "where", "error"], rows)
    for key, sp in sorted((k, v) for k, v in d.get("sections", {}).items() if k.startswith("speed/")):
        roof = sp.get("roofline_tok_s") or {}
        srows = []
        for mode in ("stock", "batch_invariant", "plugin", "plugin_v2", "engine", "engine_first_run"):
            got = sp.get(mode)
            got = got if isinstance(got, list) else (got or {}).get("rows") or []
            for r in got:
                srows.append([mode, r.get("B"), r.get("decode_tok_s"), r.get("ttft_s"), r.get("vs_stock"),
                              r.get("vs_batch_invariant"), roof.get(str(r.get("B")), roof.get(r.get("B")))])
        out += ["", f"Decode speed, {key.split('/', 1)[1]} (tokens/s; roofline: weights + KV read once per step)", ""]
        out += table(["mode", "B", "decode tok/s", "TTFT s", "vs stock", "vs batch-invariant", "roofline tok/s"],
                     srows)
    return out


def r_fp8_linear(d):
    """benchmarks/fp8_linear.py: M-invariance of the FP8 linear (and of torch's block-wise _scaled_mm), ms."""
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


def r_sync_cpu(d):
    r = d.get("results", {})
    return header(d) + table(["what", "value"], [[k, v] for k, v in r.items() if "GBps" in k or k.startswith("ratio")])


def r_trl_step(d):
    rows = [[r.get("run"), r.get("median_step_s"), r.get("median_generate_s"), r.get("peak_mem_gib")]
            for r in d.get("results", [])]
    q = d.get("ratios", {})
    out = header(d) + [f"GRPO step time on a {fmt(get(d, 'config', 'model', 'params'))}-parameter random Qwen3; "
                       f"Diff = 0 in every attached run: {fmt(d.get('diff_zero_all_runs_ok'))}.", ""]
    out += table(["run", "median step s", "median generate s", "peak GiB"], rows)
    out += [""] + table(["ratio of median step times, as named", "value"], [[k, v] for k, v in q.items()])
    if d.get("note"):
        out += ["", f"Note: {fmt(d['note'])}"]
    return out


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


def r_engine_cpu(d):
    return header(d) + table(["ratio (tokens/s)", "value"], [[k, v] for k, v in d.get("ratios", {}).items()])


def r_deepseek_tiny_cpu(d):
    q = d.get("ratios", {})
    return header(d) + table(["ratio (bitmatch tokens/s / HF tokens/s)", "value"], [[k, v] for k, v in q.items()])


# name -> (title, renderer); a file matches the longest name its stem starts with
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


RENDERERS = {
    "probe_h200": ("GPU probes (one question each)", r_probe),
    "h200": ("Ops on the GPU (`benchmarks/gpu_ops.py`)", r_gpu_ops),
    "gpu_e2e_h200": ("End to end on the GPU: Diff, rollout, training, controls (`benchmarks/gpu_e2e.py`)", r_gpu_e2e),
    "engine_step_h200": ("Where an engine step's time goes (`benchmarks/engine_step.py`)", r_engine_step),
    "attention_decode_h200": ("Decode attention (`benchmarks/attention_decode.py`)", r_attention_decode),
    "check_cuda_h200": ("`bitmatch check --device cuda`", r_check_cuda),
    "moe_h200": ("MoE layer forward (`benchmarks/moe_layer.py`)", r_moe_layer),
    "moe_layer_bwd_h200": ("MoE layer forward and backward (`benchmarks/moe_layer.py --backward`)", r_moe_layer),
    "moe_e2e_h200": ("Qwen3-MoE end to end (`benchmarks/moe_e2e.py`)", r_moe_e2e),
    "nemotron_h_e2e_h200": ("Nemotron-H end to end vs HF with the Mamba kernels (`benchmarks/nemotron_h_e2e.py`)",
                            r_nemotron_h_e2e),
    "gpu_train_h200": ("Dense training vs stock HF and HF + Liger (`benchmarks/gpu_train.py --sections train`)",
                       r_gpu_train),
    "deepseek_v4_flash4_h200": ("DeepSeek-V4, 4-layer Flash truncation (`benchmarks/deepseek_v4_layer.py`)",
                                r_deepseek_v4),
    "deepseek_v4_mid_h200": ("DeepSeek-V4, mid-size config (`benchmarks/deepseek_v4_layer.py --config mid`)",
                             r_deepseek_v4),
    "deepseek_v4_decode_ops_h200": ("DeepSeek-V4 decode step op by op (`benchmarks/deepseek_v4_decode_ops.py`)",
                                    r_dsv4_decode_ops),
    "mamba_h200": ("Mamba2 SSM scan, one layer (`benchmarks/mamba_layer.py`)", r_mamba),
    "mamba_ssd_h200": ("Mamba2 chunked-SSD scan vs mamba_ssm's Triton kernels (`benchmarks/mamba_layer.py`)",
                       r_mamba_ssd),
    "sampler_h200": ("Sampler (`benchmarks/sampler.py`)", r_sampler),
    "tp_layout_h200": ("Tensor parallel on GPUs: gather layout vs stock all-reduce (`benchmarks/tp_layout.py`)",
                       r_tp_layout),
    "tp_dp_ep_h200": ("Data-parallel attention + expert parallel on GPUs (`benchmarks/tp_layout.py --layout dp_ep`)",
                      r_tp_dp_ep),
    "tp_shard_linear_h200": ("A TP rank's row-parallel linear in both layouts, one GPU (`benchmarks/tp_layout.py "
                             "--world 1`)", r_tp_shard_linear),
    "sync_h200": ("Weight sync on the GPU (`benchmarks/sync.py --device cuda`)", r_sync_h200),
    "sync_h100": ("Weight sync on the GPU (`benchmarks/sync.py --device cuda`)", r_sync_h200),
    "engine_memory": ("Engines give their memory back (`benchmarks/engine_memory.py`)", r_engine_memory),
    "fp8_linear_h200": ("Block-FP8 linear vs torch's block-wise _scaled_mm (`benchmarks/fp8_linear.py`)",
                        r_fp8_linear),
    "vllm_gpu": ("The vLLM plugin on GPU vLLM: Diff vs token_logprobs (`benchmarks/vllm_gpu.py`)", r_vllm_gpu),
    "trl_step_h200": ("TRL GRPO step, stock vs attach (`benchmarks/trl_step.py`)", r_trl_step),
    "mhc_h200": ("DeepSeek-V4 mHC ops (`benchmarks/mhc.py`)", r_mhc),
    "golden_gpu_h200": ("Golden bits on the GPU (`benchmarks/golden_gpu.py`)", r_golden_gpu),
    "cpu": ("Ops on the CPU reference (`benchmarks/cpu_ops.py`)", r_cpu_ops),
    "launch_census_cpu": ("Kernel launches per DeepSeek-V4 decode step, counted on CPU (`benchmarks/launch_census.py`)",
                          r_launch_census),
    "engine_cpu": ("Embedded engine on the CPU (`benchmarks/engine_cpu.py`)", r_engine_cpu),
    "deepseek_v4_tiny_cpu": ("DeepSeek-V4 tiny config on the CPU (`benchmarks/deepseek_v4_layer.py`)",
                             r_deepseek_tiny_cpu),
    "sync": ("Weight sync on the CPU (`benchmarks/sync.py`)", r_sync_cpu),
}


# The page's topics in reading order: each known benchmark under one; inside a topic the newest run first
TOPICS = {
    "vLLM plugin on the GPU": ("vllm_gpu",),
    "Families end to end (Diff, rollout, training)": ("gpu_e2e_h200", "moe_e2e_h200", "nemotron_h_e2e_h200",
                                                      "deepseek_v4_flash4_h200", "deepseek_v4_mid_h200",
                                                      "deepseek_v4_tiny_cpu"),
    "Training": ("gpu_train_h200", "trl_step_h200"),
    "Engine": ("engine_step_h200", "engine_memory", "engine_cpu", "launch_census_cpu", "sampler_h200"),
    "FP8": ("fp8_linear_h200",),
    "Ops": ("h200", "attention_decode_h200", "moe_h200", "moe_layer_bwd_h200", "deepseek_v4_decode_ops_h200",
            "mamba_h200", "mamba_ssd_h200", "mhc_h200", "cpu"),
    "Checks and golden bits": ("check_cuda_h200", "golden_gpu_h200", "probe_h200"),
    "Weight sync": ("sync_h200", "sync_h100", "sync"),
    "Parallel layouts": ("tp_layout_h200", "tp_dp_ep_h200", "tp_shard_linear_h200"),
}


def card_of(stem: str) -> str | None:
    """The GPU a result file's stem names ('_h200' or '_h100'), None for a CPU result."""
    return "H100" if "_h100" in stem else "H200" if "h200" in stem else None


def benchmark_of(stem: str) -> str | None:
    """The known benchmark a file stem belongs to: equal to a name, or the name plus '_<suffix>'.
    A run on an H100 names its card where the H200 runs do ('gpu_train_h100' -> 'gpu_train_h200')."""
    stem = stem.replace("_h100", "_h200")
    names = [n for n in RENDERERS if stem == n or stem.startswith(n + "_")]
    return max(names, key=len) if names else None


_REPO_PATH = re.compile(r"(?:/[\w.+-]+)+?/((?:benchmarks|scripts|bitmatch|tests|examples|\.devrun)/)")
_OUT_PATH = re.compile(r"/root/out\b|/tmp/[\w.+-]+")
_WHEEL_PATH = re.compile(r"(?:/[\w.+-]+)+?/\.whl/")  # the wheels carried beside the checkout


def machine_free(text: str) -> str:
    """A page line without the paths of the machine a run came from: a file of the repository as its
    repository path, the run's output folder as OUT (the command is the same on any node)."""
    return _OUT_PATH.sub("OUT", _WHEEL_PATH.sub(".whl/", _REPO_PATH.sub(r"\1", text)))


# ----------------------------------------------------------------------------- headline lines (README + this page)

README = ROOT / "README.md"
BEGIN = "<!-- generated by scripts/results_page.py: family lines -->"
END = "<!-- end of generated lines -->"


def count(n) -> str:
    return f"{int(n):,}"


def ratio(x) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def span(xs) -> str:
    lo, hi = ratio(min(xs)), ratio(max(xs))
    return f"{lo}x" if lo == hi else f"{lo}-{hi}x"


def small(x) -> str:
    """1.9073e-06 -> '1.9e-6'."""
    m, _, e = f"{x:.2g}".partition("e")
    return f"{m}e{int(e)}" if e else m


def diff_words(tokens, mismatches, control=None, stock="stock HF", max_abs=None) -> str:
    """'Diff = 0 on N of N tokens' or 'M of N tokens differ (max D)', with the stock control's count."""
    notes = [f"max {small(max_abs)}"] if mismatches and max_abs else []
    notes += [f"{stock}: {count(control)} differ"] if control is not None else []
    if not tokens:  # nothing compared is no evidence of equality
        return "no tokens compared"
    said = (f"Diff = 0 on {count(tokens)} of {count(tokens)} tokens" if mismatches == 0
            else f"{count(mismatches)} of {count(tokens)} tokens differ")
    return said + (f" ({'; '.join(notes)})" if notes else "")


def card_in(d, name: str) -> str | None:
    """The card a result ran on: its machine record, else the file name's card."""
    m = d.get("machine")
    gpu = m.get("gpu") if isinstance(m, dict) else m
    found = re.search(r"H[12]00", str(gpu or d.get("device") or ""))
    return found.group(0) if found else card_of(pathlib.Path(name).stem)


def diff_rows(rows) -> tuple[int, int, int]:
    """Tokens, mismatches and stock-HF mismatches summed over a Diff section's configs."""
    return (sum(r["tokens"] for r in rows), sum(r["mismatches"] for r in rows),
            sum(r["control_stock_hf_mismatches"] for r in rows))


# Each h_<family> reads its headline files by name and returns (what ran, [(clause, card), ...]):
# every figure from the JSON, none typed here.

def h_dense(load):
    e2e_file, train_file = "gpu_e2e_h200.json", "gpu_train_h100_run10_alternating.json"
    runs = load(e2e_file)["runs"]
    latest = _latest_runs_by_section(runs)   # each section from the latest run holding it
    run_d, run_r, train = runs[latest["diff"]], runs[latest["rollout"]], load(train_file)
    d = run_d["sections"]["diff"]
    rollout = [b["tokens_per_s_vs_hf_generate"] for b in run_r["sections"]["rollout"]["8b"].values()]
    vs_liger = ", ".join(f"{ratio(t['tokens_per_s_ratio_vs_liger'])}x ({size.upper()})"
                         for size, t in train["sections"]["train"].items())
    return "", [
        (diff_words(d["total_tokens"], d["total_mismatches"], d["total_control_mismatches"]), card_in(run_d, e2e_file)),
        (f"8B rollout {span(rollout)} HF generate", card_in(run_r, e2e_file)),
        (f"training {vs_liger} HF + Liger", card_in(train, train_file)),
    ]


def h_qwen3_moe(load):
    files = "moe_e2e_h200_diff.json", "moe_e2e_h200_rollout_run2.json", "moe_e2e_h100_train.json"
    diff, roll, train = map(load, files)
    b = roll["sections"]["rollout"].values()
    return "", [
        (diff_words(*diff_rows(diff["sections"]["diff"])), card_in(diff, files[0])),
        (f"rollout {span([x['vs_hf_generate'] for x in b])} HF generate, "
         f"{span([x['vs_stock_moe_block'] for x in b])} the engine on HF's MoE block", card_in(roll, files[1])),
        (f"training {ratio(train['sections']['train']['tokens_per_s_ratio'])}x HF", card_in(train, files[2])),
    ]


def h_deepseek_v4(load):
    files = "deepseek_v4_flash4_h100_run2_routers.json", "deepseek_v4_flash4_h100_train_run2_order.json"
    run, train = map(load, files)
    d, peak = run["results"]["diff"], train["results"]["train_peak_gib"]
    return run["setup"]["config"], [
        (diff_words(d["tokens"], d["mismatches"]), card_in(run, files[0])),
        (f"rollout {ratio(run['ratios']['rollout_bitmatch_over_hf'])}x HF generate", card_in(run, files[0])),
        (f"training {ratio(train['ratios']['train_bitmatch_over_hf'])}x HF at "
         f"{ratio(peak['bitmatch'] / peak['hf'])} of its peak memory", card_in(train, files[1])),
    ]


def h_nemotron_h(load):
    name = "nemotron_h_e2e_h100_run7_q64.json"
    run = load(name)
    s, card = run["sections"], card_in(run, name)
    return "", [
        (diff_words(*diff_rows(s["diff"])), card),
        (f"rollout {span([b['vs_hf_generate'] for b in s['rollout'].values()])} HF generate", card),
        (f"training {ratio(s['train']['tokens_per_s_ratio'])}x HF at "
         f"{ratio(s['train']['peak_memory_ratio'])} of its peak memory", card),
    ]


def h_trl(load):
    name = "trl_step_h100_run8_engine_batch.json"
    run = load(name)
    lora = next(r for r in run["results"] if r["run"] == "attach_lora")
    params = run["config"]["model"]["params"]
    return "", [
        (f"a GRPO step of a {round(params / 1e6)}M Qwen3 with LoRA takes "
         f"{ratio(run['ratios']['attach_lora/stock_lora'])}x stock TRL's time", card_in(run, name)),
        (diff_words(sum(lora["compared_tokens"]), sum(lora["mismatch_tokens"])), card_in(run, name)),
    ]


def newest_vllm_gpu(results_dir: pathlib.Path) -> str | None:
    """The vllm_gpu_h100_run<N>.json of the highest N."""
    runs = [(int(m.group(1)), f.name) for f in results_dir.glob("vllm_gpu_h100_run*.json")
            if (m := re.fullmatch(r"vllm_gpu_h100_run(\d+)", f.stem))]
    return max(runs)[1] if runs else None


VLLM_ROWS = {"plugin, graphs + compile": "V1", "plugin, V2 model runner, graphs + compile": "V2"}


def h_vllm(load, name):
    """The plugin rows (V1 and V2 model runners) of every family's Diff summed, with the stock vLLM
    control beside them; then the plugin's decode speed over stock vLLM's, by batch size."""
    run = load(name)
    card, fams, runners, tokens, mism, stock = card_in(run, name), [], set(), 0, 0, None
    for key, rows in run["sections"].items():
        if not key.startswith("diff/"):
            continue
        got = [(runner, rows[label]) for label, runner in VLLM_ROWS.items() if "tokens" in rows.get(label, {})]
        fams += [key.split("/", 1)[1]] if got else []
        runners |= {r for r, _ in got}
        tokens, mism = tokens + sum(r["tokens"] for _, r in got), mism + sum(r["mismatches"] for _, r in got)
        ctl = next((v for k, v in rows.items() if k.startswith("stock") and "tokens" in v), None)
        stock = stock if ctl is None else (stock or 0) + ctl["mismatches"]
    said = [(f"{'/'.join(fams)}, {'/'.join(sorted(runners))} runners: " + diff_words(tokens, mism, stock, "stock vLLM"),
             card)]
    for key, sp in run["sections"].items():
        plugin = sp.get("plugin") if key.startswith("speed/") else None
        if plugin and plugin.get("rows") and all("vs_stock" in r for r in plugin["rows"]):
            ratios = "/".join(f"{r['vs_stock']:.2f}" for r in plugin["rows"])
            said.append((f"decode {ratios} of stock (B {'/'.join(str(r['B']) for r in plugin['rows'])})", card))
    return f"vLLM {get(run, 'machine', 'vllm', default='-')}", said


# the support matrix's families and the TRL adapter, each with the function reading its headline files
HEADLINES = {
    "dense": h_dense,
    "qwen3_moe": h_qwen3_moe,
    "deepseek_v4": h_deepseek_v4,
    "nemotron_h": h_nemotron_h,
    "TRL": h_trl,
}


def headline_lines(results_dir: pathlib.Path = RESULTS) -> tuple[list[str], list[str]]:
    """One line per family, the TRL adapter and the vLLM plugin on GPU (newest run), every figure read
    from a named JSON file with the card it ran on; and the names of the files read."""
    read = []

    def load(name):
        read.append(name)
        return json.loads((results_dir / name).read_text())

    def line(label, about, clauses):
        cards = {c for _, c in clauses}
        one = cards.pop() if len(cards) == 1 else None   # one card for the whole line: named once, up front
        head = ", ".join(x for x in (one, about) if x)
        body = "; ".join(t if one else with_card(t, c) for t, c in clauses)
        return f"- **{label}**" + (f" ({head})" if head else "") + f": {body}."

    out = [line(label, *fn(load)) for label, fn in HEADLINES.items()]
    vllm = newest_vllm_gpu(results_dir)
    if vllm:
        out.append(line("vLLM plugin", *h_vllm(load, vllm)))
    return out, sorted(set(read))


def with_card(clause: str, card: str) -> str:
    """'... (stock HF: 512 differ)' -> '... (stock HF: 512 differ; H200)'; else '... (H200)'."""
    return clause[:-1] + f"; {card})" if clause.endswith(")") else f"{clause} ({card})"


def readme_with(lines: list[str], text: str) -> str:
    """README text with the block between the BEGIN and END lines replaced by ``lines``."""
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md lacks the marker lines {BEGIN!r} and {END!r}")
    head, rest = text.split(BEGIN, 1)
    return head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + rest.split(END, 1)[1]


def render(results_dir: pathlib.Path = RESULTS) -> str:
    files = sorted(results_dir.glob("*.json"))
    by_topic: dict[str, list] = {t: [] for t in TOPICS}
    topic_of = {name: t for t, names in TOPICS.items() for name in names}
    unknown, unreadable = [], []
    for f in files:
        name = benchmark_of(f.stem)
        if name is None:
            unknown.append(f.name)
            continue
        title, fn = RENDERERS[name]
        try:
            d = json.loads(f.read_text())
            body = fn(d)
        except Exception as e:  # noqa: BLE001 - a shape the renderer cannot read is listed, not dropped
            unreadable.append(f"`{f.name}` ({type(e).__name__}: {e})")
            continue
        card = card_of(f.stem) or "CPU"
        head = f"### {title}, {card}" + (f", {date_of(d)[:10]}" if date_of(d) != "-" else "")
        section = [head, "", f"`benchmarks/results/{f.name}`", ""] + body + [""]
        by_topic[topic_of[name]].append((date_of(d) if isinstance(d, dict) else "-", f.name, section))
    out = ["# Results", "",
           "Generated by `python scripts/results_page.py` from `benchmarks/results/*.json`; do not edit by hand "
           "(`tests/test_results_page.py` fails when this page and the JSON differ). Every ratio was measured side "
           "by side in one run, on the card each section names (NVIDIA H100 or H200; a ratio never mixes cards). "
           "Grouped by topic; in each topic the newest run comes first.", ""]
    try:
        lines, read = headline_lines(results_dir)
        out += ["## Headline figures", "",
                "The README's generated lines; each figure read from these files: "
                + ", ".join(f"`{n}`" for n in read) + ".", ""] + lines + [""]
    except (OSError, LookupError, TypeError, ValueError) as e:  # a headline file gone or reshaped: listed below
        unreadable.append(f"the headline lines ({type(e).__name__}: {e})")
    for topic, secs in by_topic.items():
        if secs:  # newest first; undated runs last, by file name
            secs.sort(key=lambda x: (x[0] != "-", x[0], x[1]), reverse=True)
            out += [f"## {topic}", ""] + [line for _, _, sec in secs for line in sec]
    if unknown or unreadable:
        out += ["## Other files", ""]
        out += [f"- `{n}`: no renderer in `scripts/results_page.py` (add one to `RENDERERS`)" for n in unknown]
        out += [f"- {n}: its renderer could not read it" for n in unreadable]
        out.append("")
    return machine_free("\n".join(out).rstrip("\n") + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page differs from the JSON")
    ap.add_argument("--results", default=str(RESULTS), help="folder of result JSON files")
    ap.add_argument("--out", default=str(PAGE), help="the page to write")
    ap.add_argument("--readme", default=str(README), help="the README whose generated block to rewrite")
    a = ap.parse_args(argv)
    results, out, readme = pathlib.Path(a.results), pathlib.Path(a.out), pathlib.Path(a.readme)
    want = {out: render(results), readme: readme_with(headline_lines(results)[0], readme.read_text())}
    if a.check:
        stale = [str(f) for f, text in want.items() if not f.is_file() or f.read_text() != text]
        for f in stale:
            print(f"{f} is out of date: run python scripts/results_page.py", file=sys.stderr)
        return 1 if stale else 0
    for f, text in want.items():
        f.write_text(text)
        print(f"wrote {f} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One renderer per end-to-end benchmark (families, engine, training, sync, parallel, vLLM): a result JSON ->
markdown lines."""
from __future__ import annotations

from results_format import date_of, fmt, get, header, machine_of, table
from results_ops import dsv4_decode_lines


def latest_runs_by_section(runs: dict) -> dict:
    latest = {}
    for name, r in runs.items():
        for sec in (r.get("sections") or {}):
            latest[sec] = name
    return latest


def r_gpu_e2e(d):
    runs = d.get("runs", {})
    latest = {k: v for k, v in latest_runs_by_section(runs).items()
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
    """benchmarks/families/nemotron_h_e2e.py: Diff with graphs, rollout and training vs HF with the Mamba kernels."""
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
    """benchmarks/training/gpu_train.py --sections train: bitmatch vs stock HF and vs HF + Liger."""
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
    """benchmarks/parallel/tp_layout.py --world N: TP = N gather layout and stock all-reduce layout vs TP = 1."""
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
    """benchmarks/parallel/tp_layout.py --layout dp_ep: data-parallel attention + EP vs one process, stock EP."""
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
    """benchmarks/parallel/tp_layout.py --world 1: a TP rank's row-parallel linear in the two layouts, one GPU."""
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
        out += dsv4_decode_lines(k, get(r, "results", "decode_step"), get(r, "results", "tiles"))
    if d.get("note"):
        out += ["", f"Note: {fmt(d['note'])}"]
    return out


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
    """benchmarks/adapters/vllm_gpu.py: Diff of each engine row vs token_logprobs; decode speed by mode."""
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


def r_engine_cpu(d):
    return header(d) + table(["ratio (tokens/s)", "value"], [[k, v] for k, v in d.get("ratios", {}).items()])


def r_deepseek_tiny_cpu(d):
    q = d.get("ratios", {})
    return header(d) + table(["ratio (bitmatch tokens/s / HF tokens/s)", "value"], [[k, v] for k, v in q.items()])

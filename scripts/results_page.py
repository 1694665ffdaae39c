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
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # its sibling modules, however it is loaded
# the names tests and the CLI read from this module (diff_words, BEGIN, VLLM_ROWS, ...) are re-exported
from results_format import card_of, date_of, diff_words, fmt, header, table  # noqa: E402, F401
from results_headlines import BEGIN, END, HEADLINES, VLLM_ROWS, headline_lines, newest_vllm_gpu, readme_with  # noqa: E402, F401
from results_ops import (  # noqa: E402
    r_attention_decode,
    r_check_cuda,
    r_cpu_ops,
    r_dsv4_decode_ops,
    r_fp8_linear,
    r_golden_gpu,
    r_gpu_ops,
    r_launch_census,
    r_mamba,
    r_mamba_ssd,
    r_mhc,
    r_moe_layer,
    r_probe,
    r_sampler,
)
from results_runs import (  # noqa: E402
    r_deepseek_tiny_cpu,
    r_deepseek_v4,
    r_engine_cpu,
    r_engine_memory,
    r_engine_step,
    r_gpu_e2e,
    r_gpu_train,
    r_moe_e2e,
    r_nemotron_h_e2e,
    r_sync_cpu,
    r_sync_h200,
    r_tp_dp_ep,
    r_tp_layout,
    r_tp_shard_linear,
    r_trl_step,
    r_vllm_gpu,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "results.md"


# one renderer per benchmark (results_ops.py: ops and kernels; results_runs.py: end to end)
RENDERERS = {
    "probe_h200": ("GPU probes (one question each)", r_probe),
    "h200": ("Ops on the GPU (`benchmarks/ops/gpu_ops.py`)", r_gpu_ops),
    "gpu_e2e_h200": ("End to end on the GPU: Diff, rollout, training, controls (`benchmarks/engine/gpu_e2e.py`)",
                     r_gpu_e2e),
    "engine_step_h200": ("Where an engine step's time goes (`benchmarks/engine/engine_step.py`)", r_engine_step),
    "attention_decode_h200": ("Decode attention (`benchmarks/ops/attention_decode.py`)", r_attention_decode),
    "check_cuda_h200": ("`bitmatch check --device cuda`", r_check_cuda),
    "moe_h200": ("MoE layer forward (`benchmarks/ops/moe_layer.py`)", r_moe_layer),
    "moe_layer_bwd_h200": ("MoE layer forward and backward (`benchmarks/ops/moe_layer.py --backward`)", r_moe_layer),
    "moe_e2e_h200": ("Qwen3-MoE end to end (`benchmarks/families/moe_e2e.py`)", r_moe_e2e),
    "nemotron_h_e2e_h200": ("Nemotron-H end to end vs HF with the Mamba kernels "
                            "(`benchmarks/families/nemotron_h_e2e.py`)", r_nemotron_h_e2e),
    "gpu_train_h200": ("Dense training vs stock HF and HF + Liger "
                       "(`benchmarks/training/gpu_train.py --sections train`)", r_gpu_train),
    "deepseek_v4_flash4_h200": ("DeepSeek-V4, 4-layer Flash truncation (`benchmarks/families/deepseek_v4_layer.py`)",
                                r_deepseek_v4),
    "deepseek_v4_mid_h200": ("DeepSeek-V4, mid-size config (`benchmarks/families/deepseek_v4_layer.py --config mid`)",
                             r_deepseek_v4),
    "deepseek_v4_decode_ops_h200": ("DeepSeek-V4 decode step op by op "
                                    "(`benchmarks/families/deepseek_v4_decode_ops.py`)", r_dsv4_decode_ops),
    "mamba_h200": ("Mamba2 SSM scan, one layer (`benchmarks/ops/mamba_layer.py`)", r_mamba),
    "mamba_ssd_h200": ("Mamba2 chunked-SSD scan vs mamba_ssm's Triton kernels (`benchmarks/ops/mamba_layer.py`)",
                       r_mamba_ssd),
    "sampler_h200": ("Sampler (`benchmarks/ops/sampler.py`)", r_sampler),
    "tp_layout_h200": ("Tensor parallel on GPUs: gather layout vs stock all-reduce "
                       "(`benchmarks/parallel/tp_layout.py`)", r_tp_layout),
    "tp_dp_ep_h200": ("Data-parallel attention + expert parallel on GPUs "
                      "(`benchmarks/parallel/tp_layout.py --layout dp_ep`)", r_tp_dp_ep),
    "tp_shard_linear_h200": ("A TP rank's row-parallel linear in both layouts, one GPU "
                             "(`benchmarks/parallel/tp_layout.py --world 1`)", r_tp_shard_linear),
    "sync_h200": ("Weight sync on the GPU (`benchmarks/sync/sync.py --device cuda`)", r_sync_h200),
    "sync_h100": ("Weight sync on the GPU (`benchmarks/sync/sync.py --device cuda`)", r_sync_h200),
    "engine_memory": ("Engines give their memory back (`benchmarks/engine/engine_memory.py`)", r_engine_memory),
    "fp8_linear_h200": ("Block-FP8 linear vs torch's block-wise _scaled_mm (`benchmarks/ops/fp8_linear.py`)",
                        r_fp8_linear),
    "vllm_gpu": ("The vLLM plugin on GPU vLLM: Diff vs token_logprobs (`benchmarks/adapters/vllm_gpu.py`)", r_vllm_gpu),
    "trl_step_h200": ("TRL GRPO step, stock vs attach (`benchmarks/adapters/trl_step.py`)", r_trl_step),
    "mhc_h200": ("DeepSeek-V4 mHC ops (`benchmarks/ops/mhc.py`)", r_mhc),
    "golden_gpu_h200": ("Golden bits on the GPU (`benchmarks/ops/golden_gpu.py`)", r_golden_gpu),
    "cpu": ("Ops on the CPU reference (`benchmarks/ops/cpu_ops.py`)", r_cpu_ops),
    "launch_census_cpu": ("Kernel launches per DeepSeek-V4 decode step, counted on CPU "
                          "(`benchmarks/engine/launch_census.py`)", r_launch_census),
    "engine_cpu": ("Embedded engine on the CPU (`benchmarks/engine/engine_cpu.py`)", r_engine_cpu),
    "deepseek_v4_tiny_cpu": ("DeepSeek-V4 tiny config on the CPU (`benchmarks/families/deepseek_v4_layer.py`)",
                             r_deepseek_tiny_cpu),
    "sync": ("Weight sync on the CPU (`benchmarks/sync/sync.py`)", r_sync_cpu),
}


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


README = ROOT / "README.md"


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

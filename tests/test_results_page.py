"""docs/results.md is generated from benchmarks/results/*.json and cannot drift from it."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("results_page", ROOT / "scripts" / "results_page.py")
results_page = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results_page)


def test_checked_in_page_equals_the_generator_output():
    page = (ROOT / "docs" / "results.md").read_text()
    assert page == results_page.render(), "docs/results.md is out of date: run python scripts/results_page.py"


def test_every_checked_in_file_has_a_renderer_that_reads_it():
    page = results_page.render()
    assert "## Other files" not in page, page[page.index("## Other files"):]


def test_new_run_of_a_known_benchmark_renders_and_unknown_files_are_listed(tmp_path):
    src = ROOT / "benchmarks" / "results"
    shutil.copy(src / "sync_h200.json", tmp_path / "sync_h200.json")
    shutil.copy(src / "sync_h200.json", tmp_path / "sync_h200_run2.json")     # a new run, known benchmark
    shutil.copy(src / "sync_h200.json", tmp_path / "sync_h100.json")          # the same on an H100
    (tmp_path / "brand_new_h200.json").write_text(json.dumps({"command": "x"}))  # no renderer
    (tmp_path / "moe_e2e_h200.json").write_text(json.dumps([1, 2]))            # known name, other shape
    page = results_page.render(tmp_path)
    assert page.count("### Weight sync on the GPU") == 3 and "sync_h200_run2.json" in page
    assert page.count("### Weight sync on the GPU (`benchmarks/sync/sync.py --device cuda`), H100") == 1
    assert "`brand_new_h200.json`: no renderer" in page
    assert "`moe_e2e_h200.json` (" in page and "could not read it" in page
    assert results_page.benchmark_of("moe_e2e_h200_run3") == "moe_e2e_h200"
    assert results_page.benchmark_of("moe_h200") == "moe_h200"
    assert results_page.benchmark_of("gpu_train_h100_run1") == "gpu_train_h200"


def test_page_names_no_path_of_the_machine_a_run_came_from():
    line = ("python /work/main/benchmarks/adapters/vllm_gpu.py --out /root/out "
            "--mamba-src /work/main/.clean/../.whl/m-1 --json /tmp/x1/check.json")
    assert results_page.machine_free(line) == ("python benchmarks/adapters/vllm_gpu.py --out OUT --mamba-src .whl/m-1 "
                                               "--json OUT/check.json")
    page = results_page.render()
    for where in ("/work/", "/root/", "/tmp/", "/home/"):
        assert where not in page, page[page.index(where) - 200:page.index(where) + 100]


def _block(text: str) -> list[str]:
    return text.split(results_page.BEGIN, 1)[1].split(results_page.END, 1)[0].strip("\n").splitlines()


def test_readme_is_a_manual_with_the_generated_family_lines():
    """README.md stays under 200 lines; its block between the markers is what the generator gives now,
    one line per support-matrix family, the TRL adapter and the vLLM plugin, each at most 30 words
    and naming the card its figures came from."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200, f"README.md has {len(text.splitlines())} lines: a manual stays under 200"
    lines, read = results_page.headline_lines()
    assert _block(text) == lines, "README.md's family lines are out of date: run python scripts/results_page.py"
    assert results_page.readme_with(lines, text) == text
    for label in [*results_page.HEADLINES, "vLLM plugin"]:
        assert sum(line.startswith(f"- **{label}**") for line in lines) == 1, label
    for line in lines:
        words = line.removeprefix("- ").split()
        assert len(words) <= 30, f"{len(words)} words: {line}"
        assert "H100" in line or "H200" in line, f"no card named: {line}"
    assert all((ROOT / "benchmarks" / "results" / n).is_file() for n in read)


def test_diff_words_read_right_whether_or_not_tokens_differ():
    assert results_page.diff_words(3800, 0, 3800, "stock vLLM") == \
        "Diff = 0 on 3,800 of 3,800 tokens (stock vLLM: 3,800 differ)"
    assert results_page.diff_words(3800, 81, 3800, "stock vLLM", 1.9073486328125e-06) == \
        "81 of 3,800 tokens differ (max 1.9e-6; stock vLLM: 3,800 differ)"
    assert results_page.diff_words(512, 0) == "Diff = 0 on 512 of 512 tokens"


def test_vllm_line_comes_from_the_newest_run_and_its_json(tmp_path):
    """The vLLM line reads the highest run number (10 after 9, not after 1), and its figures follow
    the JSON: a plugin row at 0 mismatches reads as Diff = 0."""
    src = ROOT / "benchmarks" / "results"
    for n in results_page.headline_lines()[1]:
        shutil.copy(src / n, tmp_path / n)
    newest = results_page.newest_vllm_gpu(src)
    run = json.loads((src / newest).read_text())
    shutil.copy(src / newest, tmp_path / "vllm_gpu_h100_run9.json")
    rows = [r for k, sec in run["sections"].items() if k.startswith("diff/")
            for label, r in sec.items() if label in results_page.VLLM_ROWS and "tokens" in r]
    assert rows
    for r in rows:
        r["mismatches"] = 0
    (tmp_path / "vllm_gpu_h100_run10.json").write_text(json.dumps(run))
    assert results_page.newest_vllm_gpu(tmp_path) == "vllm_gpu_h100_run10.json"
    vllm = results_page.headline_lines(tmp_path)[0][-1]
    n = sum(r["tokens"] for r in rows)
    assert f"Diff = 0 on {n:,} of {n:,} tokens" in vllm, vllm
    rows[0]["mismatches"] = 7   # one plugin row off: the line says so
    (tmp_path / "vllm_gpu_h100_run11.json").write_text(json.dumps(run))
    assert f"7 of {n:,} tokens differ" in results_page.headline_lines(tmp_path)[0][-1]


def test_check_fails_when_the_page_or_the_readme_block_is_stale(tmp_path):
    page, readme = tmp_path / "results.md", tmp_path / "README.md"
    page.write_text(results_page.render())
    readme.write_text((ROOT / "README.md").read_text())
    args = ["--check", "--out", str(page), "--readme", str(readme)]
    assert results_page.main(args) == 0
    readme.write_text(results_page.readme_with(["- **dense**: typed by hand."], readme.read_text()))
    assert results_page.main(args) == 1
    assert results_page.main(["--out", str(page), "--readme", str(readme)]) == 0   # rewrites the block
    assert results_page.main(args) == 0
    page.write_text(page.read_text() + "edited\n")
    assert results_page.main(args) == 1


def test_page_is_grouped_by_topic_newest_first(tmp_path):
    src = ROOT / "benchmarks" / "results"
    for stem, when in (("vllm_gpu_h100_run1", "2026-12-01T00:00:00Z"), ("vllm_gpu_h100_run2", "2026-12-03T00:00:00Z"),
                       ("vllm_gpu_h100_run3", "2026-12-02T00:00:00Z")):
        d = json.loads((src / "vllm_gpu_h100_run3.json").read_text())
        d["started_utc"] = when
        (tmp_path / f"{stem}.json").write_text(json.dumps(d))
    shutil.copy(src / "sync_h200.json", tmp_path / "sync_h200.json")
    page = results_page.render(tmp_path)
    order = [page.index(f"vllm_gpu_h100_run{n}.json`") for n in (2, 3, 1)]
    assert order == sorted(order), "newest run first inside a topic"
    assert page.index("## vLLM plugin on the GPU") < page.index("## Weight sync")
    assert all(name in names for names in [sum(results_page.TOPICS.values(), ())] for name in results_page.RENDERERS)


def test_zero_tokens_compared_is_never_diff_zero():
    assert results_page.diff_words(0, 0) == "no tokens compared"
    assert results_page.diff_words(None, 0) == "no tokens compared"

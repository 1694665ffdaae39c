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
    assert page.count("### Weight sync on the GPU (`benchmarks/sync.py --device cuda`) on an H100") == 1
    assert "`brand_new_h200.json`: no renderer" in page
    assert "`moe_e2e_h200.json` (" in page and "could not read it" in page
    assert results_page.benchmark_of("moe_e2e_h200_run3") == "moe_e2e_h200"
    assert results_page.benchmark_of("moe_h200") == "moe_h200"
    assert results_page.benchmark_of("gpu_train_h100_run1") == "gpu_train_h200"


def test_page_names_no_path_of_the_machine_a_run_came_from():
    line = ("python /work/main/benchmarks/vllm_gpu.py --out /root/out --mamba-src /work/main/.clean/../.whl/m-1 "
            "--json /tmp/x1/check.json")
    assert results_page.machine_free(line) == ("python benchmarks/vllm_gpu.py --out OUT --mamba-src .whl/m-1 "
                                               "--json OUT/check.json")
    page = results_page.render()
    for where in ("/work/", "/root/", "/tmp/", "/home/"):
        assert where not in page, page[page.index(where) - 200:page.index(where) + 100]

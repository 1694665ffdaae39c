"""scripts/offline_bundle.py: parts that join to the packed tree, and every bad part refused by name."""
import importlib.util
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("offline_bundle", ROOT / "scripts" / "offline_bundle.py")
ob = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ob)


def _bundle(tmp_path, part_bytes=700):
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("X = 1\n")
    (site / "pkg" / "blob.bin").write_bytes(os.urandom(3000))  # incompressible: several parts
    archive = tmp_path / "bundle.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(site / "pkg", arcname="pkg")
    out = tmp_path / "parts"
    out.mkdir()
    manifest = ob.split(archive, out, part_bytes)
    (out / ob.MANIFEST).write_text(json.dumps(manifest))
    return out, manifest, site


def test_parts_join_and_unpack(tmp_path):
    parts, manifest, site = _bundle(tmp_path)
    assert len(manifest["parts"]) > 1
    assert all(p["bytes"] <= 700 for p in manifest["parts"])
    target = tmp_path / "target"
    ob.main(["install", "--parts", str(parts), "--target", str(target)])
    assert (target / "pkg" / "blob.bin").read_bytes() == (site / "pkg" / "blob.bin").read_bytes()
    assert (target / "pkg" / "__init__.py").read_text() == "X = 1\n"


def test_altered_part_is_named_and_nothing_unpacked(tmp_path, capsys):
    parts, manifest, _ = _bundle(tmp_path)
    bad = parts / manifest["parts"][1]["name"]
    data = bytearray(bad.read_bytes())
    data[5] ^= 1
    bad.write_bytes(bytes(data))
    target = tmp_path / "target"
    assert ob.main(["install", "--parts", str(parts), "--target", str(target)]) == 2
    assert manifest["parts"][1]["name"] in capsys.readouterr().err
    assert not target.exists()


def test_missing_and_short_parts(tmp_path):
    parts, manifest, _ = _bundle(tmp_path)
    last = parts / manifest["parts"][-1]["name"]
    last.write_bytes(last.read_bytes()[:-1])
    with pytest.raises(ob.BundleError, match=manifest["parts"][-1]["name"]):
        ob.join(parts)
    last.unlink()
    with pytest.raises(ob.BundleError, match="missing"):
        ob.join(parts)


def test_install_keeps_old_tree_when_a_part_is_bad(tmp_path):
    parts, manifest, _ = _bundle(tmp_path)
    target = tmp_path / "target"
    target.mkdir()
    (target / "old.txt").write_text("old")
    (parts / manifest["parts"][0]["name"]).write_bytes(b"x")
    assert ob.main(["install", "--parts", str(parts), "--target", str(target)]) == 2
    assert (target / "old.txt").read_text() == "old"


def test_picks_the_release_that_pins_the_torch(monkeypatch):
    files = [{"filename": f"vllm-{v}-cp38-abi3-manylinux_2_28_x86_64.whl", "url": f"u/{v}"}
             for v in ("0.25.0", "0.26.0", "0.27.0")]
    files.append({"filename": "vllm-0.26.0-cp38-abi3-manylinux_2_28_aarch64.whl", "url": "arm"})
    pins = {"u/0.25.0": "2.10.0", "u/0.26.0": "2.11.0", "u/0.27.0": "2.13.0"}
    monkeypatch.setattr(ob, "_index_files", lambda project: files)

    def urlopen(url, timeout):
        return io.BytesIO(f"Name: vllm\nRequires-Dist: torch=={pins[url[:-len('.metadata')]]}\n".encode())

    monkeypatch.setattr(ob.urllib.request, "urlopen", urlopen)
    assert ob.vllm_for_torch("2.11.0", "3.12")[0] == "0.26.0"
    assert ob.vllm_for_torch("2.13.0", "3.12")[0] == "0.27.0"
    with pytest.raises(ob.BundleError, match="torch==2.12.0"):
        ob.vllm_for_torch("2.12.0", "3.12")


def test_node_packages_are_left_out_by_name(tmp_path):
    freeze = tmp_path / "node.txt"
    freeze.write_text("OpenAI==2.50.0\npy_cpuinfo==9.0.0\n")
    node = ob._freeze(str(freeze))
    assert [p for p in ("openai<=2.48.0", "py-cpuinfo", "distro") if ob._name(p) not in node] == ["distro"]

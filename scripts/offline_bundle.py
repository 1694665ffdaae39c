#!/usr/bin/env python3
"""Carry vLLM (and what it imports) to a GPU node without network, in parts of bounded size.

On a machine with access to the package index:

    python scripts/offline_bundle.py build --torch 2.11.0 --python 3.12 --arch sm90 --out dist/offline \
        --part-mb 54 --node-freeze node.txt

picks the vLLM release that pins ``torch==<--torch>`` (read from each release's published
metadata, newest first), downloads its wheel and the listed extra wheels for the node's
platform tags, unpacks them into one site tree, drops the binaries the node's architecture
never loads (FA2 on Hopper: vLLM loads FA3 there; the ``vllm-rs`` server binary), packs the
tree (tar + xz) and splits it into parts of at most ``--part-mb`` MiB, with ``manifest.json``
holding every part's SHA-256 and the whole archive's. Wheels the node already has at a version
that satisfies the requirement (``--node-freeze``: ``pip list --format=freeze`` run there) are
left out.

On the node (standard library only):

    python offline_bundle.py install --parts DIR --target /tmp/site    # then PYTHONPATH=/tmp/site

checks each part against the manifest, joins them, checks the whole, and unpacks. A part that
is missing, short or altered fails with its name and both sums, before anything is unpacked.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

INDEX = "https://pypi.org/simple"
MANIFEST = "manifest.json"
# What the V1 engine core, GPU worker, FLASH_ATTN backend, sampler, compilation backend, fused MoE and
# the Qwen3 / Qwen3-MoE model modules import beyond a node with torch, triton and transformers
# (found by importing those modules from the slimmed vLLM tree under the node's torch).
# openai: the last release before vLLM 0.26 (later ones import httpx2, which the node lacks) and its distro.
VLLM_IMPORTS = ("msgspec", "pyzmq", "cbor2", "pybase64", "cachetools", "openai<=2.48.0", "distro", "openai-harmony",
                "fastapi", "starlette", "pydantic", "pydantic-core", "llguidance", "xgrammar",
                "partial-json-parser", "jiter", "sniffio", "annotated-types", "typing-inspection",
                "opentelemetry-api", "apache-tvm-ffi", "blake3", "py-cpuinfo", "prometheus-client",
                "compressed-tensors", "depyf", "astor", "ijson", "setproctitle", "diskcache", "gguf",
                "watchfiles", "python-json-logger", "lark", "interegular", "outlines-core", "einops")
# Per target architecture, files of the vLLM wheel that the node never loads.
DROP = {
    "sm90": ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs"),
    "sm100": ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs"),
    "sm80": ("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "vllm/vllm-rs"),
}


class BundleError(RuntimeError):
    """A part, sum or release that does not match what the bundle needs."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------- build (needs the package index)

def _index_files(project: str) -> list[dict]:
    req = urllib.request.Request(f"{INDEX}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["files"]


def _wheel_matches(filename: str, python: str, platform: str) -> bool:
    if not filename.endswith(".whl"):
        return False
    _, _, py, abi, plat = filename[:-4].rsplit("-", 4)
    cp = "cp" + python.replace(".", "")
    py_ok = any(t in (cp, "py3", "cp38") or (t.startswith("cp3") and abi == "abi3" and int(t[3:]) <= int(cp[3:]))
                for t in py.split("."))
    plat_ok = plat == "any" or any(p.endswith(platform) for p in plat.split("."))
    return py_ok and plat_ok


def _version_of(filename: str) -> tuple[int, ...]:
    v = filename.split("-")[1]
    return tuple(int(x) for x in re.findall(r"\d+", v)[:4])


def vllm_for_torch(torch_version: str, python: str, platform: str = "x86_64") -> tuple[str, dict]:
    """(version, index entry) of the newest vLLM wheel whose metadata pins torch==torch_version."""
    wheels = [f for f in _index_files("vllm") if _wheel_matches(f["filename"], python, platform)
              and not f.get("yanked") and re.fullmatch(r"vllm-\d+\.\d+\.\d+-.*", f["filename"])]
    for f in sorted(wheels, key=lambda f: _version_of(f["filename"]), reverse=True):
        try:  # PEP 658 metadata beside the wheel (served even where the listing does not say so)
            with urllib.request.urlopen(f["url"] + ".metadata", timeout=60) as r:
                meta = r.read().decode()
        except urllib.error.HTTPError:
            continue
        pins = re.findall(r"^Requires-Dist: torch==([\w.+]+)\s*$", meta, re.M)
        if pins and pins[0] == torch_version:
            return f["filename"].split("-")[1], f
    raise BundleError(f"no vLLM release on {INDEX} pins torch=={torch_version} for cp{python} {platform}")


def _freeze(path: str | None) -> dict[str, str]:
    if not path:
        return {}
    out = {}
    for line in Path(path).read_text().splitlines():
        if "==" in line:
            name, ver = line.split("==", 1)
            out[re.sub(r"[-_.]+", "-", name).lower()] = ver.strip()
    return out


def _name(spec: str) -> str:
    """The normalized project name of a requirement such as ``openai<=2.48.0``."""
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~ ;\[]", spec, maxsplit=1)[0]).lower()


def _download(specs: list[str], dest: Path, python: str, platform_tag: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", python,
           "--platform", platform_tag, "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
           "--platform", "any", "-d", str(dest), *specs]
    subprocess.run(cmd, check=True)


def build(args) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    version, _ = vllm_for_torch(args.torch, args.python)
    print(f"vLLM {version} pins torch=={args.torch}", flush=True)
    node = _freeze(args.node_freeze)
    extras = [p for p in (args.extra or VLLM_IMPORTS) if _name(p) not in node]
    with tempfile.TemporaryDirectory() as tmp:
        wheels, site = Path(tmp, "wheels"), Path(tmp, "site")
        wheels.mkdir()
        _download([f"vllm=={version}"] + extras, wheels, args.python, args.platform)
        dropped = []
        for whl in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(whl) as z:
                for info in z.infolist():
                    if info.filename in DROP.get(args.arch, ()):
                        dropped.append(info.filename)
                        continue
                    z.extract(info, site)
        archive = Path(tmp, "bundle.tar.xz")
        with tarfile.open(archive, "w:xz", preset=args.xz_preset) as tar:
            for p in sorted(site.iterdir()):
                tar.add(p, arcname=p.name)
        manifest = split(archive, out, args.part_mb * (1 << 20))
    manifest.update(vllm=version, torch=args.torch, python=args.python, arch=args.arch, dropped=dropped,
                    wheels=sorted(w.name for w in Path(out).glob("*.whl")) or None,
                    extras=extras, left_out=sorted(set(args.extra or VLLM_IMPORTS) - set(extras)))
    Path(out, MANIFEST).write_text(json.dumps(manifest, indent=1))
    print(f"{len(manifest['parts'])} parts in {out}", flush=True)
    return out


def split(archive: Path, out: Path, part_bytes: int) -> dict:
    """Cut ``archive`` into files ``part-NN`` of at most ``part_bytes``; the manifest's sums."""
    if part_bytes <= 0:
        raise BundleError(f"--part-mb must be positive, got {part_bytes} bytes")
    parts = []
    with open(archive, "rb") as f:
        for i in range(10 ** 6):
            data = f.read(part_bytes)
            if not data:
                break
            name = f"part-{i:02d}"
            Path(out, name).write_bytes(data)
            parts.append({"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return {"format": "tar.xz", "parts": parts, "sha256": sha256_file(archive), "bytes": archive.stat().st_size}


# ---------------------------------------------------------------- install (on the node, stdlib only)

def join(parts_dir: Path) -> bytes:
    """The archive, after every part and the whole were checked against the manifest."""
    manifest = json.loads(Path(parts_dir, MANIFEST).read_text())
    buf = io.BytesIO()
    for part in manifest["parts"]:
        path = Path(parts_dir, part["name"])
        if not path.is_file():
            raise BundleError(f"part {part['name']} is missing from {parts_dir}: carry it and run again")
        got = sha256_file(path)
        if got != part["sha256"] or path.stat().st_size != part["bytes"]:
            raise BundleError(f"part {part['name']}: sha256 {got} ({path.stat().st_size} bytes), manifest says "
                              f"{part['sha256']} ({part['bytes']} bytes): carry it again")
        buf.write(path.read_bytes())
    data = buf.getvalue()
    whole = hashlib.sha256(data).hexdigest()
    if whole != manifest["sha256"]:
        raise BundleError(f"joined archive sha256 {whole}, manifest says {manifest['sha256']}")
    return data


def install(args) -> Path:
    target = Path(args.target)
    data = join(Path(args.parts))
    staging = Path(tempfile.mkdtemp(prefix="bundle-", dir=target.parent if target.parent.exists() else None))
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as tar:
        tar.extractall(staging, filter="data")
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)  # the old tree is replaced only once the new one is whole
    print(f"unpacked into {target}: PYTHONPATH={target}", flush=True)
    return target


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download, slim, pack and split (needs the package index)")
    b.add_argument("--torch", required=True, help="the node's torch version, e.g. 2.11.0")
    b.add_argument("--python", default="3.12", help="the node's Python, e.g. 3.12")
    b.add_argument("--platform", default="manylinux_2_31_x86_64")
    b.add_argument("--arch", default="sm90", choices=sorted(DROP), help="the node's GPU architecture")
    b.add_argument("--out", required=True)
    b.add_argument("--part-mb", type=int, default=54, help="largest part, MiB")
    b.add_argument("--node-freeze", help="`pip list --format=freeze` of the node: those packages are left out")
    b.add_argument("--extra", nargs="*", help="wheels to carry beside vLLM (default: what its GPU path imports)")
    b.add_argument("--xz-preset", type=int, default=9)
    i = sub.add_parser("install", help="check, join and unpack the parts (standard library only)")
    i.add_argument("--parts", required=True, help="folder with manifest.json and the parts")
    i.add_argument("--target", required=True, help="site folder to unpack into (then PYTHONPATH=it)")
    args = ap.parse_args(argv)
    try:
        build(args) if args.cmd == "build" else install(args)
    except BundleError as e:
        print(f"offline_bundle: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

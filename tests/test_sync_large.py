"""A simulated large model (2 GiB in bf16, 385 tensors) syncs over TCP with bounded extra memory.

The receiver (this process) uses double-buffered staging, so the update itself should need no
memory beyond the transport; the sender (a subprocess) casts chunk by chunk into one bucket.
Both peaks are measured as RSS above a baseline taken just before the update.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import torch

import bitmatch.sync as sync

TOKEN = "large-token"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = 32 << 20
SLACK = 96 << 20  # interpreter / allocator noise


def shapes():
    # 2 GiB of bf16 in tensors of several sizes: 8 MiB, 12 MiB, 1 MiB and small norms
    out = {}
    for i in range(128):
        out[f"model.layers.{i}.mlp.weight"] = (2048, 2048)          # 8 MiB
        out[f"model.layers.{i}.attn.weight"] = (1024, 3072)  # 6 MiB
        out[f"model.layers.{i}.norm.weight"] = (2048,)
    out["lm_head.weight"] = (32768, 4096)                             # 256 MiB, > bucket
    return out


def total_bytes():
    n = 0
    for s in shapes().values():
        k = 1
        for d in s:
            k *= d
        n += 2 * k
    return n


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


SENDER = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {tests!r})
    import bitmatch.sync as sync
    from test_sync_large import shapes
    # fp32 master tensors as stride-0 views: the source itself holds no memory, so the RSS
    # growth below is the publish path's own (cast chunks + one bucket)
    src = {{k: torch.tensor(float(i % 97) / 7 + 0.01).expand(*s) for i, (k, s) in enumerate(shapes().items())}}
    def status(key):  # VmHWM: peak RSS of this process image (ru_maxrss would count the forked parent)
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))
    base = status("VmRSS:")
    man = sync.publish(src, 1, to=sync.TcpSender("127.0.0.1", int(sys.argv[1]), {token!r}, bucket_bytes={bucket}))
    peak = status("VmHWM:")
    print("PEAK", peak - base, man.digest(), flush=True)
""")


def test_large_model_sync_memory_bounded_by_bucket():
    shp = shapes()
    live = {k: torch.zeros(s, dtype=torch.bfloat16) for k, s in shp.items()}
    rx = sync.receive(live, staging="double_buffer")  # the standby copy is allocated here
    base = rss()
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    th = threading.Thread(target=sample, daemon=True)
    t0 = time.time()
    with sync.serve(rx, TOKEN, timeout=60) as srv:
        th.start()
        code = SENDER.format(tests=os.path.join(ROOT, "tests"), token=TOKEN, bucket=BUCKET)
        r = subprocess.run([sys.executable, "-c", code, str(srv.address[1])], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        stop.set()
        th.join()
    elapsed = time.time() - t0
    assert r.returncode == 0, r.stderr
    line = [x for x in r.stdout.splitlines() if x.startswith("PEAK")][0]
    _, sender_extra, digest = line.split()
    assert rx.require_ready(1) == 1 and rx.state.manifest.digest() == digest
    nbytes = total_bytes()
    assert nbytes >= 2 << 30
    rx_extra = peak[0] - base
    print(f"\n{nbytes / 2**30:.2f} GiB in {elapsed:.1f} s; receiver extra {rx_extra / 2**20:.1f} MiB, "
          f"sender extra {int(sender_extra) / 2**20:.1f} MiB, bucket {BUCKET / 2**20:.0f} MiB")
    assert rx_extra <= BUCKET + SLACK, rx_extra
    assert int(sender_extra) <= 2 * BUCKET + SLACK, sender_extra
    # the bytes really arrived: spot-check a few tensors against the same cast
    for i, k in enumerate(shp):
        if i % 50 == 0 or k == "lm_head.weight":
            want = torch.tensor(float(i % 97) / 7 + 0.01).to(torch.bfloat16)
            assert bool((live[k] == want).all()), k

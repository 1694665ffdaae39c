"""Weight-sync throughput: loopback TCP publish and fingerprinting vs a raw torch copy, one run.

    python benchmarks/sync.py [--gib 1] [--bucket-mib 64] [--repeats 3] [--out benchmarks/results/sync.json]

The "model" is many bf16 tensors (plus an fp32 master variant, which adds the cast). The TCP
receiver runs in a separate process (as a rollout server would), double-buffered; a publish is
timed from connect to the receiver's commit acknowledgement, so it includes the sender's cast
and hash, the transfer, the receiver's re-hash, the switch and the post-switch check.
Ratios are against ``dst.copy_(src)`` of the same bytes in this process.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch
import xxhash

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bitmatch.sync as sync  # noqa: E402

TOKEN = "bench-token"


def make_state(gib: float, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    per = 16 << 20  # 16 MiB tensors, plus a few small ones
    n = max(1, int(gib * (1 << 30)) // per)
    out = {}
    for i in range(n):
        out[f"layers.{i}.weight"] = torch.randn(per // 2 // 4096, 4096, generator=g).to(dtype)
        out[f"layers.{i}.norm"] = torch.randn(4096, generator=g).to(dtype)
    return out


def nbytes(state):
    return sum(v.numel() * v.element_size() for v in state.values())


def best(fn, repeats):
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def raw_socket_GBps(payload: torch.Tensor, repeats: int) -> float:
    """Plain loopback sendall -> recv_into of the same bytes (threads; both release the GIL)."""
    import socket
    import threading
    srv = socket.create_server(("127.0.0.1", 0))
    dst = torch.empty_like(payload)
    mv_src, mv_dst = memoryview(payload.numpy()), memoryview(dst.numpy())

    def rx():
        c, _ = srv.accept()
        with c:
            for _ in range(repeats):
                got = 0
                while got < len(mv_dst):
                    got += c.recv_into(mv_dst[got:])
                c.sendall(b"k")
    th = threading.Thread(target=rx, daemon=True)
    th.start()
    ts = []
    with socket.create_connection(srv.getsockname()[:2]) as s:
        for _ in range(repeats):
            t = time.perf_counter()
            s.sendall(mv_src)
            s.recv(1)
            ts.append(time.perf_counter() - t)
    th.join()
    srv.close()
    return payload.numel() / 1e9 / min(ts)


def serve_main(gib, port_file):
    state = {k: torch.zeros_like(v) for k, v in make_state(gib, seed=1).items()}
    rx = sync.receive(state, staging="double_buffer")
    srv = sync.serve(rx, TOKEN)
    with open(port_file, "w") as f:
        f.write(str(srv.address[1]))
    sys.stdin.read()  # until the parent closes stdin
    srv.close()


def machine():
    cpu = "unknown"
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "sync.json"))
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve_main(a.gib, a.serve)

    bf16 = make_state(a.gib)
    nb = nbytes(bf16)
    gb = nb / 1e9
    dst = {k: torch.empty_like(v) for k, v in bf16.items()}
    for k in bf16:
        dst[k].copy_(bf16[k])  # fault pages in before timing
    t_copy = best(lambda: [dst[k].copy_(bf16[k]) for k in bf16], a.repeats)
    t_fp128 = best(lambda: [sync.fingerprint(v) for v in bf16.values()], a.repeats)
    t_fp64 = best(lambda: [xxhash.xxh3_64(v.reshape(-1).view(torch.uint8).numpy()).digest()
                           for v in bf16.values()], a.repeats)
    master = {k: v.float() for k, v in bf16.items()}
    t_castfp = best(lambda: sync.fingerprints(master), a.repeats)
    del dst
    flat = torch.cat([v.reshape(-1).view(torch.uint8) for v in bf16.values()])
    raw_sock = raw_socket_GBps(flat, a.repeats)
    del flat

    port_file = f"/tmp/bitmatch_sync_bench_{os.getpid()}.port"
    p = subprocess.Popen([sys.executable, __file__, "--serve", port_file, "--gib", str(a.gib)],
                         stdin=subprocess.PIPE, text=True)
    try:
        while not os.path.exists(port_file) or not open(port_file).read():
            if p.poll() is not None:
                raise SystemExit("receiver process died")
            time.sleep(0.05)
        time.sleep(0.1)
        port = int(open(port_file).read())
        tx = sync.TcpSender("127.0.0.1", port, TOKEN, bucket_bytes=a.bucket_mib << 20)
        v = [0]

        def pub(src):
            v[0] += 1
            sync.publish(src, v[0], to=tx)
        pub(bf16)  # warm-up: faults in the receiver's buffers
        t_tcp = best(lambda: pub(bf16), a.repeats)
        t_tcp_master = best(lambda: pub(master), a.repeats)
    finally:
        p.stdin.close()
        p.wait(timeout=30)
        os.unlink(port_file)

    res = {
        "bytes": nb, "tensors": len(bf16), "bucket_bytes": a.bucket_mib << 20,
        "raw_torch_copy_GBps": gb / t_copy,
        "fingerprint_xxh3_128_GBps": gb / t_fp128,
        "fingerprint_xxh3_64_GBps": gb / t_fp64,
        "cast_fp32_to_bf16_and_fingerprint_GBps_of_bf16": gb / t_castfp,
        "raw_loopback_socket_GBps": raw_sock,
        "tcp_publish_bf16_source_GBps": gb / t_tcp,
        "tcp_publish_fp32_master_GBps_of_bf16": gb / t_tcp_master,
    }
    res["ratio_fingerprint_vs_copy"] = res["fingerprint_xxh3_128_GBps"] / res["raw_torch_copy_GBps"]
    res["ratio_tcp_publish_vs_copy"] = res["tcp_publish_bf16_source_GBps"] / res["raw_torch_copy_GBps"]
    res["ratio_tcp_publish_vs_raw_socket"] = res["tcp_publish_bf16_source_GBps"] / raw_sock
    out = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": machine(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "xxhash": xxhash.VERSION, "libxxhash": xxhash.XXHASH_VERSION},
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "notes": "best of --repeats; GB = 1e9 bytes of bf16 payload; TCP publish is end to end "
                 "(cast, hash, send, receiver re-hash, switch, post-switch check) to a receiver process",
        "results": res,
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    for k, val in res.items():
        print(f"{k:50s} {val:.3f}" if isinstance(val, float) else f"{k:50s} {val}")


if __name__ == "__main__":
    main()

"""Weight-sync throughput: publish, verify and fingerprinting vs a plain copy, side by side.

    python benchmarks/sync/sync.py [--gib 1] [--bucket-mib 64] [--repeats 3] [--out benchmarks/results/sync.json]
    python benchmarks/sync/sync.py --device cuda --shapes 1.7b,8b [--repeats 3] --out DIR/sync_h200.json

CPU mode (below). CUDA mode: a Qwen3 1.7B / 8B shaped set of fp32 master weights (the trainer)
and a bf16 copy (the rollout) on one GPU; rows: a plain device copy (fp32 -> bf16 into the live
tensors), the bmh1 kernel's GB/s, GPU digests == CPU digests, in-process ``publish`` and
``verify``, a flipped bit caught, and a publish from another process over the shared-bucket
(CUDA IPC) transport.

The "model" is many bf16 tensors (plus an fp32 master variant, which adds the cast). The TCP
receiver runs in a separate process (as a rollout server would), double-buffered; a publish is
timed from connect to the receiver's commit acknowledgement, so it includes the sender's cast
and hash, the transfer, the receiver's re-hash, the switch and the post-switch check.
Ratios are against ``dst.copy_(src)`` of the same bytes in this process.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time

import torch
import xxhash

import bitmatch.sync as sync  # the installed package (its kernels live at bitmatch.kernels)

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


def serve_cuda(size, port_file):
    rollout = {n: torch.zeros(s, device="cuda", dtype=torch.bfloat16) for n, s in qwen3_shapes(size)}
    srv = sync.serve(sync.receive(rollout), TOKEN)
    with open(port_file, "w") as f:
        f.write(str(srv.address[1]))
    sys.stdin.read()
    srv.close()


def machine():
    cpu = "unknown"
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads()}


QWEN3 = {  # hidden, layers, intermediate, q heads, kv heads, tied embeddings
    "1.7b": (2048, 28, 6144, 16, 8, True),
    "8b": (4096, 36, 12288, 32, 8, False),
}
VOCAB, HEAD_DIM = 151936, 128


def qwen3_shapes(size: str):
    h, n_layers, inter, nq, nkv, tied = QWEN3[size]
    out = [("model.embed_tokens.weight", (VOCAB, h))]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (nq * HEAD_DIM, h)),
                (p + "self_attn.k_proj.weight", (nkv * HEAD_DIM, h)),
                (p + "self_attn.v_proj.weight", (nkv * HEAD_DIM, h)),
                (p + "self_attn.o_proj.weight", (h, nq * HEAD_DIM)),
                (p + "self_attn.q_norm.weight", (HEAD_DIM,)), (p + "self_attn.k_norm.weight", (HEAD_DIM,)),
                (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not tied:
        out.append(("lm_head.weight", (VOCAB, h)))
    return out


def cuda_timed(fn, repeats):
    """Best wall time of fn() with the device drained before and after (host syncs included)."""
    ts = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return min(ts)


def gpu_size(size: str, a) -> dict:
    from bitmatch.sync import hash as H

    dev = "cuda"
    shapes = qwen3_shapes(size)
    g = torch.Generator(device=dev).manual_seed(0)
    master = {n: torch.randn(s, device=dev, generator=g) * 0.02 for n, s in shapes}
    rollout = {n: torch.zeros(s, device=dev, dtype=torch.bfloat16) for n, s in shapes}
    n_params = sum(v.numel() for v in master.values())
    gb = 2 * n_params / 1e9
    res = {"shape": size, "params": n_params, "tensors": len(shapes), "rollout_GB": gb}

    def copy():
        for k, v in master.items():
            rollout[k].copy_(v)
    copy()
    res["device_copy_s"] = cuda_timed(copy, a.repeats)
    res["fingerprint_s"] = cuda_timed(lambda: H.fingerprints_of(rollout.values()), a.repeats)
    res["fingerprint_GBps"] = gb / res["fingerprint_s"]
    # the GPU kernel and the CPU reference agree (a row block that starts off a word boundary too)
    names = [shapes[0][0], shapes[1][0], shapes[5][0]]
    sample = [rollout[n] for n in names] + [rollout[names[1]][3:7, :-1].contiguous(), rollout[names[1]][5:9],
                                            rollout[names[1]].view(-1)[1:100_001]]  # starts off a word boundary
    res["gpu_digest_equals_cpu"] = H.fingerprints_of(sample) == H.fingerprints_of([t.cpu() for t in sample])

    rx = sync.receive(rollout)
    version = [0]

    def pub():
        version[0] += 1
        return sync.publish(master, version[0], to=rx)
    def pub_changed():  # every tensor changed (a full fine-tuning step): everything is sent
        for v in master.values():
            v.mul_(1.0001)
        pub()
    pub_changed()  # warm-up: compiles the kernel, allocates the staging once
    res["publish_inprocess_s"] = cuda_timed(pub_changed, a.repeats)
    # only what changed: nothing (a repeated publish), then LoRA-like (q/v projections re-merged)
    res["publish_unchanged_s"] = cuda_timed(pub, a.repeats)
    qv = [n for n, _ in shapes if n.endswith(("q_proj.weight", "v_proj.weight"))]

    def pub_lora():
        for n in qv:
            master[n].mul_(1.0001)
        pub()
    res["publish_qv_changed_s"] = cuda_timed(pub_lora, a.repeats)
    res["qv_changed_fraction_of_bytes"] = sum(master[n].numel() for n in qv) / n_params
    res["publish_full_rewrite_s"] = cuda_timed(
        lambda: sync.publish(master, version[0] + 1, to=sync.InProcessSender(rx, incremental=False))
        or version.__setitem__(0, version[0] + 1), a.repeats)
    man = rx.state.manifest
    res["verify_s"] = cuda_timed(lambda: sync.verify(rx, man), a.repeats)
    res["ratio_publish_vs_copy"] = res["publish_inprocess_s"] / res["device_copy_s"]
    res["ratio_verify_vs_copy"] = res["verify_s"] / res["device_copy_s"]
    # an accident after publish: one flipped bit in the live weights is named by verify
    w = rollout[names[1]].view(torch.int16)
    w[17, 5] ^= 1
    try:
        sync.verify(rx, man)
        res["flipped_bit_caught"] = False
    except sync.FingerprintMismatchError as e:
        res["flipped_bit_caught"] = e.name == names[1]
    w[17, 5] ^= 1
    rx = None  # frees it now (not del: pub and the lambdas above read rx)
    torch.cuda.empty_cache()  # the receiver process allocates its own copy and staging
    if a.ipc:
        res.update(ipc_publish(size, master, a))
    master = rollout = None
    torch.cuda.empty_cache()
    return res


@contextlib.contextmanager
def receiver_process(args):
    """This script in ``--serve`` mode in a child process (a rollout server); yields its port."""
    port_file = f"/tmp/bitmatch_sync_bench_{os.getpid()}.port"
    p = subprocess.Popen([sys.executable, __file__, "--serve", port_file, *args], stdin=subprocess.PIPE, text=True)
    try:
        while not os.path.exists(port_file) or not open(port_file).read():
            if p.poll() is not None:
                raise SystemExit("receiver process died")
            time.sleep(0.05)
        time.sleep(0.1)
        yield int(open(port_file).read())
    finally:
        p.stdin.close()
        p.wait(timeout=60)
        if os.path.exists(port_file):
            os.unlink(port_file)


def ipc_publish(size, master, a) -> dict:
    """Publish from this process into a receiver process on the same GPU: the control channel is
    the authenticated TCP one, the bytes go through a shared CUDA bucket (IPC handle)."""
    out = {}
    with receiver_process(["--device", "cuda", "--shapes", size]) as port:
        tx = sync.IpcSender("127.0.0.1", port, TOKEN, bucket_bytes=a.bucket_mib << 20)
        v = [100]

        def pub():
            v[0] += 1
            sync.publish(master, v[0], to=tx)
        pub()
        out["publish_ipc_s"] = cuda_timed(pub, a.repeats)
        out["ipc_bucket_bytes"] = a.bucket_mib << 20
        # the TCP byte path between the same two processes (pinned host buckets both ends)
        tcp = sync.TcpSender("127.0.0.1", tx.port, TOKEN, bucket_bytes=a.bucket_mib << 20)

        def pub_tcp():
            v[0] += 1
            sync.publish(master, v[0], to=tcp)
        out["publish_tcp_loopback_s"] = cuda_timed(pub_tcp, 1)
    return out


def gpu_main(a):
    import triton

    rows = []
    for size in a.shapes.split(","):
        r = gpu_size(size, a)
        rows.append(r)
        print(json.dumps(r))
    out = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": {**machine(), "gpu": torch.cuda.get_device_name(0)},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                     "cuda": torch.version.cuda},
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "notes": "random fp32 master and bf16 rollout tensors at Qwen3 shapes on one GPU; times are best of "
                 "--repeats wall seconds with the device drained; publish = cast on the device, bmh1 on the "
                 "device (sender, staged, and live after the switch), one staging copy, one commit copy; "
                 "publish_inprocess_s changes every tensor first (x 1.0001, timed too), publish_unchanged_s "
                 "republishes the same weights (nothing copied, live re-checked), publish_qv_changed_s changes "
                 "the q/v projections only, publish_full_rewrite_s is incremental=False",
        "results": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shapes", default="1.7b,8b", help="cuda mode: Qwen3 shapes to publish")
    ap.add_argument("--no-ipc", dest="ipc", action="store_false", help="cuda mode: skip the cross-process row")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    results = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
    ap.add_argument("--out", default=os.path.join(results, "sync.json"))
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve_main(a.gib, a.serve) if a.device == "cpu" else serve_cuda(a.shapes, a.serve)
    if a.device == "cuda":
        return gpu_main(a)

    bf16 = make_state(a.gib)
    nb = nbytes(bf16)
    gb = nb / 1e9
    dst = {k: torch.empty_like(v) for k, v in bf16.items()}
    for k in bf16:
        dst[k].copy_(bf16[k])  # fault pages in before timing
    t_copy = best(lambda: [dst[k].copy_(bf16[k]) for k in bf16], a.repeats)
    t_fp128 = best(lambda: sync.fingerprints_of(bf16.values()), a.repeats)
    t_fp64 = best(lambda: [xxhash.xxh3_64(v.reshape(-1).view(torch.uint8).numpy()).digest()
                           for v in bf16.values()], a.repeats)
    master = {k: v.float() for k, v in bf16.items()}
    t_castfp = best(lambda: sync.fingerprints(master), a.repeats)
    dst = None  # not del: the timed copy reads dst
    flat = torch.cat([v.reshape(-1).view(torch.uint8) for v in bf16.values()])
    raw_sock = raw_socket_GBps(flat, a.repeats)
    del flat

    with receiver_process(["--gib", str(a.gib)]) as port:
        tx = sync.TcpSender("127.0.0.1", port, TOKEN, bucket_bytes=a.bucket_mib << 20)
        v = [0]

        def pub(src):
            v[0] += 1
            sync.publish(src, v[0], to=tx)
        pub(bf16)  # warm-up: faults in the receiver's buffers
        t_tcp = best(lambda: pub(bf16), a.repeats)
        t_tcp_master = best(lambda: pub(master), a.repeats)

    res = {
        "bytes": nb, "tensors": len(bf16), "bucket_bytes": a.bucket_mib << 20,
        "raw_torch_copy_GBps": gb / t_copy,
        "fingerprint_bmh1_numpy_GBps": gb / t_fp128,
        "fingerprint_xxh3_64_GBps": gb / t_fp64,
        "cast_fp32_to_bf16_and_fingerprint_GBps_of_bf16": gb / t_castfp,
        "raw_loopback_socket_GBps": raw_sock,
        "tcp_publish_bf16_source_GBps": gb / t_tcp,
        "tcp_publish_fp32_master_GBps_of_bf16": gb / t_tcp_master,
    }
    res["ratio_fingerprint_vs_copy"] = res["fingerprint_bmh1_numpy_GBps"] / res["raw_torch_copy_GBps"]
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

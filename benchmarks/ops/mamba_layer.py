"""Mamba2 SSM scan of one layer: bitmatch's chunked-SSD Triton scan vs mamba_ssm's Triton kernels.

The scan is kernels.mamba_chunk_scan; side by side in one run, plus the invariance checks there.

  python benchmarks/ops/mamba_layer.py --out DIR --mamba-src .whl/mamba_ssm-2.3.2.post1
      [--shapes nemotron_h_8b,small] [--prefill 2048,8192] [--batches 1,64] [--context 4096]
      [--reps 20] [--device cuda|cpu] [--variants JSON] [--commit SHA]

Timed (bf16 inputs, fp32 SSM state, dt_softplus with dt_bias, D, no z):
- prefill: ours (trainer path: no cache; engine path: with the cache, which also stores the open
  chunk and the state) vs mamba_ssm's ``mamba_chunk_scan_combined`` (ssd_combined.py). Ratio
  mamba_ssm / ours (target >= 0.8).
- decode step at B sequences: ours = one call with the cache (open-chunk replay from the buffer,
  the boundary state advanced when a chunk closes), averaged over the Q consecutive positions of
  one chunk starting at --context, so every buffer fill level and one chunk close are in the mean;
  mamba_ssm = ``selective_state_update`` on the same shapes (fp32 state, vLLM's stride-0 expansion
  of dt / A / D / dt_bias). Eager (host launch costs included) and in one CUDA graph per Q steps
  (device time). Ratio ours / mamba_ssm (target <= 1.5).
- backward (the trainer's path): our scan's forward + backward (kernels/triton/mamba_bwd.py) vs
  mamba_ssm's ``mamba_chunk_scan_combined`` forward + backward, and both one's gradients against a
  plain fp32 torch SSD's autograd (max |diff| / max |ref| per input). Ratio mamba_ssm / ours.
- causal_conv1d: ours vs the ``causal_conv1d`` package's (prefill, and the one-token update) when
  it is importable (it needs its compiled extension; the sdist alone does not give it).
Checks on the device, bit for bit at each shape: full prefill == chunked prefill == token-by-token
decode, sequences packed vs alone, the engine's schedule (several sequences per call, prefill
chunks and decodes mixed, strided model-like inputs) vs each sequence alone for the scan and the
conv; parity (max abs error) of ours and mamba_ssm's output against
a plain fp32 torch SSD (kernels.mamba.scan_plain). Writes DIR/mamba_layer.json (command, machine,
versions, what ran, our config with registers / spills) after every step.
--variants '[{"BP": 32}, {"num_warps": 8}]' also times our scan under other configs (BP: a head's
P channels over P / BP programs), each with a bitwise prefill == decode check: data for choosing
the next canonical config (a config is part of the order: changing it changes the bits).

mamba_ssm is imported from its unpacked sdist (--mamba-src) without running mamba_ssm/__init__.py,
which imports the compiled selective_scan_cuda: stub package modules for ``mamba_ssm``,
``mamba_ssm.ops`` and ``mamba_ssm.ops.triton`` carry the right __path__, then the Triton
submodules import as usual (they need torch, triton, einops). --device cpu runs tiny shapes under
TRITON_INTERPRET=1: a check that the script runs, no timings worth reading.
"""
import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
import _common

SHAPES = {"nemotron_h_8b": dict(heads=128, head_dim=64, groups=8, state=128, chunk=128),
          # the same at a canonical chunk of 64 (the open-chunk replay of a decode step half as long;
          # Nemotron-H's checkpoints say 128, which mamba_ssm's rows at nemotron_h_8b use)
          "nemotron_h_8b_q64": dict(heads=128, head_dim=64, groups=8, state=128, chunk=64),
          "small": dict(heads=32, head_dim=64, groups=2, state=64, chunk=128),
          "nemotron_h_e2e": dict(heads=64, head_dim=64, groups=8, state=128, chunk=128),  # nemotron_h_e2e.py's
          "tiny": dict(heads=4, head_dim=16, groups=2, state=16, chunk=16)}


class Bench:
    def __init__(self, a):
        import torch

        import bitmatch.kernels as K
        from bitmatch.kernels.triton import mamba_ssd
        self.torch, self.K, self.ssd_mod, self.a = torch, K, mamba_ssd, a
        self.dev = a.device
        self.bf = torch.bfloat16

    # ------------------------------------------------------------- inputs
    def inputs(self, T, s, seed):
        torch = self.torch
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(T, s["heads"], s["head_dim"], generator=g)
        dt = torch.randn(T, s["heads"], generator=g) - 2
        B = torch.randn(T, s["groups"], s["state"], generator=g)
        C = torch.randn(T, s["groups"], s["state"], generator=g)
        return tuple(t.to(self.dev, self.bf) for t in (x, dt, B, C))

    def params(self, s):
        torch = self.torch
        g = torch.Generator().manual_seed(1)
        A = (-torch.rand(s["heads"], generator=g) * 4 - 0.5).to(self.dev)
        D = torch.randn(s["heads"], generator=g).to(self.dev)
        db = (torch.randn(s["heads"], generator=g) * 0.1).to(self.dev, self.bf)
        return A, D, db

    def cache(self, nb, s):
        torch, dev = self.torch, self.dev
        return (torch.zeros(nb, s["heads"], s["head_dim"], s["state"], device=dev),
                torch.zeros(nb, s["chunk"], s["heads"], s["head_dim"], device=dev, dtype=self.bf),
                torch.zeros(nb, s["chunk"], s["groups"], s["state"], device=dev, dtype=self.bf),
                torch.zeros(nb, s["chunk"], s["heads"], device=dev))

    def ours(self, seq, s, p, cu=None, start=None, cache=None, slots=None, host=None):
        """``host``: cu_seqlens on the host too, as the engine's decode steps give it (one token per
        sequence: no device assert, no buffer-copy launch)."""
        x, dt, B, C = seq
        A, D, db = p
        torch = self.torch
        if cu is None:
            cu = torch.tensor([0, x.shape[0]], device=self.dev, dtype=torch.int32)
        kw = {} if cache is None else dict(seq_start=start, cache=cache, state_slots=slots)
        if host is not None:
            kw["cu_seqlens_host"] = host
        return self.K.mamba_chunk_scan(x, dt, A, B, C, s["chunk"], cu, D=D, dt_bias=db, dt_min=1e-3, **kw)

    # ------------------------------------------------------------- timing
    def timed(self, fn):
        torch = self.torch
        fn()
        if self.dev != "cuda":
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        torch.cuda.synchronize()
        times = []
        for _ in range(self.a.reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1))
        return statistics.median(times)

    def graphed(self, fn, errors):
        """Median ms of one replay of a CUDA graph of fn (None off CUDA, or when capture fails:
        the reason goes to ``errors``)."""
        if self.dev != "cuda":
            return None
        try:
            return self.timed(_common.capture_graph([fn], 1).replay)
        except Exception as exc:  # noqa: BLE001 - the eager timings still stand
            errors.append(repr(exc))
            return None

    # ------------------------------------------------------------- checks
    def checks(self, s, ssd):
        torch = self.torch
        p = self.params(s)
        Q = s["chunk"]
        lens = (2 * Q + 37, Q + 1, 45)
        seqs = [self.inputs(n, s, seed=10 + i) for i, n in enumerate(lens)]
        out = {}
        alone = [self.ours(q, s, p) for q in seqs]
        cat = tuple(torch.cat([q[j] for q in seqs]) for j in range(4))
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=self.dev, dtype=torch.int32)
        packed = self.ours(cat, s, p, cu=cu)
        out["packed_vs_alone_equal"] = all(bool(torch.equal(packed[int(cu[i]):int(cu[i + 1])], alone[i]))
                                           for i in range(3))
        seq, n = seqs[0], lens[0]
        cuts = [n // 5, n // 3, 1, n // 3]
        for name, splits, host in (("decode", [n - 40] + [1] * 40, False), ("chunked", cuts + [n - sum(cuts)], False),
                                   ("token_by_token", [1] * n, False), ("token_by_token_host_bounds", [1] * n, True)):
            cache, at, parts = self.cache(4, s), 0, []
            for k in splits:
                part = tuple(t[at:at + k] for t in seq)
                parts.append(self.ours(part, s, p, start=torch.tensor([at], device=self.dev), cache=cache,
                                       slots=torch.tensor([2], device=self.dev), host=(0, k) if host else None))
                at += k
            y = torch.cat(parts)
            out[f"prefill_vs_{name}_equal"] = bool(torch.equal(y, alone[0]))
            out[f"prefill_vs_{name}_max_abs"] = float((y - alone[0]).abs().max())
        out.update(self.engine_schedule(s, p))
        # parity against a plain fp32 torch SSD on the same bf16 inputs (kernels.mamba.scan_plain; not
        # HF's mamba2_chunk_scan, which dispatches to mamba_ssm's kernel once mamba_ssm is importable)
        from bitmatch.kernels.mamba import scan_plain
        A, D, db = p
        f32 = [t.float() for t in seq]
        dtp = torch.nn.functional.softplus(f32[1] + db.float()).clamp(min=1e-3)
        ref = scan_plain(f32[0], dtp, A, f32[2], f32[3], D, Q, torch.tensor([0, n], device=self.dev))
        out["fp32_output_max_abs"] = float(ref.abs().max())
        out["ours_vs_fp32_max_abs"] = float((alone[0] - ref).abs().max())
        if ssd is not None and self.dev == "cuda":
            y = ssd.mamba_chunk_scan_combined(seq[0][None], seq[1][None], A, seq[2][None], seq[3][None], Q, D=D,
                                              dt_bias=db, dt_softplus=True, dt_limit=(1e-3, float("inf")))[0]
            out["mamba_ssm_vs_fp32_max_abs"] = float((y.float() - ref).abs().max())
        return out

    def engine_schedule(self, s, p, seed=0):
        """The engine's pattern, bit for bit against each sequence alone (the trainer's call): several
        sequences per call at different positions (prefill chunks of 1 to 100 tokens and one-token
        decodes mixed, order shuffled per step, caches in slots other than the sequence's index),
        x / B / C as views into one [T, H*P + 2*G*N] row as the model's conv output gives them, and
        the depthwise conv with its state over the same schedule."""
        import random
        torch, K = self.torch, self.K
        rnd = random.Random(seed)
        Q, H, P, G, N = s["chunk"], s["heads"], s["head_dim"], s["groups"], s["state"]
        A, D, db = p
        lens = [2 * Q + 37, Q + 1, 45, 1, Q]
        width = H * P + 2 * G * N
        g = torch.Generator().manual_seed(20 + seed)
        rows = [torch.randn(n, width, generator=g).to(self.dev, self.bf) for n in lens]
        dts = [(torch.randn(n, H, generator=g) - 2).to(self.dev, self.bf) for n in lens]
        cw = (torch.randn(width, 4, generator=g) * 0.5).to(self.dev, self.bf)
        cb = torch.randn(width, generator=g).to(self.dev, self.bf)

        def split(r):
            x, B, C = r.split([H * P, G * N, G * N], dim=-1)
            return x.reshape(-1, H, P), B.reshape(-1, G, N), C.reshape(-1, G, N)

        def scan(r, dt, cu, **kw):
            x, B, C = split(r)
            return K.mamba_chunk_scan(x, dt, A, B, C, Q, cu, D=D, dt_bias=db, dt_min=1e-3, **kw)

        def cu_of(ns):
            return torch.tensor([0, *torch.tensor(ns).cumsum(0).tolist()], device=self.dev, dtype=torch.int32)
        alone = [scan(r, d, cu_of([len(r)])) for r, d in zip(rows, dts)]
        conv_alone = [K.causal_conv1d(r, cw, cb, cu_of([len(r)])) for r in rows]
        nslot = len(lens) + 2
        cache = self.cache(nslot, s)
        conv_state = torch.zeros(nslot, 3, width, device=self.dev, dtype=self.bf)
        slot_of = [nslot - 1 - i for i in range(len(lens))]
        pos, outs, conv_outs, steps = [0] * len(lens), [[] for _ in lens], [[] for _ in lens], 0
        while any(q < n for q, n in zip(pos, lens)):
            live = [i for i, n in enumerate(lens) if pos[i] < n]
            rnd.shuffle(live)
            take = {i: min(lens[i] - pos[i], rnd.choice([1, 1, 3, 17, 64, 100])) for i in live}
            cu = cu_of([take[i] for i in live])
            r = torch.cat([rows[i][pos[i]:pos[i] + take[i]] for i in live])
            dt = torch.cat([dts[i][pos[i]:pos[i] + take[i]] for i in live])
            kw = dict(seq_start=torch.tensor([pos[i] for i in live], device=self.dev),
                      cache=cache, state_slots=torch.tensor([slot_of[i] for i in live], device=self.dev))
            y = scan(r, dt, cu, **kw)
            yc = K.causal_conv1d(r, cw, cb, cu, conv_state=conv_state,
                                 state_slots=torch.tensor([slot_of[i] for i in live], device=self.dev))
            for k, i in enumerate(live):
                a, b = int(cu[k]), int(cu[k + 1])
                outs[i].append(y[a:b])
                conv_outs[i].append(yc[a:b])
                pos[i] += take[i]
            steps += 1
        bad = [i for i in range(len(lens)) if not torch.equal(torch.cat(outs[i]), alone[i])]
        conv_bad = [i for i in range(len(lens)) if not torch.equal(torch.cat(conv_outs[i]), conv_alone[i])]
        return {"engine_schedule_steps": steps, "engine_schedule_vs_alone_equal": not bad,
                "engine_schedule_sequences_differing": bad, "conv_schedule_vs_alone_equal": not conv_bad,
                "conv_schedule_sequences_differing": conv_bad}

    # ------------------------------------------------------------- benches
    def prefill(self, s, T, ssd):
        torch = self.torch
        p = self.params(s)
        seq = self.inputs(T, s, seed=4)
        cache, start, slots = self.cache(1, s), torch.zeros(1, dtype=torch.int32, device=self.dev), \
            torch.zeros(1, dtype=torch.int32, device=self.dev)
        r = {"tokens": T, "ours_ms": self.timed(lambda: self.ours(seq, s, p)),
             "ours_cached_ms": self.timed(lambda: self.ours(seq, s, p, start=start, cache=cache, slots=slots))}
        if ssd is not None and self.dev == "cuda":  # mamba_ssm enters torch.cuda.device(x.device.index)
            A, D, db = p
            args = (seq[0][None], seq[1][None], A, seq[2][None], seq[3][None], s["chunk"])
            kw = dict(D=D, dt_bias=db, dt_softplus=True, dt_limit=(1e-3, float("inf")))
            r["mamba_ssm_ms"] = self.timed(lambda: ssd.mamba_chunk_scan_combined(*args, **kw))
            r["mamba_ssm_final_state_ms"] = self.timed(
                lambda: ssd.mamba_chunk_scan_combined(*args, return_final_states=True, **kw))
            r["ratio_mamba_ssm_over_ours"] = r["mamba_ssm_ms"] / r["ours_ms"]
        return r

    def backward(self, s, T, ssd):
        """Forward + backward of the scan (the trainer's path: Triton forward, Triton backward) vs
        mamba_ssm's ``mamba_chunk_scan_combined`` forward + backward, and each one's gradients
        against a plain fp32 torch SSD's autograd (max |diff| / max |ref| per input)."""
        torch = self.torch
        import torch.nn.functional as F

        from bitmatch.kernels.mamba import scan_plain
        A, D, db = self.params(s)
        x, dt, B, C = self.inputs(T, s, seed=6)
        gy = torch.randn(T, s["heads"], s["head_dim"], device=self.dev, generator=None)
        cu = torch.tensor([0, T], device=self.dev, dtype=torch.int32)
        names = ("x", "dt", "B", "C", "A", "D", "dt_bias")

        def leaves():
            return [t.detach().clone().requires_grad_(True) for t in (x, dt, B, C, A, D, db)]

        def ours(ls):
            y = self.K.mamba_chunk_scan(ls[0], ls[1], ls[4], ls[2], ls[3], s["chunk"], cu, D=ls[5], dt_bias=ls[6],
                                        dt_min=1e-3, cu_seqlens_host=[0, T])
            return torch.autograd.grad((y * gy).sum(), ls)

        def stock(ls):
            y = ssd.mamba_chunk_scan_combined(ls[0][None], ls[1][None], ls[4], ls[2][None], ls[3][None], s["chunk"],
                                              D=ls[5], dt_bias=ls[6], dt_softplus=True, dt_limit=(1e-3, float("inf")))
            return torch.autograd.grad((y[0].float() * gy).sum(), ls)

        ref_l = [t.detach().float().requires_grad_(True) for t in (x, dt, B, C, A, D, db)]
        dtv = F.softplus(ref_l[1] + ref_l[6]).clamp(min=1e-3)
        y = scan_plain(ref_l[0], dtv, ref_l[4], ref_l[2], ref_l[3], ref_l[5], s["chunk"], cu, [0, T])
        ref = torch.autograd.grad((y * gy).sum(), ref_l)

        def err(got):
            return {n: float((g.float() - r).abs().max() / r.abs().max().clamp_min(1e-30))
                    for n, g, r in zip(names, got, ref)}
        ls = leaves()
        r = {"tokens": T, "ours_fwd_bwd_ms": self.timed(lambda: ours(ls)), "ours_grad_rel_err": err(ours(ls))}
        from bitmatch.kernels.triton import mamba_bwd
        base = dict(mamba_bwd.SCAN_BWD)
        for v in json.loads(self.a.bwd_variants) if self.a.bwd_variants else []:  # launch knobs: same math
            mamba_bwd.SCAN_BWD.update(v)
            try:
                r.setdefault("variants", []).append({"knobs": v, "ours_fwd_bwd_ms": self.timed(lambda: ours(ls)),
                                                     "max_rel_err": max(err(ours(ls)).values())})
            except Exception as exc:  # noqa: BLE001 - a knob that does not compile loses only its row
                r.setdefault("variants", []).append({"knobs": v, "error": repr(exc)[:300]})
            finally:
                mamba_bwd.SCAN_BWD.clear()
                mamba_bwd.SCAN_BWD.update(base)
        if ssd is not None and self.dev == "cuda":
            r["mamba_ssm_fwd_bwd_ms"] = self.timed(lambda: stock(ls))
            r["mamba_ssm_grad_rel_err"] = err(stock(ls))
            r["ratio_mamba_ssm_over_ours"] = r["mamba_ssm_fwd_bwd_ms"] / r["ours_fwd_bwd_ms"]
        return r

    def decode(self, s, nb, ssu):
        torch = self.torch
        Q, H, P, N = s["chunk"], s["heads"], s["head_dim"], s["state"]
        p = self.params(s)
        A, D, db = p
        seq = self.inputs(nb, s, seed=3)
        cache = self.cache(nb, s)
        cache[0].normal_(0, 0.1)
        cache[1].normal_(0, 1.0)
        cache[2].normal_(0, 1.0)
        cache[3].uniform_(0.01, 0.1)
        cu = torch.arange(nb + 1, device=self.dev, dtype=torch.int32)
        slots = torch.arange(nb, device=self.dev, dtype=torch.int32)
        starts = [torch.full((nb,), self.a.context + i, device=self.dev, dtype=torch.int32) for i in range(Q)]

        host = tuple(range(nb + 1))  # the engine's decode steps pass the layout on the host

        def ours():
            for st in starts:
                self.ours(seq, s, p, cu=cu, start=st, cache=cache, slots=slots, host=host)
        errors = []
        g = self.graphed(ours, errors)
        r = {"batch": nb, "context": self.a.context, "host_bounds": True, "ours_ms": self.timed(ours) / Q,
             "ours_graph_ms": g / Q if g else None, "graph_errors": errors}
        if ssu is not None and self.dev == "cuda":
            state = torch.zeros(nb, H, P, N, device=self.dev).normal_(0, 0.1)
            x, dt, B, C = seq
            dte, Ae = dt[:, :, None].expand(nb, H, P), A[:, None, None].expand(H, P, N)
            De, dbe = D[:, None].expand(H, P), db[:, None].expand(H, P)

            def stock():
                for _ in range(Q):
                    ssu.selective_state_update(state, x, dte, Ae, B, C, De, dt_bias=dbe, dt_softplus=True,
                                               state_batch_indices=slots)
            r["mamba_ssm_ms"] = self.timed(stock) / Q
            g = self.graphed(stock, errors)
            r["mamba_ssm_graph_ms"] = g / Q if g else None
            r["ratio_ours_over_mamba_ssm"] = r["ours_ms"] / r["mamba_ssm_ms"]
            if r["ours_graph_ms"]:
                r["ratio_graph_ours_over_mamba_ssm"] = r["ours_graph_ms"] / r["mamba_ssm_graph_ms"]
        return r

    def conv(self, s, T, nb):
        """Our causal_conv1d vs the causal_conv1d package (prefill of T tokens, an update of nb)."""
        torch, K = self.torch, self.K
        Cd = s["heads"] * s["head_dim"] + 2 * s["groups"] * s["state"]
        g = torch.Generator().manual_seed(5)
        x = torch.randn(T, Cd, generator=g).to(self.dev, self.bf)
        w = (torch.randn(Cd, 4, generator=g) * 0.3).to(self.dev, self.bf)
        b = torch.randn(Cd, generator=g).to(self.dev, self.bf)
        cu = torch.tensor([0, T], device=self.dev, dtype=torch.int32)
        xs = torch.randn(nb, Cd, generator=g).to(self.dev, self.bf)
        st = torch.zeros(nb, 3, Cd, device=self.dev, dtype=self.bf)
        cu1, sl = torch.arange(nb + 1, device=self.dev, dtype=torch.int32), torch.arange(nb, device=self.dev)
        r = {"tokens": T, "batch": nb, "channels": Cd,
             "ours_prefill_ms": self.timed(lambda: K.causal_conv1d(x, w, b, cu)),
             "ours_update_ms": self.timed(lambda: K.causal_conv1d(xs, w, b, cu1, conv_state=st, state_slots=sl))}
        try:
            import causal_conv1d as cc
        except Exception as exc:  # noqa: BLE001
            r["causal_conv1d"] = f"not importable: {exc!r}"
            return r
        xt = x.t()[None]  # [1, C, T], channel-last storage like mamba_ssm's layer
        stc = torch.zeros(nb, Cd, 3, device=self.dev, dtype=self.bf)
        r["causal_conv1d"] = getattr(cc, "__version__", "?")
        r["stock_prefill_ms"] = self.timed(lambda: cc.causal_conv1d_fn(xt, w, b, activation="silu"))
        r["stock_update_ms"] = self.timed(lambda: cc.causal_conv1d_update(xs, stc, w, b, activation="silu"))
        r["ratio_prefill_stock_over_ours"] = r["stock_prefill_ms"] / r["ours_prefill_ms"]
        r["ratio_update_ours_over_stock"] = r["ours_update_ms"] / r["stock_update_ms"]
        return r

    def variant(self, s, override, prefill, batches, decode_only=False):
        """Our prefill / decode timings and bitwise prefill == decode under another config (of
        every call, or with ``decode_only`` of the one-token-per-sequence calls only)."""
        base = _common.override_scan_config(self.ssd_mod, override,
                                            lambda dtype, kw: kw.get("decode") or not decode_only,
                                            "--decode-variants / variants")
        try:
            r = {"override": override, "decode_only": decode_only}
            p, Q = self.params(s), s["chunk"]
            seq = self.inputs(2 * Q + 5, s, seed=6)
            full = self.ours(seq, s, p)
            cache = self.cache(1, s)
            parts = []
            for at, k in ((0, Q + 3), *((Q + 3 + i, 1) for i in range(Q + 2))):
                parts.append(self.ours(tuple(t[at:at + k] for t in seq), s, p,
                                       start=self.torch.tensor([at], device=self.dev), cache=cache,
                                       slots=self.torch.tensor([0], device=self.dev)))
            r["prefill_vs_decode_equal"] = bool(self.torch.equal(self.torch.cat(parts), full))
            r["prefill"] = [self.prefill(s, T, None) for T in prefill]  # no stock side: ours only
            r["decode"] = [self.decode(s, nb, None) for nb in batches]
            return r
        except Exception as exc:  # noqa: BLE001
            return {"override": override, "error": repr(exc), "traceback": traceback.format_exc(limit=6)}
        finally:
            self.ssd_mod.config_for = base

    def kernel_info(self, s):
        """The fixed config and, on CUDA, registers / spills of the compiled scan kernels."""
        cfg = self.ssd_mod.config_for(self.bf, s["head_dim"], s["state"], s["chunk"])
        info = {"config": cfg, "compiled": []}
        try:
            for caches in self.ssd_mod._ssd_kernel.device_caches.values():
                for k in caches[0].values():
                    info["compiled"].append({"n_regs": getattr(k, "n_regs", None),
                                             "n_spills": getattr(k, "n_spills", None),
                                             "shared": getattr(k.metadata, "shared", None)})
        except Exception as exc:  # noqa: BLE001 - interpreter or another Triton layout
            info["compiled"] = f"unavailable: {exc!r}"
        return info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--mamba-src", default=None, help="unpacked mamba-ssm sdist (e.g. .whl/mamba_ssm-2.3.2.post1)")
    ap.add_argument("--shapes", default="nemotron_h_8b,small")
    ap.add_argument("--prefill", default="2048,8192")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=4096, help="decode positions start here (a chunk boundary)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--no-backward", action="store_true", help="skip the forward + backward rows")
    ap.add_argument("--bwd-variants", default=None,
                    help='JSON list of kernels/triton/mamba_bwd.SCAN_BWD overrides timed beside the default, e.g. '
                         '\'[{"states_BP": 32}]\' (launch knobs: the gradients\' math is the same)')
    ap.add_argument("--variants", default=None,
                    help='JSON list of scan config overrides timed beside the canonical one, ours only, e.g. '
                         '\'[{"num_warps": 8}]\' (other bits: data for choosing the next order, not a result)')
    ap.add_argument("--decode-variants", default=None,
                    help='JSON list of scan config overrides of the decode calls only (one token per sequence), '
                         'e.g. \'[{"BM": 64}]\' (the former decode tile): timed, bits checked against the prefill')
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    if a.device == "cpu":  # Triton's interpreter: before triton is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("mamba_layer: --device cuda but CUDA is not available (use --device cpu for a smoke run)")
    ssd, ssu, note = _common.load_mamba_ssm(a.mamba_src)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "mamba_layer.json")
    res = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "commit": a.commit,
           "machine": _common.machine_info(a.device), "mamba_ssm": note,
           "kernels": {"ours_scan": "bitmatch.kernels.triton.mamba_ssd._ssd_kernel (+ _stash_kernel with a cache, "
                                    "except for one-token calls given host bounds: the decode rows)",
                       "ours_conv": "bitmatch.kernels.triton.mamba._conv_kernel",
                       "mamba_ssm_prefill": "mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined"
                       if ssd else None,
                       "mamba_ssm_decode": "mamba_ssm.ops.triton.selective_state_update.selective_state_update"
                       if ssu else None},
           "shapes": {}}

    def dump():
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    b = Bench(a)
    import bitmatch.kernels as K
    cpu = a.device == "cpu"  # the interpreter: tiny shapes, few calls
    names = ["tiny"] if cpu else a.shapes.split(",")
    prefill = [40] if cpu else [int(t) for t in a.prefill.split(",")]
    batches = [1, 3] if cpu else [int(nb) for nb in a.batches.split(",")]
    with K.use_backend("triton"):
        for name in names:
            s = SHAPES[name]
            out = res["shapes"][name] = {"shape": s, "checks": None, "prefill": [], "decode": [], "conv": [],
                                         "backward": []}
            steps = [("checks", lambda s=s: b.checks(s, ssd))] if not a.no_checks else []
            steps += [("prefill", lambda s=s, T=T: b.prefill(s, T, ssd)) for T in prefill]
            steps += [("backward", lambda s=s, T=T: b.backward(s, T, ssd)) for T in prefill if not a.no_backward]
            steps += [("decode", lambda s=s, nb=nb: b.decode(s, nb, ssu)) for nb in batches]
            steps += [("conv", lambda s=s, nb=nb: b.conv(s, prefill[0], nb)) for nb in batches]
            for key, fn in steps:
                t0 = time.time()
                try:
                    r = fn()
                except Exception as exc:  # noqa: BLE001 - one failing step must not lose the others
                    r = {"error": repr(exc), "traceback": traceback.format_exc(limit=6)}
                if key == "checks":
                    out["checks"] = r
                else:
                    out[key].append(r)
                print(name, key, json.dumps(r), f"({time.time() - t0:.1f}s)", flush=True)
                dump()
            out["kernel_info"] = b.kernel_info(s)
            dump()
            for v in json.loads(a.variants) if a.variants else []:
                out.setdefault("variants", []).append(b.variant(s, v, prefill, batches))
                print(name, "variant", json.dumps(out["variants"][-1]), flush=True)
                dump()
            for v in json.loads(a.decode_variants) if a.decode_variants else []:
                out.setdefault("decode_variants", []).append(b.variant(s, v, [], batches, decode_only=True))
                print(name, "decode variant", json.dumps(out["decode_variants"][-1]), flush=True)
                dump()
    print("wrote", path)


if __name__ == "__main__":
    main()

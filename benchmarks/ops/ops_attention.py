"""Paged attention on the GPU vs SDPA (bits and time): a section of benchmarks/ops/gpu_ops.py's run.

The invariance harness for each canonical-order variant (prefill alone vs in a batch, tile configs
and modes, chunked prefill and decode at page sizes 8 / 16 / 32 / 128 with shuffled block tables;
control: SDPA), the decode pipeline-depth / split choice, prefill and decode times against SDPA
flash and the K/V read roofline, and the backward against SDPA flash (gradients vs fp32 autograd,
times)."""
import importlib
import json
import math
import os
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
from _common import BF, DEV, L2, bench, geomean, rows_mismatch, triton_bench


def make_cache(ks, vs, page, extra_blocks, g):
    """Scatter sequences' K/V into one paged cache with a shuffled block table."""
    Hkv, D = ks[0].shape[1:]
    need = [(k.shape[0] + page - 1) // page for k in ks]
    nb = sum(need) + extra_blocks
    perm = torch.randperm(nb, device=DEV, generator=g)
    kc = torch.full((nb, page, Hkv, D), float("nan"), device=DEV, dtype=ks[0].dtype)
    vc = torch.full_like(kc, float("nan"))
    bt = torch.zeros((len(ks), max(need)), dtype=torch.int32, device=DEV)
    o = 0
    for i, (k, v) in enumerate(zip(ks, vs)):
        blocks = perm[o:o + need[i]]
        o += need[i]
        bt[i, :need[i]] = blocks.int()
        pos = torch.arange(k.shape[0], device=DEV)
        kc[blocks[pos // page], pos % page] = k
        vc[blocks[pos // page], pos % page] = v
    return kc, vc, bt
def inv_attention(K, quick):
    att = K.attention
    g = torch.Generator(device=DEV).manual_seed(3)
    Hq, Hkv, D = 32, 8, 128
    scale = D ** -0.5
    lens = [1000, 517, 2300]
    T = sum(lens)
    q = torch.randn(T, Hq, D, device=DEV, dtype=BF, generator=g)
    k = torch.randn(T, Hkv, D, device=DEV, dtype=BF, generator=g)
    v = torch.randn(T, Hkv, D, device=DEV, dtype=BF, generator=g)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEV)
    res = {}
    for window in (None, 300):
        tag = f"window={window}"
        r = {}
        full = att.attention_prefill(q, k, v, cu, scale, True, window)
        # accuracy vs SDPA (math in fp32) for seq 1
        s0, e0 = 0, lens[0]
        qq = q[s0:e0].transpose(0, 1)[None].float()
        kk = k[s0:e0].transpose(0, 1)[None].float().repeat_interleave(Hq // Hkv, 1)
        vv = v[s0:e0].transpose(0, 1)[None].float().repeat_interleave(Hq // Hkv, 1)
        i = torch.arange(e0, device=DEV)
        mask = i[None, :] <= i[:, None]
        if window:
            mask &= i[None, :] > i[:, None] - window
        ref = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)[0].transpose(0, 1)
        r["max_abs_vs_fp32_sdpa"] = float((full[s0:e0].float() - ref).abs().max())
        mism = 0
        for b in range(len(lens)):
            s, e = int(cu[b]), int(cu[b + 1])
            one = att.attention_prefill(q[s:e].contiguous(), k[s:e].contiguous(), v[s:e].contiguous(),
                                        torch.tensor([0, e - s], dtype=torch.int32, device=DEV),
                                        scale, True, window)
            mism += rows_mismatch(one, full[s:e])
        r["prefill_alone_vs_batch_rows"] = mism
        mism = {}
        for bm, mode in ((64, "fused"), (16, "split"), (128, "split"), (32, "fused"), (16, "fused")):
            o2 = att.attention_prefill(q, k, v, cu, scale, True, window, force_mode=mode, block_m=bm)
            bad = (o2 != full).reshape(T, -1).any(-1)
            mism[f"bm{bm}_{mode}"] = {"rows": int(bad.sum()),
                                      "first_rows": bad.nonzero()[:8, 0].tolist(),
                                      "max_abs": float((o2.float() - full.float()).abs().max())}
        r["prefill_tiles_modes"] = mism
        ks = [k[int(cu[b]):int(cu[b + 1])] for b in range(len(lens))]
        vs = [v[int(cu[b]):int(cu[b + 1])] for b in range(len(lens))]
        for page in (8, 16, 32, 128):
            kc, vc, bt = make_cache(ks, vs, page, 5, g)
            # decode: every sequence at several positions (one query each, batched)
            dec_m = 0
            n_checked = 0
            for t_rel in (0, 1, 63, 64, 511, 512, 513, 999):
                sel = [b for b in range(len(lens)) if t_rel < lens[b]]
                qd = torch.stack([q[int(cu[b]) + t_rel] for b in sel]).contiguous()
                sl = torch.tensor([t_rel + 1] * len(sel), dtype=torch.int32, device=DEV)
                od = att.attention_decode(qd, kc, vc, bt[sel].contiguous(), sl, scale, window)
                exp = torch.stack([full[int(cu[b]) + t_rel] for b in sel])
                dm = rows_mismatch(od, exp)
                if dm:
                    bad_rows = [(b, t_rel, float((od[j].float() - exp[j].float()).abs().max()))
                                for j, b in enumerate(sel) if not torch.equal(od[j], exp[j])]
                    r.setdefault(f"page{page}_decode_bad", []).extend(bad_rows)
                dec_m += dm
                n_checked += len(sel)
            # chunked prefill: random splits, all sequences batched per chunk round
            ch_m = 0
            gen = torch.Generator().manual_seed(page)
            for b in range(len(lens)):
                L = lens[b]
                cuts = sorted(set(torch.randint(1, L, (3,), generator=gen).tolist()))
                bounds = [0] + cuts + [L]
                for s, e in zip(bounds[:-1], bounds[1:]):
                    oc = att.attention_paged(q[int(cu[b]) + s:int(cu[b]) + e].contiguous(), kc, vc,
                                             bt[b:b + 1].contiguous(),
                                             torch.tensor([0, e - s], dtype=torch.int32, device=DEV),
                                             torch.tensor([e], dtype=torch.int32, device=DEV),
                                             scale, window)
                    ch_m += rows_mismatch(oc, full[int(cu[b]) + s:int(cu[b]) + e])
            # mixed paged batch: all 3 sequences, last 37 tokens each, split vs fused
            qm = torch.cat([q[int(cu[b + 1]) - 37:int(cu[b + 1])] for b in range(len(lens))])
            exp = torch.cat([full[int(cu[b + 1]) - 37:int(cu[b + 1])] for b in range(len(lens))])
            qsl = torch.arange(0, 37 * 4, 37, dtype=torch.int32, device=DEV)
            slen = torch.tensor(lens, dtype=torch.int32, device=DEV)
            mix = 0
            for mode in ("fused", "split"):
                mix += rows_mismatch(att.attention_paged(qm.contiguous(), kc, vc, bt, qsl, slen, scale,
                                                         window, force_mode=mode), exp)
            r[f"page{page}"] = {"decode_rows_mismatch": dec_m, "decode_rows_checked": n_checked,
                                "chunked_rows_mismatch": ch_m, "mixed_batch_rows_mismatch": mix}
        res[tag] = r
    # control: SDPA flash decode vs prefill row
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        L = lens[2]
        qq = q[int(cu[2]):].transpose(0, 1)[None]
        kk = k[int(cu[2]):].transpose(0, 1)[None]
        vv = v[int(cu[2]):].transpose(0, 1)[None]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            pre = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True)
            bad = 0
            pts = [5, 63, 100, 511, 1000, 1500, 2299]
            for t in pts:
                d = F.scaled_dot_product_attention(qq[:, :, t:t + 1], kk[:, :, :t + 1], vv[:, :, :t + 1],
                                                   scale=scale, enable_gqa=True)
                bad += int(not torch.equal(d[:, :, 0], pre[:, :, t]))
        res["sdpa_flash_control_decode_vs_prefill_mismatch"] = f"{bad}/{len(pts)}"
    except Exception as e:
        res["sdpa_flash_control"] = repr(e)
    return res
def time_attention(K, quick, ceil):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    att = K.attention
    Hq, Hkv, D = 32, 8, 128
    scale = D ** -0.5
    out = {"prefill": {}, "decode": {}}
    for S in (512, 1024, 2048, 4096, 8192):
        B = max(1, 16384 // S)
        T = B * S
        q = torch.randn(T, Hq, D, device=DEV, dtype=BF)
        k = torch.randn(T, Hkv, D, device=DEV, dtype=BF)
        v = torch.randn(T, Hkv, D, device=DEV, dtype=BF)
        cu = torch.arange(0, T + 1, S, dtype=torch.int32, device=DEV)
        qs = q.view(B, S, Hq, D).transpose(1, 2)
        ks = k.view(B, S, Hkv, D).transpose(1, 2)
        vs = v.view(B, S, Hkv, D).transpose(1, 2)
        qd, kd, vd = qs.contiguous(), ks.contiguous(), vs.contiguous()

        def sdpa():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale,
                                                      enable_gqa=True)

        gqa_note = "enable_gqa=True"
        try:
            sdpa()
        except Exception:
            kd = kd.repeat_interleave(Hq // Hkv, 1)
            vd = vd.repeat_interleave(Hq // Hkv, 1)
            gqa_note = "K/V expanded to Hq heads (flash refused enable_gqa)"

            def sdpa():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)

        a = bench(lambda i: sdpa, 10 ** 9)
        b = bench(lambda i: (lambda: att.attention_prefill(q, k, v, cu, scale, True, None,
                                                           max_seqlen=S)), 10 ** 9)
        flops = 4 * B * Hq * S * S * D / 2
        out["prefill"][f"S{S}_B{B}"] = {"sdpa_flash_ms": a, "ours_ms": b, "ratio": a / b,
                                        "ours_TFLOPs": flops / (b * 1e-3) / 1e12,
                                        "sdpa_TFLOPs": flops / (a * 1e-3) / 1e12,
                                        "sdpa_gqa": gqa_note}
        print("prefill", S, a, b, a / b, flush=True)
        q = k = v = qd = kd = vd = None  # frees them now (not del: sdpa and the lambdas read these names)
        torch.cuda.empty_cache()
    bw = ceil["copy_bw_TBps"] * 1e12
    page = 16
    for B in (1, 16, 64, 256):
        for ctx in (256, 1024, 4096, 8192):
            nblk = ctx // page
            kv_bytes = 2 * B * ctx * Hkv * D * 2
            nrot = 1 if kv_bytes >= 3 * L2 else min(16, math.ceil(3 * L2 / kv_bytes))
            kc = torch.randn(nrot * B * nblk, page, Hkv, D, device=DEV, dtype=BF)
            vc = torch.randn_like(kc)
            bts = [(torch.randperm(B * nblk, device=DEV).int() + r * B * nblk).view(B, nblk).contiguous()
                   for r in range(nrot)]
            qs = [torch.randn(B, Hq, D, device=DEV, dtype=BF) for _ in range(nrot)]
            sl = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
            b = bench(lambda i: (lambda: att.attention_decode(qs[i], kc, vc, bts[i], sl, scale,
                                                              max_query_len=1, max_seq_len=ctx)),
                      kv_bytes, n=nrot)
            kd = [torch.randn(B, Hkv, ctx, D, device=DEV, dtype=BF) for _ in range(min(nrot, 4))]
            vd = [torch.randn_like(kd[0]) for _ in range(len(kd))]
            qd = [x[:, :, None] for x in qs]

            def sdpa_dec(i):
                def f():
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        return F.scaled_dot_product_attention(qd[i % len(qd)], kd[i % len(kd)],
                                                              vd[i % len(vd)], scale=scale,
                                                              enable_gqa=True)
                return f

            try:
                a = bench(sdpa_dec, kv_bytes, n=nrot)
            except Exception:
                kd = [x.repeat_interleave(Hq // Hkv, 1) for x in kd]
                vd = [x.repeat_interleave(Hq // Hkv, 1) for x in vd]

                def sdpa_dec(i):
                    def f():
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                            return F.scaled_dot_product_attention(qd[i % len(qd)], kd[i % len(kd)],
                                                                  vd[i % len(vd)], scale=scale)
                    return f
                a = bench(sdpa_dec, kv_bytes, n=nrot)
            src = torch.empty(kv_bytes // 2, dtype=BF, device=DEV)
            dst = torch.empty_like(src)
            c = bench(lambda i: (lambda: dst.copy_(src)), kv_bytes, n=1)
            roof_ms = kv_bytes / bw * 1e3
            out["decode"][f"B{B}_ctx{ctx}"] = {
                "ours_ms": b, "sdpa_flash_ms": a, "ratio_vs_sdpa": a / b,
                "roofline_ms": roof_ms, "ratio_vs_roofline": roof_ms / b,
                "copy_same_bytes_ms": c, "ratio_vs_copy_of_kv_bytes_read_once": (c / 2) / b,
                "ours_TBps": kv_bytes / (b * 1e-3) / 1e12}
            print("decode", B, ctx, b, a / b, roof_ms / b, flush=True)
            kc = vc = kd = vd = src = dst = None
            torch.cuda.empty_cache()
    return out
# Canonical-order variants of the attention kernels compared side by side in one run:
#   rowsum16: row sums of P through the tensor core (rowsum_mma: the MMA's k-order, the same for
#             mma.sync and wgmma), so decode may use 16-row tiles (the default since 2026-12-03)
#   rowsum16_skipmask: the same order, no mask select on KV blocks that every valid row sees
#             whole (SKIP_FULL_BLOCK_MASKS: a launch knob, same bits by construction; not yet run)
#   v64:      row sums of P by tl.sum (register layout order); every CUDA tile >= 64 rows
#             (wgmma), so decode pads its G query rows to 64 (the committed order up to 2026-12-02)
# Lower-case keys are canonical-order fields (run under kernels/order.py's override, which the
# stamp follows; rowsum_mma also sets the 16/64-row minimum CUDA tile), upper-case keys the
# attention module's launch knobs.
ATT_VARIANTS = {"rowsum16": dict(rowsum_mma=True, SKIP_FULL_BLOCK_MASKS=False),
                "rowsum16_skipmask": dict(rowsum_mma=True, SKIP_FULL_BLOCK_MASKS=True),
                "v64": dict(rowsum_mma=False, SKIP_FULL_BLOCK_MASKS=False),
                # canonical change: 256-position partitions double decode's programs at small batch
                "rowsum16_p256": dict(rowsum_mma=True, SKIP_FULL_BLOCK_MASKS=False, kv_partition=256)}
ALL_ATT_VARIANTS = dict(ATT_VARIANTS)   # --variants narrows ATT_VARIANTS; lookups use this
BEST_DECODE_KNOBS = {}   # variant -> {knob: value} chosen by sweep_decode in this run
class attn_variant:
    def __init__(self, att, name):
        self.att, self.cfg = att, dict(ALL_ATT_VARIANTS[name])
        self.cfg.update(BEST_DECODE_KNOBS.get(name, {}))

    def __enter__(self):
        knobs = {k: v for k, v in self.cfg.items() if k.isupper()}
        self.order = self.att.order.override(**{k: v for k, v in self.cfg.items() if not k.isupper()})
        self.order.__enter__()
        self.old = {k: getattr(self.att, k) for k in knobs}
        for k, v in knobs.items():
            setattr(self.att, k, v)

    def __exit__(self, *exc):
        for k, v in self.old.items():
            setattr(self.att, k, v)
        self.order.__exit__(*exc)
def inv_attention_variants(K, quick):
    res = {}
    for name in ATT_VARIANTS:
        try:
            with attn_variant(K.attention, name):
                res[name] = inv_attention(K, quick)
        except Exception:
            res[name] = {"error": traceback.format_exc()[-2000:]}
        print("inv_attention", name, json.dumps(res[name])[:600], flush=True)
    return res
def _decode_case(B, ctx, Hkv=8, Hq=32, D=128, page=16):
    nblk = ctx // page
    kv_bytes = 2 * B * ctx * Hkv * D * 2
    nrot = 1 if kv_bytes >= 3 * L2 else min(16, math.ceil(3 * L2 / kv_bytes))
    kc = torch.randn(nrot * B * nblk, page, Hkv, D, device=DEV, dtype=BF)
    vc = torch.randn_like(kc)
    bts = [(torch.randperm(B * nblk, device=DEV).int() + r * B * nblk).view(B, nblk).contiguous()
           for r in range(nrot)]
    qs = [torch.randn(B, Hq, D, device=DEV, dtype=BF) for _ in range(nrot)]
    sl = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    return kc, vc, bts, qs, sl, kv_bytes, nrot
def sweep_decode(K, ceil):
    """Pipeline depth of the paged kernel per variant (launch knob: bits unchanged, checked)."""
    att = K.attention
    scale = 128 ** -0.5
    bw = ceil["copy_bw_TBps"] * 1e12
    res = {}
    cases = [(1, 8192), (16, 4096), (64, 1024), (256, 4096)]
    data = {c: _decode_case(*c) for c in cases}
    refs = {}
    for name in ATT_VARIANTS:
        r = {}
        for st in (2, 3, 4):
            with attn_variant(K.attention, name):
                old = att.DECODE_STAGES
                att.DECODE_STAGES = st
                try:
                    for (B, ctx), (kc, vc, bts, qs, sl, kv_bytes, nrot) in data.items():
                        o = att.attention_decode(qs[0], kc, vc, bts[0], sl, scale,
                                                 max_query_len=1, max_seq_len=ctx)
                        ref_key = (name, B, ctx)
                        if ref_key not in refs:
                            refs[ref_key] = o
                        r.setdefault("rows_differing_from_first_stages", {})[f"{st}_B{B}_ctx{ctx}"] = \
                            rows_mismatch(o, refs[ref_key])
                        t = bench(lambda i: (lambda: att.attention_decode(
                            qs[i], kc, vc, bts[i], sl, scale, max_query_len=1, max_seq_len=ctx)),
                            kv_bytes, n=nrot, rep=40, warmup=10)
                        r.setdefault(str(st), {})[f"B{B}_ctx{ctx}"] = {
                            "ms": t, "ratio_vs_roofline": kv_bytes / bw * 1e3 / t}
                except Exception:
                    r[str(st)] = {"error": traceback.format_exc()[-1500:]}
                finally:
                    att.DECODE_STAGES = old
            print("sweep_decode", name, st, json.dumps(r.get(str(st)))[:400], flush=True)
        ok = {st: geomean([e["ratio_vs_roofline"] for e in v.values()]) for st, v in r.items()
              if st in ("2", "3", "4") and "error" not in v}
        if ok:
            best = max(ok, key=lambda k: ok[k])
            BEST_DECODE_KNOBS[name] = {"DECODE_STAGES": int(best)}
            r["best_stages"] = int(best)
            r["geomean_by_stages"] = ok
            # fused partitions (one launch, no workspace) vs split, at the best depth
            fused = {}
            with attn_variant(K.attention, name):
                for (B, ctx), (kc, vc, bts, qs, sl, kv_bytes, nrot) in data.items():
                    try:
                        o = att.attention_decode(qs[0], kc, vc, bts[0], sl, scale, max_query_len=1,
                                                 max_seq_len=ctx, force_mode="fused")
                        t = bench(lambda i: (lambda: att.attention_decode(
                            qs[i], kc, vc, bts[i], sl, scale, max_query_len=1, max_seq_len=ctx,
                            force_mode="fused")), kv_bytes, n=nrot, rep=40, warmup=10)
                        fused[f"B{B}_ctx{ctx}"] = {
                            "ms": t, "ratio_vs_roofline": kv_bytes / bw * 1e3 / t,
                            "programs": B * 8, "rows_differing_from_split": rows_mismatch(o, refs[(name, B, ctx)])}
                    except Exception:
                        fused[f"B{B}_ctx{ctx}"] = {"error": traceback.format_exc()[-800:]}
            r["fused_at_best_stages"] = fused
            # smallest program count from which fused wins at every larger swept batch
            split_best = r[best]
            wins = sorted((v["programs"], v["ms"] < split_best[k]["ms"]) for k, v in fused.items()
                          if "ms" in v and k in split_best)
            thr = None
            for progs, win in reversed(wins):
                if not win:
                    break
                thr = progs
            if thr is not None:
                BEST_DECODE_KNOBS[name]["DECODE_SPLIT_MAX_PROGRAMS"] = thr
            r["decode_split_max_programs"] = thr
        res[name] = r
    del data
    torch.cuda.empty_cache()
    return res
def time_attention_variants(K, quick, ceil):
    res = {}
    for name in ATT_VARIANTS:
        try:
            with attn_variant(K.attention, name):
                res[name] = time_attention(K, quick, ceil)
                res[name]["decode_knobs"] = {"DECODE_STAGES": K.attention.DECODE_STAGES,
                                             "DECODE_SPLIT_MAX_PROGRAMS": K.attention.DECODE_SPLIT_MAX_PROGRAMS}
        except Exception:
            res[name] = {"error": traceback.format_exc()[-2000:]}
    return res
BWD_CFGS = {  # (dq BM, BN, warps, stages), (dkdv BM, BN, warps, stages)
    "dq": [(128, 64, 8, 2), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 8, 2), (64, 32, 4, 3),
           (128, 64, 8, 3)],
    "kv": [(64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 64, 8, 2),
           (32, 64, 4, 3), (128, 64, 8, 2), (64, 128, 8, 3)],
}
# (S, B) of the tile sweeps: packed sequences of S tokens, B of them; the timings below run with
# the first case's winners. 1024 x 4 is the 8B training step's (benchmarks/training/gpu_train.py).
BWD_SWEEP_CASES = [(4096, 4)]
BWD_TIME_S = (512, 1024, 2048, 4096, 8192)
def set_bwd_tiles(mod, dq=None, kv=None):
    """Set kernels/triton/attention_bwd.py's launch knobs: dq / kv = (BM, BN, warps, stages)."""
    if dq:
        mod.BWD_DQ_BLOCK_M, mod.BWD_DQ_BLOCK_N, mod.BWD_DQ_WARPS, mod.BWD_DQ_STAGES = dq
    if kv:
        mod.BWD_KV_BLOCK_M, mod.BWD_KV_BLOCK_N, mod.BWD_KV_WARPS, mod.BWD_KV_STAGES = kv
def _ref_grads_fp32(q, k, v, lens, scale, causal, window, do):
    """fp32 autograd of the plain math per sequence (the reference for both sides)."""
    Hq, Hkv = q.shape[1], k.shape[1]
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    outs, s = [], 0
    for L in lens:
        qq = leaves[0][s:s + L].transpose(0, 1)
        kk = leaves[1][s:s + L].transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
        vv = leaves[2][s:s + L].transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
        i = torch.arange(L, device=DEV)
        mask = torch.ones(L, L, dtype=torch.bool, device=DEV)
        if causal:
            mask &= i[None, :] <= i[:, None]
        if window:
            mask &= i[None, :] > i[:, None] - window
        sc = (qq @ kk.transpose(1, 2)) * scale
        outs.append((sc.masked_fill(~mask, float("-inf")).softmax(-1) @ vv).transpose(0, 1))
        s += L
    torch.cat(outs).backward(do.float())
    return [t.grad for t in leaves]
def attention_backward(K, quick):
    """Triton flash backward: gradients vs fp32 autograd (bf16 tolerance, with SDPA flash's own
    error as the yardstick), a small tile sweep, and timings vs SDPA flash backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    att = K.attention
    bwd = importlib.import_module(att.__name__.rsplit(".", 1)[0] + ".attention_bwd")
    Hq, Hkv, D = 32, 8, 128
    scale = D ** -0.5
    res = {"correctness": {}, "sweep": {}, "time": {}}
    g = torch.Generator(device=DEV).manual_seed(5)
    for causal, window, lens in ((True, None, [1000, 517, 2300]), (True, 300, [1000, 517, 2300]),
                                 (False, None, [700, 129])):
        T = sum(lens)
        q, k, v = (torch.randn(T, h, D, device=DEV, dtype=BF, generator=g) for h in (Hq, Hkv, Hkv))
        do = torch.randn(T, Hq, D, device=DEV, dtype=BF, generator=g)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEV)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = att.attention_prefill_autograd(*leaves, cu, scale, causal, window)
        same_fwd = bool(torch.equal(out.detach(), att.attention_prefill(q, k, v, cu, scale, causal, window)))
        out.backward(do)
        ref = _ref_grads_fp32(q, k, v, lens, scale, causal, window, do)
        r = {"forward_bits_equal_to_attention_prefill": same_fwd}
        for nm, got, rf in zip("qkv", (t.grad for t in leaves), ref):
            r[f"d{nm}_max_abs_err_rel_to_max"] = float((got.float() - rf).abs().max() / rf.abs().max())
            r[f"d{nm}_rms_err_rel"] = float(((got.float() - rf).pow(2).mean() / rf.pow(2).mean()).sqrt())
            r[f"d{nm}_finite"] = bool(torch.isfinite(got).all())
        if window is None:  # SDPA flash's own bf16 error on the same case (its mask is causal/none)
            try:
                sd = [t.clone().requires_grad_() for t in (q, k, v)]
                s0 = 0
                for L in lens:
                    qq, kk, vv = (x[s0:s0 + L].transpose(0, 1)[None] for x in sd)
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, scale=scale,
                                                           enable_gqa=True)
                    o.backward(do[s0:s0 + L].transpose(0, 1)[None])
                    s0 += L
                for nm, got, rf in zip("qkv", (t.grad for t in sd), ref):
                    r[f"sdpa_flash_d{nm}_max_abs_err_rel_to_max"] = float(
                        (got.float() - rf).abs().max() / rf.abs().max())
                    r[f"sdpa_flash_d{nm}_rms_err_rel"] = float(
                        ((got.float() - rf).pow(2).mean() / rf.pow(2).mean()).sqrt())
            except Exception as e:
                r["sdpa_flash_error"] = repr(e)[:300]
        res["correctness"][f"causal={causal}_window={window}"] = r
        print("bwd correctness", causal, window, json.dumps(r), flush=True)
        del q, k, v, do, leaves, out, ref
    torch.cuda.empty_cache()

    def case(S, B):
        T = B * S
        q, k, v = (torch.randn(T, h, D, device=DEV, dtype=BF) for h in (Hq, Hkv, Hkv))
        do = torch.randn(T, Hq, D, device=DEV, dtype=BF)
        cu = torch.arange(0, T + 1, S, dtype=torch.int32, device=DEV)
        return q, k, v, do, cu

    def ours_bwd_fn(q, k, v, do, cu, S):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = att.attention_prefill_autograd(*leaves, cu, scale, True, None, max_seqlen=S)
        return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)

    # sweep per case: dq tiles with the default dkdv, then dkdv tiles with the best dq
    old = (bwd.BWD_DQ_BLOCK_M, bwd.BWD_DQ_BLOCK_N, bwd.BWD_DQ_WARPS, bwd.BWD_DQ_STAGES), \
          (bwd.BWD_KV_BLOCK_M, bwd.BWD_KV_BLOCK_N, bwd.BWD_KV_WARPS, bwd.BWD_KV_STAGES)
    first = None
    try:
        for S_sw, B_sw in BWD_SWEEP_CASES:
            set_bwd_tiles(bwd, *old)
            q, k, v, do, cu = case(S_sw, B_sw)
            best_dq, best_kv = old
            tag = "" if (S_sw, B_sw) == (4096, 4) else f"S{S_sw}_B{B_sw}_"
            res["sweep"][f"{tag}default"] = triton_bench(ours_bwd_fn(q, k, v, do, cu, S_sw))
            for part in ("dq", "kv"):
                best = None
                for c in BWD_CFGS[part]:
                    set_bwd_tiles(bwd, **{part: c})
                    try:
                        t = triton_bench(ours_bwd_fn(q, k, v, do, cu, S_sw))
                    except Exception as e:
                        res["sweep"][f"{tag}{part}{c}"] = repr(e)[:300]
                        continue
                    res["sweep"][f"{tag}{part}{c}"] = t
                    if best is None or t < best[0]:
                        best = (t, c)
                    print("bwd sweep", S_sw, B_sw, part, c, t, flush=True)
                if best:
                    set_bwd_tiles(bwd, **{part: best[1]})
                    if part == "dq":
                        best_dq = best[1]
                    else:
                        best_kv = best[1]
            res.setdefault("chosen_by_case", {})[f"S{S_sw}_B{B_sw}"] = {"dq": best_dq, "kv": best_kv}
            first = first or (best_dq, best_kv)
            del q, k, v, do
            torch.cuda.empty_cache()
        best_dq, best_kv = first
        set_bwd_tiles(bwd, dq=best_dq, kv=best_kv)
        res["chosen"] = {"dq": best_dq, "kv": best_kv}
        gqa_ok = [True]
        for c in BWD_TIME_S:
            S, B_c = c if isinstance(c, tuple) else (c, None)
            try:
                _time_bwd_case(S, res, case, ours_bwd_fn, gqa_ok, att, Hq, Hkv, D, scale, B_c)
            except Exception:
                res["time"][f"S{S}_error"] = traceback.format_exc()[-1500:]
            torch.cuda.empty_cache()
    finally:
        # the timings above ran with the chosen tiles; leave them set for later sections
        set_bwd_tiles(bwd, dq=best_dq, kv=best_kv)
    return res
def _time_bwd_case(S, res, case, ours_bwd_fn, gqa_ok, att, Hq, Hkv, D, scale, B=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B = B or max(1, 16384 // S)
    q, k, v, do, cu = case(S, B)
    qd, kd, vd = (x.view(B, S, -1, D).transpose(1, 2).contiguous().requires_grad_()
                  for x in (q, k, v))
    dod = do.view(B, S, Hq, D).transpose(1, 2).contiguous()

    def sdpa_fwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            if gqa_ok[0]:
                return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True,
                                                      scale=scale, enable_gqa=True)
            return F.scaled_dot_product_attention(
                qd, kd.repeat_interleave(Hq // Hkv, 1), vd.repeat_interleave(Hq // Hkv, 1),
                is_causal=True, scale=scale)

    try:
        o_sd = sdpa_fwd()
        torch.autograd.grad(o_sd, (qd, kd, vd), dod, retain_graph=True)
    except Exception as e:  # flash without GQA: K/V expanded inside the timed graph
        res["sdpa_gqa_note"] = f"enable_gqa refused ({repr(e)[:200]}); K/V expanded"
        gqa_ok[0] = False
        o_sd = sdpa_fwd()
    t_sd_b = triton_bench(lambda: torch.autograd.grad(o_sd, (qd, kd, vd), dod, retain_graph=True))
    t_sd_fb = triton_bench(lambda: torch.autograd.grad(sdpa_fwd(), (qd, kd, vd), dod))
    t_us_b = triton_bench(ours_bwd_fn(q, k, v, do, cu, S))
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    t_us_fb = triton_bench(lambda: torch.autograd.grad(
        att.attention_prefill_autograd(ql, kl, vl, cu, scale, True, None, max_seqlen=S),
        (ql, kl, vl), do))
    cud = {}
    try:  # what HF's SDPA picks on Hopper: cuDNN (K/V expanded if it refuses GQA)
        def cudnn_fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(
                    qd, kd.repeat_interleave(Hq // Hkv, 1), vd.repeat_interleave(Hq // Hkv, 1),
                    is_causal=True, scale=scale)
        o_cd = cudnn_fwd()
        cud["sdpa_cudnn_bwd_ms"] = triton_bench(
            lambda: torch.autograd.grad(o_cd, (qd, kd, vd), dod, retain_graph=True))
        cud["sdpa_cudnn_fwd_bwd_ms"] = triton_bench(lambda: torch.autograd.grad(cudnn_fwd(), (qd, kd, vd), dod))
    except Exception as e:
        cud["sdpa_cudnn_error"] = repr(e)[:300]
    fl_b = 2.5 * 4 * B * Hq * S * S * D / 2
    res["time"][f"S{S}_B{B}"] = {**cud,
        "sdpa_flash_bwd_ms": t_sd_b, "ours_bwd_ms": t_us_b, "ratio_bwd": t_sd_b / t_us_b,
        "sdpa_flash_fwd_bwd_ms": t_sd_fb, "ours_fwd_bwd_ms": t_us_fb,
        "ratio_fwd_bwd": t_sd_fb / t_us_fb,
        "ours_bwd_TFLOPs": fl_b / (t_us_b * 1e-3) / 1e12,
        "sdpa_bwd_TFLOPs": fl_b / (t_sd_b * 1e-3) / 1e12}
    print("bwd time", S, json.dumps(res["time"][f"S{S}_B{B}"]), flush=True)


def attention_bwd_cudnn(K, Hq=32, Hkv=8, D=128, cases=((1024,) * 4, (1500, 300, 1024, 1272))):
    """The trainer's attention backward on cuDNN from OUR forward's output and logsumexp
    (kernels/triton/attention_bwd.py BWD_BACKEND, the forward's bits untouched): the one-time
    check's verdict, then per batch (equal lengths, ragged) each backend's gradient error against
    fp32 autograd, its time, and whether two runs give the same bits. (torch 2.11's ragged cuDNN
    backward breaks past the head dim: probe_h100_cudnn_ragged_backward.json.)"""
    att = K.attention
    bwd = importlib.import_module(att.__name__.rsplit(".", 1)[0] + ".attention_bwd")
    scale = D ** -0.5
    res = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    saved = bwd.BWD_BACKEND
    try:
        g = torch.Generator(device=DEV).manual_seed(7)
        for lens in cases:
            T, S = sum(lens), max(lens)
            q, k, v = (torch.randn(T, h, D, device=DEV, dtype=BF, generator=g) for h in (Hq, Hkv, Hkv))
            do = torch.randn(T, Hq, D, device=DEV, dtype=BF, generator=g)
            cu = torch.tensor([0] + list(lens), device=DEV).cumsum(0).to(torch.int32)
            out, lse2 = att.attention_prefill(q, k, v, cu, scale, True, None, max_seqlen=S, return_lse=True)
            ref = _ref_grads_fp32(q, k, v, list(lens), scale, True, None, do)
            case = {}
            if "verdict" not in res:
                res["verdict"] = {"refusal": bwd._cudnn_refusal(q, None), "layout": str(bwd._LAYOUT)}
            for name in ("triton", "cudnn"):
                bwd.BWD_BACKEND = name
                run = lambda: bwd.attention_prefill_backward_any(do, q, k, v, out, lse2, cu, scale, True,  # noqa: E731
                                                                 None, max_seqlen=S)
                try:
                    g1, g2 = run(), run()
                    err = {f"d{n}_rms_err_rel": float(((a.float() - r).pow(2).mean() / r.pow(2).mean()).sqrt())
                           for n, a, r in zip("qkv", g1, ref)}
                    case[name] = {**err, "run_to_run_equal": all(torch.equal(x, y) for x, y in zip(g1, g2)),
                                  "ms": triton_bench(run)}
                except Exception:
                    case[f"{name}_error"] = traceback.format_exc()[-1500:]
            if "ms" in case.get("triton", {}) and "ms" in case.get("cudnn", {}):
                case["cudnn_speedup"] = case["triton"]["ms"] / case["cudnn"]["ms"]
            res["x".join(map(str, lens))] = case
            print("attention_bwd_cudnn", lens, json.dumps(case)[:800], flush=True)
    finally:
        bwd.BWD_BACKEND = saved
    return res

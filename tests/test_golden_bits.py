"""Golden bits: every op's output bits at fixed inputs, pinned to the canonical order's stamp.

For each op of the op table (``kernels/table.py``), seeded inputs at one or two tiny shapes run on each
backend (the reference on CPU; Triton in the interpreter, TRITON_INTERPRET=1, which conftest sets:
the interpreter's dots are float64, so these are its bits, not the GPU's, but every structural
switch of the order shows in them). ``tests/golden_bits.json`` holds the xxh3 of the outputs'
bytes per (backend, op, shape) beside the stamp of that backend. Bits that change under the same
stamp fail (the order changed and the stamp would let a trainer and an engine on different code
sync), and so does a stamp that changed without the file being regenerated:

    python tests/test_golden_bits.py --write
"""
import argparse
import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # the --write run: the interpreter, set before triton is imported (pytest:
    # conftest sets it; a script importing this module, benchmarks/ops/golden_gpu.py, keeps its own)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import xxhash  # noqa: E402

import bitmatch.kernels as K  # noqa: E402
from bitmatch.kernels import order  # noqa: E402
from bitmatch.kernels.fp8 import quantize_fp8_blocks  # noqa: E402

GOLDEN = Path(__file__).with_name("golden_bits.json")
BACKENDS = ("reference", "triton")
WRITE = "python tests/test_golden_bits.py --write"
BF, F32 = torch.bfloat16, torch.float32


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _rn(*shape, seed, dtype=BF, scale=1.0):
    return (torch.randn(*shape, generator=_g(seed)) * scale).to(dtype)


def _seqs(lens, Hq=4, Hkv=2, D=16, seed=0):
    T = sum(lens)
    cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)
    return _rn(T, Hq, D, seed=seed), _rn(T, Hkv, D, seed=seed + 1), _rn(T, Hkv, D, seed=seed + 2), cu


def _paged(k, v, lens, page=16, seed=0):
    """The sequences' K/V scattered into pages of a shuffled cache: caches, block table."""
    per = [-(-n // page) for n in lens]
    nb = sum(per) + 2
    perm = torch.randperm(nb, generator=_g(seed))
    kc = torch.zeros(nb, page, *k.shape[1:], dtype=k.dtype)
    vc = torch.zeros_like(kc)
    bt = torch.zeros(len(lens), max(per), dtype=torch.int32)
    s = used = 0
    for b, n in enumerate(lens):
        for j in range(per[b]):
            blk = int(perm[used])
            used += 1
            bt[b, j] = blk
            rows = slice(s + j * page, s + min(n, (j + 1) * page))
            m = rows.stop - rows.start
            kc[blk, :m], vc[blk, :m] = k[rows], v[rows]
        s += n
    return kc, vc, bt


def _attention_prefill():
    q, k, v, cu = _seqs([80, 21], seed=10)
    return K.attention_prefill(q, k, v, cu, 0.25, max_seqlen=80)


def _attention_paged():
    lens = [80, 21]
    q, k, v, _ = _seqs(lens, seed=10)
    kc, vc, bt = _paged(k, v, lens, seed=1)
    # a chunk of 5 queries ending each sequence: chunked prefill against the cache
    qsl = torch.tensor([0, 5, 10], dtype=torch.int32)
    qc = torch.cat([q[75:80], q[96:101]])
    return K.attention_paged(qc, kc, vc, bt, qsl, torch.tensor(lens, dtype=torch.int32), 0.25,
                             max_query_len=5, max_seq_len=80)


def _attention_decode():
    lens = [80, 21]
    q, k, v, _ = _seqs(lens, seed=10)
    kc, vc, bt = _paged(k, v, lens, seed=1)
    return K.attention_decode(torch.stack([q[79], q[100]]), kc, vc, bt,
                              torch.tensor(lens, dtype=torch.int32), 0.25, max_seq_len=80)


def _write_kv_cache():
    k, v = _rn(5, 2, 16, seed=3), _rn(5, 2, 16, seed=4)
    kc, vc = torch.zeros(3, 4, 2, 16, dtype=BF), torch.zeros(3, 4, 2, 16, dtype=BF)
    K.write_kv_cache(k, v, kc, vc, torch.tensor([9, 0, 5, 6, 2]))
    return kc, vc


def _logits(seed, n=3, v=300, dtype=F32):
    return _rn(n, v, seed=seed, dtype=dtype, scale=3.0)


def _sampling_args():
    return _logits(20), torch.tensor([1.0, 0.7, 1.3]), torch.tensor([0.1, 0.5, 0.93], dtype=torch.float64)


def _moe_case(T=6, e=4, h=64, i=32, seed=30):
    w, ids = K.moe_route(_rn(T, e, seed=seed, dtype=F32), 2, renormalize=True)
    w_in = _rn(e, 2 * i, h, seed=seed + 1, scale=0.1)
    w_out = _rn(e, h, i, seed=seed + 2, scale=0.1)
    return _rn(T, h, seed=seed + 3), ids, w, w_in, w_out


def _sink_attention():
    L, C, H, D = 24, 6, 4, 32
    g = _g(40)
    q, kv, ent = (torch.randn(*s, generator=g).to(BF) for s in ((L, H, D), (L, D), (C, D)))
    pos = torch.arange(L)
    mask = (torch.arange(C).view(1, -1) < ((pos + 1) // 4).view(-1, 1)) & (torch.rand(L, C, generator=g) < 0.7)
    return K.sink_attention(q, pos, kv, ent, mask, torch.randn(H, generator=g), scale=D ** -0.5, window=6)



def _compress_rows(overlap):
    g = _g(72)
    qpos = torch.cat([torch.arange(n) for n in (13, 9)])
    c = 32 if overlap else 16
    kv, gate = (torch.randn(qpos.shape[0], c, generator=g).to(BF) for _ in range(2))
    return K.compress_rows(kv, gate, torch.randn(4, c, generator=g), qpos, K.KeyRows.packed(qpos), rate=4,
                           overlap=overlap)

def _rows_case(lens=(13, 9), H=4, D=32, seed=70):
    """Two packed sequences from position 0: q, positions, the K = V and entry stores, KeyRows."""
    g = _g(seed)
    qpos = torch.cat([torch.arange(n) for n in lens])
    T = qpos.shape[0]
    q, kv, ent = (torch.randn(*s, generator=g).to(BF) for s in ((T, H, D), (T, D), (T, D)))
    return q, qpos, kv, ent, torch.randn(H, generator=g), K.KeyRows.packed(qpos)


def _sink_rows(selected: bool):
    q, qpos, kv, ent, sinks, rows = _rows_case()
    sel = None
    if selected:  # CSA: up to 2 listed entries per row, -1 padded, only complete windows
        n_vis = torch.div(qpos + 1, 4, rounding_mode="floor").view(-1, 1)
        sel = torch.tensor([[0, 2]] * qpos.shape[0], dtype=torch.int32)
        sel = torch.where(sel < n_vis, sel, -1).to(torch.int32)
    return K.sink_attention_rows(q, qpos, kv, sinks, rows, scale=32 ** -0.5, window=6, entries=ent, rate=4,
                                 selected=sel)


def _indexer_rows():
    g = _g(75)
    qpos = torch.cat([torch.arange(17), torch.arange(11)])
    T = qpos.shape[0]
    return K.indexer_select(torch.randn(T, 4, 16, generator=g).to(BF), qpos, torch.randn(T, 16, generator=g).to(BF),
                            torch.randn(T, 4, generator=g), K.KeyRows.packed(qpos), rate=4, top_k=2,
                            softmax_scale=0.25)


def _hc(T=5, N=3, D=16, seed=50):
    x = _rn(T, N, D, seed=seed)
    fn = _rn((2 + N) * N, N * D, seed=seed + 1, dtype=F32, scale=0.2)
    return x, fn, _rn((2 + N) * N, seed=seed + 2, dtype=F32), torch.tensor([0.5, 0.7, 0.9])


def _mamba_inputs(T=40, H=4, P=16, G=2, N=16, seed=60):
    g = _g(seed)
    x, dt = torch.randn(T, H, P, generator=g), torch.randn(T, H, generator=g)
    B, C = torch.randn(T, G, N, generator=g), torch.randn(T, G, N, generator=g)
    A = -torch.rand(H, generator=g) * 2 - 0.1
    return x, dt, A, B, C, torch.randn(H, generator=g), torch.randn(H, generator=g) * 0.5


def _fp8_bytes(qs):
    return qs[0].view(torch.uint8), qs[1]


# op -> {shape name: inputs and call}; names say the shape and the input dtype
CASES = {
    "linear": {
        "5x64->48 bf16 bias": lambda: K.linear(_rn(5, 64, seed=1), _rn(48, 64, seed=2), _rn(48, seed=3)),
        "3x300->40 f32": lambda: K.linear(_rn(3, 300, seed=4, dtype=F32), _rn(40, 300, seed=5, dtype=F32)),
    },
    # K = 300: two whole 128-groups and a partial one; N = 40: a partial 128-row weight block. The
    # quantizer's e4m3 bytes as uint8 (torch has no isfinite / allclose for float8): compared exactly
    "quantize_fp8_groups": {
        "3x300 bf16": lambda: _fp8_bytes(K.quantize_fp8_groups(_rn(3, 300, seed=80, scale=3.0))),
        "2x260 f32 ue8m0": lambda: _fp8_bytes(K.quantize_fp8_groups(_rn(2, 260, seed=81, dtype=F32),
                                                                    scale_fmt="ue8m0"))},
    "fp8_linear": {"5x300->40 bf16 bias": lambda: K.fp8_linear(
        _rn(5, 300, seed=82, scale=0.1), *quantize_fp8_blocks(_rn(40, 300, seed=83, scale=0.05)),
        _rn(40, seed=84, scale=0.1))},
    "fp8_linear_master": {"5x300->40 bf16 ue8m0": lambda: K.fp8_linear_master(
        _rn(5, 300, seed=85, scale=0.1), _rn(40, 300, seed=86, scale=0.05), scale_fmt="ue8m0")},
    "rms_norm": {"4x96 bf16": lambda: K.rms_norm(_rn(4, 96, seed=6), _rn(96, seed=7), 1e-6)},
    "fused_add_rms_norm": {
        "4x96 bf16": lambda: K.fused_add_rms_norm(_rn(4, 96, seed=6), _rn(4, 96, seed=8), _rn(96, seed=7), 1e-6)},
    "rotary_cos_sin": {"pos 0..6 d32 yarn": lambda: K.rotary_cos_sin(
        torch.arange(7), 32, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})},
    "apply_rotary": {"7x(4,2)x32 bf16": lambda: K.apply_rotary(
        _rn(7, 4, 32, seed=9), _rn(7, 2, 32, seed=10), *K.rotary_cos_sin(torch.arange(7) * 5, 32, 10000.0))},
    "silu_and_mul": {"4x2x48 bf16": lambda: K.silu_and_mul(_rn(4, 96, seed=11))},
    "attention_prefill": {"seqs 80+21 q4 kv2 d16 bf16": _attention_prefill},
    "attention_paged": {"chunks 5+5 of 80+21 page16": _attention_paged},
    "attention_decode": {"2 seqs 80+21 page16": _attention_decode},
    "write_kv_cache": {"5 slots of 3x4 pages": _write_kv_cache},
    "token_logprobs": {"3x300 f32": lambda: K.token_logprobs(_logits(12), torch.tensor([0, 150, 299]),
                                                             torch.tensor([1.0, 0.7, 1.3]))},
    "full_logprobs": {"3x300 bf16": lambda: K.full_logprobs(_logits(13, dtype=BF), 0.8)},
    "top_k_top_p_mask": {"3x300 k5 p0.9": lambda: K.top_k_top_p_mask(_logits(14), 0.9, top_k=5, top_p=0.9)},
    "apply_top_k_top_p": {"3x300 k20 p0.8": lambda: K.apply_top_k_top_p(_logits(15), 1.1, top_k=20, top_p=0.8)},
    "categorical_sample": {"3x300": lambda: K.categorical_sample(*_sampling_args()),
                           "3x300 greedy row 1": lambda: K.categorical_sample(
                               *_sampling_args(), greedy=torch.tensor([False, True, False]))},
    "uniform_noise": {"4 seeds": lambda: K.uniform_noise(torch.tensor([0, 1, -7, 2 ** 40]),
                                                         torch.tensor([0, 3, 5, 100]))},
    "moe_route": {"6x8 top2 sigmoid bias": lambda: K.moe_route(
        _rn(6, 8, seed=16, dtype=F32), 2, scoring="sigmoid", renormalize=True,
        correction_bias=_rn(8, seed=17, dtype=F32, scale=0.1), scaling=1.5)},
    "moe_scores": {"6x8 sqrtsoftplus": lambda: K.moe_scores(_rn(6, 8, seed=18, dtype=F32), "sqrtsoftplus"),
                   "6x8 softmax": lambda: K.moe_scores(_rn(6, 8, seed=19, dtype=F32), "softmax")},
    "moe_experts": {"6 tokens 4 experts h64 i32 swiglu": lambda: K.moe_experts(*_moe_case())},
    "moe_combine": {"6 tokens k3 h64":
                    lambda: K.moe_combine(_rn(6, 3, 64, seed=36), torch.rand(6, 3, generator=_g(37)))},
    "sink_attention": {"L24 C6 h4 d32 bf16": _sink_attention},
    "sink_attention_rows": {"2 seqs HCA m4 w6 bf16": lambda: _sink_rows(False),
                            "2 seqs CSA m4 w6 bf16": lambda: _sink_rows(True)},
    "indexer_select": {"2 seqs m4 k2 bf16": _indexer_rows},
    "compress_rows": {"2 seqs CSA m4 c32 bf16": lambda: _compress_rows(True),
                      "2 seqs HCA m4 c16 bf16": lambda: _compress_rows(False)},
    "compress_windows": {"5 windows m4 c16 f32": lambda: K.compress_windows(
        _rn(5, 4, 16, seed=41, dtype=F32), _rn(5, 4, 16, seed=42, dtype=F32), _rn(4, 16, seed=43, dtype=F32))},
    "indexer_topk": {"T20 C5 h4 d16 bf16": lambda: K.indexer_topk(
        _rn(20, 4, 16, seed=44), torch.arange(20), _rn(5, 16, seed=45), _rn(20, 4, seed=46, dtype=F32),
        rate=4, top_k=2, softmax_scale=0.25)},
    "hc_pre": {"T5 N3 D16 bf16": lambda: K.hc_pre(*_hc(), iters=4, eps=1e-6, norm_eps=1e-6)},
    "hc_post": {"T5 N3 D16 bf16": lambda: K.hc_post(
        _rn(5, 3, 16, seed=51), _rn(5, 16, seed=52), _rn(5, 3, seed=53, dtype=F32).sigmoid(),
        _rn(5, 3, 3, seed=54, dtype=F32).softmax(-1))},
    "hc_head": {"T5 N3 D16 bf16": lambda: K.hc_head(
        _rn(5, 3, 16, seed=55), _rn(3, 48, seed=56, dtype=F32, scale=0.2), _rn(3, seed=57, dtype=F32),
        torch.tensor([0.6]), eps=1e-6, norm_eps=1e-6)},
    "apply_rotary_interleaved": {"7x3x32 r16 bf16": lambda: K.apply_rotary_interleaved(
        _rn(7, 3, 32, seed=58), *K.rotary_cos_sin(torch.arange(7) * 3, 16, 10000.0))},
    "causal_conv1d": {"seqs 7+5 c8 k4 bf16": lambda: K.causal_conv1d(
        _rn(12, 8, seed=59), _rn(8, 4, seed=60), _rn(8, seed=61), torch.tensor([0, 7, 12]))},
    "mamba_chunk_scan": {"T40 h4 p16 g2 n16 Q16": lambda: (lambda x, dt, A, B, C, D, db: K.mamba_chunk_scan(
        x, dt, A, B, C, 16, torch.tensor([0, 40]), D=D, dt_bias=db, dt_min=0.001))(*_mamba_inputs())},
    "gated_rms_norm": {"6x32 groups of 16": lambda: K.gated_rms_norm(
        _rn(6, 32, seed=62, dtype=F32), _rn(6, 32, seed=63, dtype=F32), _rn(32, seed=64, dtype=F32), 16, 1e-5)},
}
def family(op: str) -> str:
    """The op family whose version (``ORDER.op_versions``) covers ``op``: its op table entry's."""
    return K.OPS[op].family


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in (out or ()) for t in _tensors(o)]


def bits_hash(out) -> str:
    """xxh3 of every output tensor's dtype, shape and raw bytes, in output order."""
    h = xxhash.xxh3_64()
    for t in _tensors(out):
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def run_case(op, shape, backend):
    torch.manual_seed(0)
    with torch.no_grad(), K.use_backend(backend):
        return bits_hash(CASES[op][shape]())


def compute(backend, ops=None):
    return {op: {shape: run_case(op, shape, backend) for shape in CASES[op]} for op in (ops or CASES)}


def load():
    return json.loads(GOLDEN.read_text())


def _stamp_diff(old, new):
    return sorted(k for k in set(old) | set(new) if k != "fingerprint" and old.get(k) != new.get(k))


@pytest.fixture(scope="module")
def golden():
    if not GOLDEN.exists():
        pytest.fail(f"{GOLDEN.name} is missing: generate it with `{WRITE}`")
    return load()


def test_every_op_has_a_case_and_a_version():
    ops = set(K.OPS)  # tests/test_op_table.py: every exported op has an entry
    assert ops == set(CASES), f"ops without a golden case: {sorted(ops - set(CASES))}; " \
                              f"cases of no op: {sorted(set(CASES) - ops)}"
    versions = dict(order.current().op_versions)
    missing = sorted({family(op) for op in CASES} - set(versions))
    assert not missing, f"op families without a version in CanonicalOrder.op_versions: {missing}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_golden_file_matches_the_stamp(golden, backend):
    """A stamp that changed means the order changed on purpose: the golden bits must follow."""
    old, new = golden["stamps"][backend], order.stamp(backend)
    assert old["fingerprint"] == new["fingerprint"], (
        f"the {backend} stamp changed ({_stamp_diff(old, new)}) but {GOLDEN.name} was not "
        f"regenerated: run `{WRITE}` and commit the file with the order change")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", sorted(CASES))
def test_golden_bits(golden, backend, op):
    if golden["stamps"][backend]["fingerprint"] != order.stamp(backend)["fingerprint"]:
        pytest.skip("stamp changed: test_golden_file_matches_the_stamp says regenerate")
    want = golden["bits"][backend].get(op)
    assert want is not None, f"no golden bits for op {op} on {backend}: run `{WRITE}`"
    got = compute(backend, [op])[op]
    changed = sorted(s for s in CASES[op] if got[s] != want.get(s))
    assert not changed, (
        f"op {op}'s bits changed without an order version bump ({backend}, {changed}): bump "
        f"ORDER.version or the op's version (op_versions[{family(op)!r}] in kernels/order.py), "
        f"then regenerate with `{WRITE}`")


def test_control_another_kv_block_changes_bits_and_stamp(golden):
    """The golden test can fail: attention walked in 32-position KV blocks gives other bits (the
    80-token sequence spans a different block walk), and the stamp follows the override."""
    want = golden["bits"]["triton"]["attention_prefill"]
    shape = next(iter(CASES["attention_prefill"]))
    with order.override(kv_block=32):
        assert order.stamp("triton")["fingerprint"] != golden["stamps"]["triton"]["fingerprint"]
        assert run_case("attention_prefill", shape, "triton") != want[shape]
    assert run_case("attention_prefill", shape, "triton") == want[shape]
    assert order.stamp("triton")["fingerprint"] == golden["stamps"]["triton"]["fingerprint"]


def test_control_reference_grid_changes_bits_and_stamp(golden):
    """The reference's integer grid is part of its order: 12-bit slices round the bf16 values
    more than 2**-4 below their row's max, so linear's bits move, and so does the stamp."""
    shape = next(iter(CASES["linear"]))
    with order.override(exact_grid_bits=12):
        assert order.stamp("reference")["fingerprint"] != golden["stamps"]["reference"]["fingerprint"]
        assert run_case("linear", shape, "reference") != golden["bits"]["reference"]["linear"][shape]


def write():
    data = {"stamps": {b: order.stamp(b) for b in BACKENDS}, "bits": {b: compute(b) for b in BACKENDS}}
    GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN} ({sum(len(s) for b in data['bits'].values() for s in b.values())} hashes)")


def test_importing_this_module_leaves_the_interpreter_switch_alone():
    """benchmarks/ops/golden_gpu.py imports this module for its cases: setting TRITON_INTERPRET here
    on import ran every 'GPU' golden kernel in the interpreter on the host's CPU (the --write
    run, this file as a script, still sets it)."""
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import os, sys; sys.path.insert(0, {d!r}); import test_golden_bits; "
            "print(os.environ.get('TRITON_INTERPRET'))").format(d=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "None"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="regenerate tests/golden_bits.json")
    if not ap.parse_args().write:
        sys.exit(pytest.main([__file__, "-q", "-p", "no:xdist"]))
    write()

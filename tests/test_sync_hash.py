"""bmh1, the weight fingerprint (bitmatch/sync/hash.py): the numpy reference and the Triton kernel
(under TRITON_INTERPRET=1 here; the GPU run in benchmarks/sync/sync.py) give the same digest for the
same bytes, whatever the dtype, size, alignment or split into pieces; every accident it is meant
to catch changes the digest, and a position-free control misses the reordering ones."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's import (tests/conftest.py does it too)

import numpy as np
import pytest
import torch

from bitmatch import sync
from bitmatch.sync import hash as H

interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool]
SIZES = [0, 1, 3, 5, 7, 257, 4096 * 2 + 3]  # below, at and across the kernel's 4096-word block


def _rand(n, dtype, g):
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), (n,), generator=g).to(dtype)


def _kernel_digest(t):
    from bitmatch.kernels.triton.fingerprint import word_sums

    b = H.byte_view(t.contiguous())
    sa, sb = word_sums(b).tolist()
    return H.finish(sa, sb, b.numel())


def test_golden_digest():
    """The definition is frozen: a change of bmh1 must come with a new HASH_NAME."""
    b = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    assert H.HASH_NAME == "bmh1"
    assert H.word_sums_numpy(b.numpy()) == (561929585336, 524938286541)
    assert H.fingerprint(b) == "dedc23e825e996a53fe21ba24f53b943"


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_equals_reference(dtype):
    g = torch.Generator().manual_seed(7)
    for n in SIZES:
        t = _rand(n, dtype, g)
        assert _kernel_digest(t) == H.fingerprint(t), (dtype, n)


@interp
def test_kernel_golden_and_unaligned_views():
    b = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    assert _kernel_digest(b) == "dedc23e825e996a53fe21ba24f53b943"
    # a row block of a merged bf16 tensor with 3 columns starts 6 bytes in: not word-aligned
    merged = torch.randn(11, 3).to(torch.bfloat16)
    part = merged[1:8]
    assert part.data_ptr() % 4 != 0
    assert _kernel_digest(part) == H.fingerprint(part.clone()) == H.fingerprint(part)


@interp
def test_positions_past_2_to_32_words():
    """Word positions >= 2^32 (tensors over 16 GiB) use the high half of the position: the kernel
    and numpy agree across the region boundary, and the region changes the sums."""
    from bitmatch.kernels.triton.fingerprint import word_sums

    b = torch.randint(0, 256, (4 * 9000 + 2,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    m = (1 << 64) - 1
    for off in (0, (1 << 32) - 5000, (1 << 32) + 17):
        got = tuple(v & m for v in word_sums(b, word_offset=off).tolist())
        assert got == H.word_sums_numpy(b.numpy(), off), off
    assert H.word_sums_numpy(b.numpy(), 1 << 32) != H.word_sums_numpy(b.numpy(), 0)


def test_merged_row_block_equals_its_hf_tensor():
    """The vLLM layout relies on it: rows of qkv_proj hash like the HF q/k/v they came from."""
    q, k, v = torch.randn(8, 6).bfloat16(), torch.randn(3, 6).bfloat16(), torch.randn(5, 6).bfloat16()
    merged = torch.cat([q, k, v])
    assert [sync.fingerprint(merged[a:b]) for a, b in ((0, 8), (8, 11), (11, 16))] == \
        [sync.fingerprint(x) for x in (q, k, v)]


@pytest.mark.parametrize("piece", [4, 8, 1024, 4096 * 4])
def test_stream_pieces_equal_whole(piece):
    t = torch.randn(4099).to(torch.bfloat16)  # 8198 bytes: the last piece ends inside a word
    b = H.byte_view(t)
    h = H.StreamHasher()
    for a in range(0, b.numel(), piece):
        h.update(b[a:a + piece])
    assert h.hexdigest() == H.fingerprint(t)


def test_stream_refuses_a_piece_after_a_partial_word():
    h = H.StreamHasher()
    h.update(torch.zeros(6, dtype=torch.uint8))
    with pytest.raises(ValueError, match="last piece"):
        h.update(torch.zeros(4, dtype=torch.uint8))


def _accidents(b: np.ndarray):
    """(what, corrupted bytes) for the accidents a fingerprint must catch."""
    yield "swapped words", np.concatenate([b[4:8], b[0:4], b[8:]])
    yield "lost byte", b[1:]
    yield "lost byte, length kept", np.concatenate([b[1:], b[:1] * 0])
    yield "truncated", b[:-4]
    yield "zero word appended", np.concatenate([b, np.zeros(4, np.uint8)])
    yield "stale tensor", np.random.default_rng(1).integers(0, 256, b.size, dtype=np.uint8)
    yield "blocks reordered", np.concatenate([b[b.size // 2:], b[:b.size // 2]])


def test_accidents_change_the_digest():
    b = np.random.default_rng(0).integers(0, 256, 64, dtype=np.uint8)
    base = H.fingerprint(torch.from_numpy(b))
    for i in range(b.size * 8):  # every single-bit flip
        c = b.copy()
        c[i // 8] ^= np.uint8(1 << (i % 8))
        assert H.fingerprint(torch.from_numpy(c)) != base, f"bit {i}"
    for what, c in _accidents(b):
        assert H.fingerprint(torch.from_numpy(c.copy())) != base, what


def test_control_position_free_sum_misses_reordering():
    """Control: the same mixing without the position key cannot see swapped or reordered words:
    the accident test above can fail, and the position key is what makes it pass."""
    b = np.random.default_rng(0).integers(0, 256, 64, dtype=np.uint8)

    def plain(x):
        w = x.view("<u4").astype(np.uint32)
        return int(H._fmix32_(w.copy(), np.empty_like(w)).sum(dtype=np.uint64))

    swapped = dict(_accidents(b))["swapped words"]
    assert plain(swapped) == plain(b)
    assert H.fingerprint(torch.from_numpy(swapped.copy())) != H.fingerprint(torch.from_numpy(b))


def test_manifest_names_its_hash_and_refuses_another():
    man = sync.Manifest(3, {"w": sync.TensorSpec((2,), torch.bfloat16, "ab")})
    d = man.to_json()
    assert d["hash"] == "bmh1"
    assert sync.Manifest.from_json(d).digest() == man.digest()
    d["hash"] = "xxh3-128"
    with pytest.raises(sync.SyncError, match="hash 'xxh3-128'.*'bmh1'"):
        sync.Manifest.from_json(d)

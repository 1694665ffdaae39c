"""bmh1: the weight fingerprint hash, computed where the bytes are (GPU or CPU), same digest.

Definition (version 1). The bytes b[0..n) are read as little-endian uint32 words w_i (the last
one zero-padded), i = 0 .. ceil(n/4) - 1. With fmix32 MurmurHash3's 32-bit finalizer and all
arithmetic mod 2^32:

    s_i = lo32(i) * 0x9E3779B1 + fmix32(hi32(i) ^ 0x85EBCA6B)     position key of word i
    a_i = fmix32(w_i ^ s_i)
    b_i = fmix32((w_i + (s_i ^ 0x5BD1E995)) * 0x27D4EB2F)
    A = sum a_i mod 2^64,  B = sum b_i mod 2^64
    digest = xxh3-128(b"bmh1" + A + B + n, little-endian uint64s), 32 hex characters.

Why this shape: every word is mixed independently and the combine is an integer sum, which is
exact and associative, so any split into blocks, any grid and any reduction order give the same
A and B: a Triton kernel hashes fixed-size blocks in parallel at memory speed and the numpy
reference below gives the same digest. a_i and b_i are bijections of w_i for a fixed position,
so any single changed word changes A (by a nonzero amount < 2^32) and is always caught; two or
more changes, a shifted (lost) byte, swapped words or a stale tensor go unnoticed only if both
sums collide (about 2^-64 for accidental changes). The hash is positional over the byte
stream of the tensor alone, so a row block of a merged tensor (vLLM's qkv_proj) has the same
digest as the HF tensor it came from.

It detects accidents (a flipped or lost byte, a stale or truncated tensor), not an attacker:
anyone who can rewrite the bytes can also forge sums. Authenticity comes from the transport's
keyed MAC / TLS, not from this hash.
"""
from __future__ import annotations

import os
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash

HASH_NAME = "bmh1"
M32 = (1 << 32) - 1
_M1, _M2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)
REGION_SALT, POS_MUL, B_SALT, B_MUL = 0x85EBCA6B, 0x9E3779B1, 0x5BD1E995, 0x27D4EB2F
_CPU_CHUNK_WORDS = 1 << 20  # numpy works on 4 MiB of words at a time: ~12 MiB of temporaries per thread


def _fmix32_(h: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """fmix32 in place (numpy uint32, wrapping); ``tmp`` is scratch of h's size."""
    for shift, mul in ((16, _M1), (13, _M2)):
        np.right_shift(h, np.uint32(shift), out=tmp)
        np.bitwise_xor(h, tmp, out=h)
        np.multiply(h, mul, out=h)
    np.right_shift(h, np.uint32(16), out=tmp)
    return np.bitwise_xor(h, tmp, out=h)


def region_key(hi: int) -> int:
    """fmix32(hi32(i) ^ REGION_SALT): the position key's constant for words [hi * 2^32, ...)."""
    h = np.array([(hi & M32) ^ REGION_SALT], np.uint32)
    return int(_fmix32_(h, np.empty_like(h))[0])


def finish(sum_a: int, sum_b: int, nbytes: int) -> str:
    """The digest from the two word sums and the byte count (host side, a few bytes)."""
    m = (1 << 64) - 1
    return xxhash.xxh3_128(HASH_NAME.encode() + struct.pack("<QQQ", sum_a & m, sum_b & m, nbytes)).hexdigest()


def _chunk_sums(b: np.ndarray, pos: int, take: int, i0: int) -> tuple[int, int]:
    """(A, B) of words [pos, pos + take) of b, at stream positions i0.. (one 2^32-word region)."""
    n = b.size
    raw = b[4 * pos:min(n, 4 * (pos + take))]
    if raw.size % 4:
        raw = np.concatenate([raw, np.zeros(4 - raw.size % 4, np.uint8)])
    w = raw.view("<u4").astype(np.uint32, copy=False)
    s = np.arange(take, dtype=np.uint32)
    s += np.uint32(i0 & M32)  # no wrap: the chunk stays inside its region
    np.multiply(s, np.uint32(POS_MUL), out=s)
    s += np.uint32(region_key(i0 >> 32))
    tmp = np.empty_like(s)
    a = np.bitwise_xor(w, s)
    sa = int(_fmix32_(a, tmp).sum(dtype=np.uint64))
    s ^= np.uint32(B_SALT)
    s += w
    np.multiply(s, np.uint32(B_MUL), out=s)
    return sa, int(_fmix32_(s, tmp).sum(dtype=np.uint64))


_POOL: ThreadPoolExecutor | None = None


def word_sums_numpy(b: np.ndarray, word_offset: int = 0) -> tuple[int, int]:
    """(A, B) of a flat uint8 array whose first word sits at word position ``word_offset`` of
    the stream: the reference implementation of the definition above (in-place numpy passes over
    16 MiB chunks; large arrays on a thread per core, numpy releasing the GIL: the sums are exact,
    so the split never changes them)."""
    global _POOL
    n_words = (b.size + 3) // 4
    jobs, pos = [], 0
    while pos < n_words:
        i0 = word_offset + pos
        take = min(n_words - pos, _CPU_CHUNK_WORDS, (1 << 32) - (i0 & M32))  # one 2^32 region
        jobs.append((pos, take, i0))
        pos += take
    if len(jobs) > 1 and (os.cpu_count() or 1) > 1:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count()), thread_name_prefix="bitmatch-bmh1")
        parts = list(_POOL.map(lambda j: _chunk_sums(b, *j), jobs))
    else:
        parts = [_chunk_sums(b, *j) for j in jobs]
    m = (1 << 64) - 1
    return sum(p[0] for p in parts) & m, sum(p[1] for p in parts) & m


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor sharing its memory."""
    if not t.is_contiguous():
        raise ValueError("byte_view: tensor must be contiguous")
    return t.detach().reshape(-1).view(torch.uint8)


def _kernel():
    """The Triton kernel's launcher (triton is an optional dependency: imported on first use)."""
    try:
        from bitmatch.kernels.triton.fingerprint import word_sums
    except ImportError as e:
        raise ImportError(f"bitmatch.sync: fingerprinting GPU tensors needs Triton ({e}); "
                          "pip install bitmatch[triton]") from e
    return word_sums


def _device_sums(t: torch.Tensor) -> torch.Tensor:
    """int64 [2] (A, B as two's complement) of t's bytes, on t's device, no host sync."""
    return _kernel()(byte_view(t.contiguous()))


def use_device_kernel(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def fingerprints_of(tensors) -> list[str]:
    """bmh1 digests of the exact bytes of each tensor (own dtype, row-major), computed on each
    tensor's device: CUDA tensors by the Triton kernel with one host sync for the whole list,
    CPU tensors by numpy."""
    tensors = list(tensors)
    out: list[str | None] = [None] * len(tensors)
    pending, idx = [], []
    for j, t in enumerate(tensors):
        if use_device_kernel(t):
            pending.append(_device_sums(t))
            idx.append(j)
        else:
            out[j] = finish(*word_sums_numpy(byte_view(t.contiguous()).numpy()), t.numel() * t.element_size())
    if pending:
        sums = torch.stack(pending).cpu().tolist()  # the one host sync
        for j, (sa, sb) in zip(idx, sums):
            t = tensors[j]
            out[j] = finish(sa, sb, t.numel() * t.element_size())
    return out


def fingerprint(t: torch.Tensor) -> str:
    """bmh1 digest of the exact bytes of ``t`` (its own dtype, row-major order), on t's device."""
    return fingerprints_of([t])[0]


class StreamHasher:
    """bmh1 over bytes fed in order (the TCP sender hashes bucket pieces as they go out).
    Pieces keep their positions: feeding a tensor in any number of pieces gives its digest."""

    def __init__(self):
        self.nbytes = 0
        self._a = self._b = 0
        self._dev: list[torch.Tensor] = []
        self._ended = False  # a piece ended inside a word: it must have been the last one

    def update(self, piece: torch.Tensor) -> None:
        """Feed a flat uint8 tensor (any device); positions continue from the bytes fed so far."""
        if piece.dtype != torch.uint8 or piece.dim() != 1:
            raise ValueError("StreamHasher.update: expects a flat uint8 tensor")
        if self._ended:
            raise ValueError("StreamHasher: only the last piece may end inside a 4-byte word")
        off_words = self.nbytes // 4
        self.nbytes += piece.numel()
        if use_device_kernel(piece):
            self._dev.append(_kernel()(piece, word_offset=off_words))
        else:
            a, b = word_sums_numpy(piece.numpy(), off_words)
            self._a += a
            self._b += b
        self._ended = piece.numel() % 4 != 0  # its last word was zero-padded

    def hexdigest(self) -> str:
        a, b = self._a, self._b
        if self._dev:
            for sa, sb in torch.stack(self._dev).cpu().tolist():
                a, b = a + sa, b + sb
        return finish(a, b, self.nbytes)


"""Triton kernel of the bmh1 weight fingerprint (definition and numpy reference:
bitmatch/sync/hash.py).

Each program hashes BLOCK words of the byte stream and writes its two partial sums; the
partials are added by torch's int64 sum. Integer sums are exact and associative, so the grid,
the block size and the reduction order never change the digest (no canonical order needed).
Aligned inputs are read as int32 words (one coalesced load); a start that is not 4-byte aligned
(a row block of a merged tensor with an odd row size) is read byte by byte, same words.
"""
import torch
import triton
import triton.language as tl

from . import interpreting

BLOCK = 4096


@triton.jit
def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * tl.full(h.shape, 0x85EBCA6B, tl.uint32)
    h = h ^ (h >> 13)
    h = h * tl.full(h.shape, 0xC2B2AE35, tl.uint32)
    return h ^ (h >> 16)


@triton.jit
def _word_sums_kernel(w_ptr, b_ptr, out_ptr, n_bytes, n_full, n_words, word_offset,
                      ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    valid = offs < n_words
    if ALIGNED:
        w = tl.load(w_ptr + offs, mask=offs < n_full, other=0).to(tl.uint32, bitcast=True)
        tail = offs == n_full  # the zero-padded last word, if n_bytes % 4
        for j in tl.static_range(3):
            byte = tl.load(b_ptr + offs * 4 + j, mask=tail & (offs * 4 + j < n_bytes), other=0)
            w = w | (byte.to(tl.uint32) << (8 * j))
    else:
        w = tl.zeros((BLOCK,), dtype=tl.uint32)
        for j in tl.static_range(4):
            byte = tl.load(b_ptr + offs * 4 + j, mask=offs * 4 + j < n_bytes, other=0)
            w = w | (byte.to(tl.uint32) << (8 * j))
    i = offs + word_offset
    s = (i & 0xFFFFFFFF).to(tl.uint32) * tl.full((BLOCK,), 0x9E3779B1, tl.uint32) \
        + _fmix32((i >> 32).to(tl.uint32) ^ tl.full((BLOCK,), 0x85EBCA6B, tl.uint32))
    a = _fmix32(w ^ s)
    b = _fmix32((w + (s ^ tl.full((BLOCK,), 0x5BD1E995, tl.uint32))) * tl.full((BLOCK,), 0x27D4EB2F, tl.uint32))
    a = tl.where(valid, a, 0).to(tl.uint64)
    b = tl.where(valid, b, 0).to(tl.uint64)
    tl.store(out_ptr + pid * 2, tl.sum(a, 0).to(tl.int64, bitcast=True))
    tl.store(out_ptr + pid * 2 + 1, tl.sum(b, 0).to(tl.int64, bitcast=True))


def word_sums(b: torch.Tensor, word_offset: int = 0) -> torch.Tensor:
    """int64 [2]: the bmh1 sums (A, B) mod 2^64 of the flat uint8 tensor ``b`` whose first word
    sits at ``word_offset`` of the stream; stays on b's device (no host sync)."""
    interpreting(b)  # CPU tensors only under the interpreter
    n = b.numel()
    n_words = (n + 3) // 4
    if n_words == 0:
        return torch.zeros(2, dtype=torch.int64, device=b.device)
    n_full = n // 4
    aligned = n_full > 0 and b.data_ptr() % 4 == 0
    words = b[:4 * n_full].view(torch.int32) if aligned else b
    grid = triton.cdiv(n_words, BLOCK)
    parts = torch.empty(grid, 2, dtype=torch.int64, device=b.device)
    _word_sums_kernel[(grid,)](words, b, parts, n, n_full, n_words, word_offset,
                               ALIGNED=aligned, BLOCK=BLOCK, num_warps=8)
    return parts.sum(0)  # int64 sums wrap mod 2^64: exact in any order

"""The sending side: master weights -> compute dtype through the one cast, chunk by chunk.

``compute_cast`` is elementwise round-to-nearest-even, so casting a slice gives the same bits as
casting the whole tensor: the sender never materializes more than one chunk of the cast weights.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch

from bitmatch.kernels.order import stamp_for_device

from ..precision import compute_cast
from .fingerprint import StreamHasher, TensorSpec

DEFAULT_BUCKET_BYTES = 64 << 20


def named_weights(model) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of an nn.Module (tied parameters once), a dict, or an iterable of pairs."""
    if isinstance(model, torch.nn.Module):
        return [(k, p.detach()) for k, p in model.named_parameters()]
    if isinstance(model, Mapping):
        return [(k, v.detach()) for k, v in model.items()]
    return [(k, v.detach()) for k, v in model]


def sender_order(weights) -> dict:
    """The canonical-order stamp of the kernels the sender's weights run on (their device's backend)."""
    return stamp_for_device(weights[0][1].device if weights else "cpu")


def dtype_for(dtype, name: str) -> torch.dtype:
    """The rollout dtype of tensor ``name``: ``dtype`` itself, or its entry when ``dtype`` maps
    names to dtypes (a rollout copy that keeps the parameters read in fp32 in fp32)."""
    if not isinstance(dtype, Mapping):
        return dtype
    if name not in dtype:
        raise ValueError(f"tensor {name!r}: the per-tensor dtype map has no entry for it (the receiver holds no "
                         "such tensor?)")
    return dtype[name]


def wire_specs(weights, dtype) -> dict[str, TensorSpec]:
    """Shape and rollout dtype of each tensor (fingerprints come with the bytes); ``dtype`` is one
    dtype for all, or a {name: dtype} map."""
    out = {}
    for k, v in weights:
        if not v.is_floating_point():
            raise ValueError(f"tensor {k!r}: dtype {v.dtype} is not a floating type; cannot publish it")
        out[k] = TensorSpec(tuple(v.shape), dtype_for(dtype, k))
    return out


def cast_chunks(t: torch.Tensor, dtype: torch.dtype, chunk_bytes: int) -> Iterator[torch.Tensor]:
    """The cast tensor's bytes as flat chunks of at most ``chunk_bytes`` (on t's device)."""
    flat = t.reshape(-1)
    elsize = torch.empty((), dtype=dtype).element_size()
    step = max(4, chunk_bytes // elsize // 4 * 4)  # whole 4-byte words: the hash's unit
    if flat.numel() == 0:
        return
    for a in range(0, flat.numel(), step):
        yield compute_cast(flat[a:a + step], dtype).contiguous().view(torch.uint8)


def cast_fingerprint(t: torch.Tensor, dtype: torch.dtype, chunk_bytes: int = DEFAULT_BUCKET_BYTES) -> str:
    """Fingerprint of compute_cast(t, dtype) without materializing the whole cast tensor."""
    h = StreamHasher()
    for c in cast_chunks(t, dtype, chunk_bytes):
        h.update(c)
    return h.hexdigest()


def iter_buckets(weights, dtype, bucket_bytes: int, buf: torch.Tensor | None = None):
    """Yield (bucket uint8 tensor view, segments, finished) with segments a list of
    (name, byte_offset, nbytes) and finished {name: fingerprint} of tensors whose last byte is in
    this bucket. One bucket buffer is reused: the consumer must send it before the next step.
    Each piece is hashed where it was cast (on the sender's device), before the host copy, so
    the receiver's check also covers the copy and the wire. Tensors are split across buckets on
    whole 4-byte words only (the hash's unit). ``buf``: the bucket to fill (a shared one, any
    device); by default a CPU bucket, and large CPU tensors already in ``dtype`` are then yielded
    as views of their own memory. ``dtype``: one dtype, or a {name: dtype} map."""
    own = buf is None
    if not own:
        bucket_bytes = buf.numel()
    if bucket_bytes < 1024:
        raise ValueError(f"bucket_bytes must be at least 1024, got {bucket_bytes}")
    bucket_bytes -= bucket_bytes % 4
    if own:  # pinned when the weights live on a GPU: the device-to-host copies run at full speed
        on_gpu = any(t.device.type == "cuda" for _, t in weights)
        buf = torch.empty(bucket_bytes, dtype=torch.uint8, pin_memory=on_gpu)
    pos, segs, finished = 0, [], {}
    per_tensor = dtype
    for name, t in weights:
        dtype = dtype_for(per_tensor, name)
        h = StreamHasher()
        elsize = torch.empty((), dtype=dtype).element_size()
        align = 4 // math.gcd(4, elsize)  # elements per whole number of words
        flat = t.reshape(-1)
        nbytes, off = flat.numel() * elsize, 0
        if own and t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() and nbytes >= bucket_bytes // 4:
            # already in the rollout dtype (compute_cast is the identity): send from the tensor's
            # own memory, no bucket copy; hashed piece by piece right before it is sent
            if segs or finished:
                yield buf[:pos], segs, finished
                pos, segs, finished = 0, [], {}
            src = compute_cast(flat, dtype).view(torch.uint8)
            for a in range(0, nbytes, bucket_bytes):
                piece = src[a:a + bucket_bytes]
                h.update(piece)
                done = {name: h.hexdigest()} if a + bucket_bytes >= nbytes else {}
                yield piece, [(name, a, piece.numel())], done
            continue
        while off < nbytes:
            n_el = min((bucket_bytes - pos) // elsize, (nbytes - off) // elsize)
            if off + n_el * elsize < nbytes:
                n_el -= n_el % align  # not the tensor's end: stop on a word boundary
            if n_el == 0:  # bucket full
                yield buf[:pos], segs, finished
                pos, segs, finished = 0, [], {}
                continue
            e0 = off // elsize
            # cast (and hash) where the weights are: a GPU trainer sends bf16 bytes to the host, not fp32
            chunk = compute_cast(flat[e0:e0 + n_el], dtype).contiguous().view(torch.uint8)
            h.update(chunk)
            buf[pos:pos + chunk.numel()].copy_(chunk)
            segs.append((name, off, chunk.numel()))
            pos += chunk.numel()
            off += chunk.numel()
            del chunk
        finished[name] = h.hexdigest()
    if segs or finished:
        yield buf[:pos], segs, finished

"""The canonical orders: every switch that changes the bits of an op, in one frozen, versioned object.

Speed knobs (tile shapes, warps, stages, which blocks skip their mask) never change the bits and
live beside the kernels; what is here does, so a trainer and a rollout engine must agree on all
of it. ``bitmatch.sync`` stamps ``stamp(backend)`` into every weight manifest and the receiver
refuses a version whose stamp differs from its own: the two sides prove they run the same order
instead of assuming it.

The launchers read the *active* order, ``current()``, at every launch (never a module-level copy),
and ``override(kv_partition=256, ...)`` swaps the active order itself, so the stamp cannot report
one order while the kernels run another. ``ORDER`` is the default order; ``stamp(backend)`` is the
active order's stamp.

- reference (CPU): products on exact integer grids of ``exact_grid_bits`` bits in float64, summed
  over K in ``exact_k_chunk`` chunks added in order, sums by a fold-in-halves tree padded to a
  fixed width (``kernels/_exact.py``).
- triton (CUDA): linear's dot over K = ordered fp32 sum of ``split_for(N, K)`` fixed K chunks
  (``linear_split_table``, each chunk a multiple of ``linear_chunk_align``), each a sequential
  tensor-core accumulation; attention walks KV from position 0 in ``kv_block`` blocks with an
  online softmax inside ``kv_partition`` partitions merged in order, row sums of P on the tensor
  core when ``rowsum_mma``; RMSNorm's row sum is one tl.sum whose tree is fixed by the block and
  the warps (``norm_warps``); logprobs keep a per-lane max and sum over ``logprobs_block_v`` lanes
  on ``logprobs_warps`` warps; mHC folds a token's N*D values over ``hc_k_chunk`` chunks with its
  squares in ``hc_block_k`` lanes; block-FP8 linear sums 128-wide K groups in order, each group's
  fp8 tensor-core partial from zero in ``fp8_promote_k`` long pieces promoted to fp32 with its scales.
- both: the FP8 quantizers' scale is max(amax, ``fp8_amax_floor``) / 448 (``kernels/fp8.py``).
- both: every op family carries a version (``op_versions``, keyed by the ``kernels/`` module that
  defines the op) for what its code alone fixes (the Mamba2 scan on absolute chunks, the
  DeepSeek-V4 sink-attention and indexer kernels' block walks and tiles, rounding points): bump it
  when that code changes the bits (``tests/test_golden_bits.py`` fails until you do).
"""
from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import asdict, dataclass, field, fields, replace

import xxhash

# fields that only the Triton backend reads: the reference stamp leaves them out (a reference
# receiver accepts a sender whose kv_partition differs: neither side walks KV partitions)
_TRITON_ONLY = ("kv_block", "kv_partition", "rowsum_mma", "linear_split_table", "linear_chunk_align",
                "norm_warps", "logprobs_block_v", "logprobs_warps", "hc_k_chunk", "hc_block_k", "fp8_promote_k")
_REFERENCE_ONLY = ("reference", "exact_grid_bits", "exact_k_chunk")


@dataclass(frozen=True)
class CanonicalOrder:
    version: int = 1
    reference: str = "exact-int-grid-f64, fold-in-halves tree"
    # reference: |integer| <= 2**20 per slice, so a product is <= 2**40 and a sum of 4096 of them
    # stays below 2**53 (exact in float64); the K chunks are then added in order
    exact_grid_bits: int = 20
    exact_k_chunk: int = 4096
    kv_block: int = 64
    kv_partition: int = 512
    rowsum_mma: bool = True
    # (N, K) -> K chunks; any shape not listed: 1 (plain sequential K). Fixed per weight shape,
    # never per M, so every batch size sums the same chunks; chosen where a small-M launch has too
    # few tiles to fill the GPU (Qwen3-8B o_proj: 2 chunks of 2048, down_proj: 3 of 4096; the
    # DeepSeek-V4 routers' fp32 logits, FMA code on few tiles: mid's 64 experts x 2048, Flash's 256
    # x 4096). Changing an entry changes that shape's bits (and the stamp).
    linear_split_table: tuple = field(default=(((4096, 4096), 2), ((4096, 12288), 3), ((64, 2048), 4),
                                               ((256, 4096), 8)))
    # a K chunk's length is a multiple of this (every BK in linear's tile tables divides it); a
    # listed split that does not fit falls to the next smaller one
    linear_chunk_align: int = 256
    # RMSNorm warps by row block width (next_pow2(H)): (largest block, warps), first fit wins; the
    # warps fix tl.sum's reduction tree on the GPU
    norm_warps: tuple = field(default=((2048, 4), (8192, 8), (1 << 62, 16)))
    logprobs_block_v: int = 4096
    logprobs_warps: int = 8
    # mHC (kernels/triton/mhc.py): the mix projection and the sum of squares of a token's N*D
    # stream values run over fixed K chunks of ``hc_k_chunk`` (a multiple of ``hc_block_k``), the
    # chunk partials added in chunk order; the squares sit in ``hc_block_k`` lanes, summed in lane
    # order at the chunk's end; 256 so a decode step's few tokens still spread over many programs
    # (the V4 mid step per chunk size: benchmarks/families/deepseek_v4_decode_ops.py and its results)
    hc_k_chunk: int = 256
    hc_block_k: int = 64
    # block-FP8 W8A8 (kernels/fp8.py): a block's scale is max(amax, floor) / 448, so an all-zero block
    # has a finite scale and zero codes (vLLM's per_token_group_quant_fp8 eps); both backends
    fp8_amax_floor: float = 1e-10
    # Triton: each 128-wide K group's fp8 dot runs in pieces of this many K from a zero accumulator,
    # each promoted to fp32 as fma(piece, sx * sw, acc): Hopper's fp8 MMA accumulates with reduced
    # precision, so the promotion interval is part of the bits (128: once per scale group, DeepSeek-V3)
    fp8_promote_k: int = 128
    # one version per op family (the kernels/ module defining the op), bumped by hand when that
    # family's code changes its bits on either backend
    op_versions: tuple = field(default=(
        ("activation", 1), ("attention", 1), ("compressed_attention", 2), ("compressor", 2),
        ("fp8", 1), ("indexer", 2), ("linear", 1), ("logprobs", 1), ("mamba", 2), ("mhc", 2), ("moe", 1),
        ("norm", 1), ("rotary", 1), ("rotary_interleaved", 1), ("sampling", 1)))
    # the ops ``kernels.override`` swapped (a fault, a stock baseline, a call recorder): empty for
    # the canonical ops, stamped when not, so a stamp cannot claim the canonical order meanwhile
    overridden_ops: tuple = ()

    def __post_init__(self):
        if 2 * self.exact_grid_bits + (self.exact_k_chunk - 1).bit_length() > 53:
            raise ValueError(f"canonical order: exact_grid_bits={self.exact_grid_bits} with "
                             f"exact_k_chunk={self.exact_k_chunk} is not exact in float64 "
                             "(need 2 * bits + log2(chunk) <= 53)")
        # lookups the launchers make per call, built once per order (not fields: not stamped twice)
        object.__setattr__(self, "split_table", dict(self.linear_split_table))
        if self.hc_block_k < 16 or self.hc_block_k & (self.hc_block_k - 1) or self.hc_k_chunk % self.hc_block_k:
            raise ValueError(f"canonical order: hc_block_k={self.hc_block_k} must be a power of 2 >= 16 "
                             f"dividing hc_k_chunk={self.hc_k_chunk}")
        if self.fp8_promote_k not in (32, 64, 128):
            raise ValueError(f"canonical order: fp8_promote_k={self.fp8_promote_k} must be 32, 64 or 128 (a "
                             "piece of the 128-wide scale group, at least one fp8 MMA deep)")
        if not 0 < self.fp8_amax_floor < 1e30:
            raise ValueError(f"canonical order: fp8_amax_floor={self.fp8_amax_floor} must be positive and finite")

    @property
    def min_block_m_cuda(self) -> int:
        """Smallest CUDA query tile of attention: with register row sums (``rowsum_mma`` False)
        tiles under 64 rows sum P in the mma.sync layout's order, so every tile has >= 64 rows."""
        return 16 if self.rowsum_mma else 64

    def norm_warps_for(self, block: int) -> int:
        return next(w for b, w in self.norm_warps if block <= b)

    def op_version(self, family: str) -> int:
        return dict(self.op_versions)[family]

    def stamp(self, backend: str) -> dict:
        """What fixes the bits on ``backend`` ("reference" or "triton"), with its fingerprint."""
        if backend not in ("reference", "triton"):
            raise ValueError(f"canonical order: backend must be 'reference' or 'triton', got {backend!r}")
        skip = _TRITON_ONLY if backend == "reference" else _REFERENCE_ONLY
        if not self.overridden_ops:  # the canonical ops: the stamp (and its fingerprint) as before
            skip = skip + ("overridden_ops",)
        # JSON-shaped: tuples become lists, so a stamp read back from a manifest compares equal
        d = json.loads(json.dumps({k: v for k, v in asdict(self).items() if k not in skip}))
        d["backend"] = backend
        d["fingerprint"] = xxhash.xxh3_64(json.dumps(d, sort_keys=True).encode()).hexdigest()
        return d


ORDER = CanonicalOrder()

# The active order is process-wide, not per thread: a kernel launched from any thread (a sync
# receiver's, a data loader's) runs the order the stamp reports. Overrides nest (a stack); one
# thread at a time may hold them, so two threads can never restore each other's order.
_lock = threading.Lock()
_stack: list[CanonicalOrder] = []
_owner: int | None = None
_active = ORDER


def current() -> CanonicalOrder:
    """The order every launcher reads at launch: ``ORDER`` unless an ``override`` is active."""
    return _active


def stamp(backend: str) -> dict:
    """The active order's stamp for ``backend``."""
    return _active.stamp(backend)


@contextlib.contextmanager
def override(order: CanonicalOrder | None = None, **changes):
    """Run the block under another canonical order: ``order`` (a ``CanonicalOrder``) or the active
    one with ``changes`` (its field names, e.g. ``kv_partition=256``). Every kernel launched inside
    and ``stamp()`` follow it; the previous order is back on exit, exception or not. Nests; only
    one thread at a time may hold overrides (another raises instead of racing the restore)."""
    global _owner, _active
    valid = {f.name for f in fields(CanonicalOrder)}
    unknown = sorted(set(changes) - valid)
    if unknown:
        raise TypeError(f"order.override: unknown field(s) {unknown}; fields: {sorted(valid)}")
    me = threading.get_ident()
    with _lock:
        if _owner is not None and _owner != me:
            raise RuntimeError("order.override: another thread holds an order override; the active "
                               "order is process-wide, so overrides from two threads cannot nest")
        new = replace(order if order is not None else _active, **changes)
        if order is not None and "overridden_ops" not in changes:  # an explicit order cannot unmark an op override
            new = replace(new, overridden_ops=_active.overridden_ops)
        _stack.append(_active)
        _owner, _active = me, new
    try:
        yield new
    finally:
        with _lock:
            _active = _stack.pop()
            if not _stack:
                _owner = None


def stamp_for_device(device) -> dict:
    """The active order's stamp of the backend tensors on ``device`` run on (CUDA: triton, CPU:
    reference)."""
    import torch

    return stamp("triton" if torch.device(device).type == "cuda" else "reference")

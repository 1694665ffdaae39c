"""The canonical orders: every switch that changes the bits of an op, in one frozen, versioned object.

Speed knobs (tile shapes, warps, stages, which blocks skip their mask) never change the bits and
live beside the kernels; what is here does, so a trainer and a rollout engine must agree on all
of it. ``bitmatch.sync`` stamps ``stamp(backend)`` into every weight manifest and the receiver
refuses a version whose stamp differs from its own: the two sides prove they run the same order
instead of assuming it.

- reference (CPU): products on exact integer grids in float64, sums by a fold-in-halves tree
  padded to a fixed width (``kernels/_exact.py``); no tunable switch, hence only a version.
- triton (CUDA): linear's dot over K = ordered fp32 sum of ``split_for(N, K)`` fixed K chunks
  (``linear_split_table``), each a sequential tensor-core accumulation; attention walks KV from
  position 0 in ``kv_block`` blocks with an online softmax inside ``kv_partition`` partitions
  merged in order, row sums of P on the tensor core when ``rowsum_mma``. The state recurrences and
  the DeepSeek-V4 ops have no switch either, only a named version each (``recurrent_ops``): the
  Mamba2 scan on absolute chunks with fp32 boundary states and the open chunk replayed per token
  (``kernels/mamba.py``), the sink attention / compressor / indexer compositions on linear's order.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import xxhash


@dataclass(frozen=True)
class CanonicalOrder:
    version: int = 1
    reference: str = "exact-int-grid-f64, fold-in-halves tree"
    kv_block: int = 64
    kv_partition: int = 512
    rowsum_mma: bool = True
    # (N, K) -> K chunks; any shape not listed: 1 (plain sequential K). From the H200 sweep of
    # benchmarks/gpu_ops.py --sweep (Qwen3-8B o_proj 2 x 2048, down_proj 3 x 4096).
    linear_split_table: tuple = field(default=(((4096, 4096), 2), ((4096, 12288), 3)))
    # versions of the ops whose order is fixed by their code alone (bump one when its order changes)
    recurrent_ops: tuple = field(default=(("mamba2_scan", 1), ("causal_conv1d", 1), ("dsv4_attention", 1)))

    def stamp(self, backend: str) -> dict:
        """What fixes the bits on ``backend`` ("reference" or "triton"), with its fingerprint."""
        if backend == "reference":
            d = {"version": self.version, "backend": backend, "reference": self.reference}
        elif backend == "triton":
            d = {k: v for k, v in asdict(self).items() if k != "reference"}
            d["backend"] = backend
            d["linear_split_table"] = [[list(nk), s] for nk, s in self.linear_split_table]
            d["recurrent_ops"] = [list(kv) for kv in self.recurrent_ops]
        else:
            raise ValueError(f"canonical order: backend must be 'reference' or 'triton', got {backend!r}")
        d["fingerprint"] = xxhash.xxh3_64(json.dumps(d, sort_keys=True).encode()).hexdigest()
        return d


ORDER = CanonicalOrder()


def stamp_for_device(device) -> dict:
    """The stamp of the backend tensors on ``device`` run on (CUDA: triton, CPU: reference)."""
    import torch

    return ORDER.stamp("triton" if torch.device(device).type == "cuda" else "reference")

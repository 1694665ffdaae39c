"""CUDA graphs for pure-decode steps: one graph per padded batch bucket (vLLM's model).

Each bucket's graph runs ``forward_hidden`` on persistent input buffers (token ids, positions,
slot mapping, state slots: one int64 [4, max_bucket] buffer; seq_lens and the block table: int32),
captured with the host bounds ``max_query_len = 1`` and ``max_seq_len`` = a context bucket (512,
1024, 2048, ... up to ``max_seq_len_to_capture``): its attention launch covers every context up to
that bound (the partitions past a row's context are empty and skipped by the merge: the same
bits), and a step replays the graph of the smallest context bucket holding its longest context, so
the launch does not pay for partitions far past the real contexts. A step copies its padded inputs into
the buffers (two pinned uploads, three device copies) and replays. Padded rows decode token 0 in
the runner's scratch block, so they touch no real sequence; the kernels are batch-invariant, so a
real row's bits do not depend on the bucket (tests/test_engine_graphs.py).

Graphs hold the parameters' device addresses: the key of the captured set is every parameter's
``data_ptr``; a replaced parameter (a new tensor) drops every graph (recaptured on next use), an
in-place update (``copy_``, an optimizer step) is read by the next replay as is. Derived weights a
family caches (dense's fused q/k/v, gate/up) are refreshed in place before each replay through the
family's ``refresh_derived_weights(lm)``.
"""
from __future__ import annotations

import numpy as np
import torch

from bitmatch.engine.model_runner import upload


def graph_safe(model) -> bool:
    """Whether the model's family declares its decode forward capturable (no host syncs, no
    data-dependent host control flow): ``Family.cuda_graph_safe(lm)``; False when absent."""
    from bitmatch.models import family_of, unwrap_causal_lm
    fam = family_of(model)
    fn = getattr(fam, "cuda_graph_safe", None)
    return bool(fn(unwrap_causal_lm(model))) if callable(fn) else False


def context_buckets(cap_len: int, block_size: int) -> list[int]:
    """The context bounds decode graphs are captured for: 512 x 2**k below ``cap_len``, then
    ``cap_len`` itself (every bound a whole number of blocks)."""
    out, c = [], 512
    while c < cap_len:
        out.append(-(-c // block_size) * block_size)
        c *= 2
    return sorted(set(out) | {cap_len})


class DecodeGraphs:
    def __init__(self, runner, max_seq_len_to_capture: int):
        from bitmatch.models import family_of, unwrap_causal_lm
        bs = runner.block_size
        self.runner = runner
        self.width = max(1, -(-int(max_seq_len_to_capture) // bs))
        self.cap_len = self.width * bs
        self.ctx_buckets = context_buckets(self.cap_len, bs)
        self.lm = unwrap_causal_lm(runner.model)
        self.family = family_of(runner.model)
        self.graphs: dict[tuple[int, int], tuple] = {}   # (batch bucket, context bucket) -> (graph, out)
        self.key = None
        self.pool = None
        self.num_captures = 0
        self.num_replays = 0
        self.last_key = None
        self._buffers = None

    def _alloc(self):
        dev, n = self.runner.device, self.runner.buckets[-1]
        i64 = torch.zeros((4, n), dtype=torch.int64, device=dev)     # ids, positions, slots, state slots
        sl = torch.ones(n, dtype=torch.int32, device=dev)
        bt = torch.full((n, self.width), self.runner.scratch_block, dtype=torch.int32, device=dev)
        qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self._buffers = (i64, sl, bt, qsl)

    def _param_key(self):
        return tuple(p.data_ptr() for p in self.runner.model.parameters())

    def _ctx(self, b, cap):
        from bitmatch.context import ForwardContext
        i64, sl, bt, qsl = self._buffers
        return ForwardContext(positions=i64[1, :b], slot_mapping=i64[2, :b], state_slots=i64[3, :b],
                              query_start_loc=qsl[:b + 1], seq_lens=sl[:b], block_table=bt[:b],
                              caches=self.runner.caches, max_query_len=1, max_seq_len=cap)

    def _capture(self, b, cap):
        from bitmatch.models import forward_hidden
        model, ctx, ids = self.runner.model, self._ctx(b, cap), self._buffers[0][0, :b]
        # warm-up (Triton compiles, rope table, fused weights) on a side stream, as torch asks;
        # it computes this very step (the same bits the replay writes again)
        s = torch.cuda.Stream(device=self.runner.device)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            forward_hidden(model, ids, ctx)
        torch.cuda.current_stream().wait_stream(s)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = forward_hidden(model, ids, ctx)
        self.num_captures += 1
        return g, out

    def run(self, inp, bucket: int):
        """Replay the bucket's graph on the padded step inputs ``inp``; the hidden states
        [bucket, H] (graph-owned: read before the next replay), or None when the step exceeds
        what the graphs were captured for (the caller runs it eagerly)."""
        if inp.max_seq_len > self.cap_len or inp.block_table.shape[1] > self.width:
            return None
        if self._buffers is None:
            self._alloc()
        key = self._param_key()
        if key != self.key:  # a parameter was replaced: its old address is baked into the graphs
            self.graphs.clear()
            self.key = key
        refresh = getattr(self.family, "refresh_derived_weights", None)
        if refresh is not None:
            refresh(self.lm)
        i64, sl, bt, qsl = self._buffers
        b, w = bucket, inp.block_table.shape[1]
        dev = self.runner.device
        a = upload(np.concatenate([inp.ids, inp.positions, inp.slots, inp.state_slots]), dev)
        c = upload(np.concatenate([inp.seq_lens, inp.block_table.reshape(-1)]).astype(np.int32), dev)
        i64[:, :b].copy_(a.view(4, b))
        sl[:b].copy_(c[:b])
        bt[:b, :w].copy_(c[b:].view(b, w))
        cap = next(c for c in self.ctx_buckets if c >= inp.max_seq_len)
        entry = self.graphs.get((b, cap))
        if entry is None:
            entry = self.graphs[(b, cap)] = self._capture(b, cap)
        entry[0].replay()
        self.num_replays += 1
        self.last_key = (b, cap)
        return entry[1]

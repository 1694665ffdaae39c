"""CUDA graphs for pure-decode steps (vLLM's model): one graph per (padded batch bucket, context
bucket, sampler flags, recorded), each holding the whole step: forward, LM head and the sampler.

Each graph runs ``forward_hidden``, ``compute_logits`` and ``Sampler.device_step`` on persistent
input buffers (token ids, positions, slot mapping, state slots and the sampler's int64 rows: one
int64 [8, max_bucket] buffer; seq_lens and the block table: int32; temperature and top_p: fp32),
captured with the host bounds ``max_query_len = 1`` and ``max_seq_len`` = a context bucket (512,
1024, 2048, ... up to ``max_seq_len_to_capture``): its attention launch covers every context up to
that bound (the partitions past a row's context are empty and skipped by the merge: the same
bits), and a step replays the graph of the smallest context bucket holding its longest context, so
the launch does not pay for partitions far past the real contexts. The sampler's three host flags
(any row masked, all greedy, any greedy) pick the graph too. A step copies its padded inputs into
the buffers (two pinned uploads, four device copies), replays, and reads back one float64
[3, bucket] tensor: the step's one host sync. Padded rows decode token 0 in the runner's scratch
block and sample with harmless parameters, so they touch no real sequence; every kernel and the
sampler are batch-invariant, so a real row's bits do not depend on the bucket
(tests/test_engine_graphs.py; Qwen3-MoE, whose padded rows also take expert slots:
tests/test_engine_graphs_moe.py). Which families are captured: ``graph_safe``. A capture runs its
step once outside the graph (the warm-up) and the replay runs it again: the warm-up writes its KV
and per-sequence state (Mamba conv and SSM state) into the scratch block and slot only
(``warm_up_on_scratch``). While a recorder is attached (``Engine.record``), a step replays the
recording graph of its key: the same step plus a device copy of each op output (``recording.GraphTap``),
handed to the recorder after the replay.

Graphs hold the parameters' device addresses: the key of the captured set is every parameter's
``data_ptr``; a replaced parameter (a new tensor) drops every graph (recaptured on next use), an
in-place update (``copy_``, an optimizer step) is read by the next replay as is. Derived weights a
family caches (dense's fused q/k/v, gate/up; LoRA layers' merged weights) are refreshed in place
through ``Family.refresh_derived_weights(lm)`` (a no-op by default). Both checks run when
``runner.weights_changed`` is set: the engine sets it whenever it starts work after being idle
(weights change between generate calls: while requests run the engine refuses a weight switch), so a
replay pays neither the walk over every parameter (~1.7 ms on 8B) nor the per-layer version checks.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from bitmatch.context import ForwardContext
from bitmatch.engine.host import upload
from bitmatch.engine.recording import GraphTap
from bitmatch.models import compute_logits, family_of, forward_hidden, fp8_mode, unwrap_causal_lm


def graph_safe(model, quantization: str | None = None) -> bool:
    """Whether the model's family declares its decode forward capturable (no host syncs, no
    data-dependent host control flow): ``Family.cuda_graph_safe(lm)`` (default False), and in
    ``quantization`` "fp8" whether FP8 mode's forward is (``fp8_mode.capturable``: not its experts)."""
    lm = unwrap_causal_lm(model)
    return bool(family_of(model).cuda_graph_safe(lm)) and (quantization is None or fp8_mode.capturable(lm))


def padded_sampling(sampler, params, seeds, indices, bucket: int):
    """(flags, float32 [2, bucket], int64 [4, bucket]): the sampler's packed rows of the real
    requests, then padded rows that sample greedily (all-greedy steps) or at T = 1 unmasked, so
    the padding never changes the step's flags (their outputs are dropped)."""
    flags = sampler.flags(params)
    f32, i64 = sampler.pack_host(params, seeds, indices)
    pad = bucket - len(params)
    f32 = np.concatenate([f32, np.ones((2, pad), np.float32)], 1)
    i64 = np.concatenate([i64, np.array([[0], [0], [-1], [int(flags[1])]], np.int64).repeat(pad, 1)], 1)
    return flags, f32, i64


def context_buckets(cap_len: int, block_size: int) -> list[int]:
    """The context bounds decode graphs are captured for: 512 x 2**k below ``cap_len``, then
    ``cap_len`` itself (every bound a whole number of blocks)."""
    out, c = [], 512
    while c < cap_len:
        out.append(-(-c // block_size) * block_size)
        c *= 2
    return sorted(set(out) | {cap_len})


def decode_step(runner, ids, ctx, f32, i64, flags, tap: GraphTap | None = None) -> torch.Tensor:
    """The work a decode graph holds: forward, LM head (every row samples), sampler; float64
    [3, rows] (tokens, logprobs, sampled logprobs). ``tap``: copies of every op output and of the
    logits (``lm_head``), beside the same ops."""
    logits = compute_logits(runner.model, forward_hidden(runner.model, ids, ctx, recorder=tap), kept=True)
    if tap is not None:
        tap("lm_head", logits)
    return runner.sampler.device_step(logits, f32, i64, *flags)


def warm_up_on_scratch(runner, slot_mapping: torch.Tensor, state_slots: torch.Tensor, step):
    """step() once (a graph's warm-up: compiles, first allocations) with every row's KV writes and
    per-sequence state on the runner's scratch block and slot, then the rows' slots put back. The
    replay runs this very step again: a KV write of the same values twice is harmless, but a Mamba
    layer's conv and SSM state advance in place, so a warm-up on the real slots would make the
    replay read its own update (every later token of those sequences differing from the trainer's:
    the engine's Nemotron-H Diff on the GPU). The warm-up's outputs are discarded; it costs no
    memory (a copy of the state rows would, at large buckets)."""
    saved = slot_mapping.clone(), state_slots.clone()
    slot_mapping.fill_(runner.scratch_block * runner.block_size)
    if runner.scratch_slot >= 0:
        state_slots.fill_(runner.scratch_slot)
    try:
        return step()
    finally:
        slot_mapping.copy_(saved[0])
        state_slots.copy_(saved[1])


_CAPTURE_STREAMS: dict = {}


def capture_stream(device) -> "torch.cuda.Stream":
    """One side stream per device for every capture's warm-up: a new stream per capture would take
    streams from torch's pool in turn, and a library workspace kept per stream (cuBLAS's) with each,
    memory no engine's close() gives back."""
    dev = torch.device(device)
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    s = _CAPTURE_STREAMS.get(idx)
    if s is None:
        s = _CAPTURE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return s


class DecodeGraphs:
    def __init__(self, runner, max_seq_len_to_capture: int):
        bs = runner.block_size
        # weakly: the runner holds this object, so a strong reference back would make a cycle, and an
        # engine dropped without close() would keep its KV cache and graph pool until the cycle collector
        self.runner = weakref.proxy(runner)
        self.width = max(1, -(-int(max_seq_len_to_capture) // bs))
        self.cap_len = self.width * bs
        self.ctx_buckets = context_buckets(self.cap_len, bs)
        self.lm = unwrap_causal_lm(runner.model)
        self.family = family_of(runner.model)
        # (batch bucket, context bucket, sampler flags, recorded) -> (graph, output, GraphTap or None)
        self.graphs: dict[tuple, tuple] = {}
        self.key = None
        self.pool = None
        self.num_captures = 0
        self.num_replays = 0
        self.last_key = None
        self._buffers = None

    def close(self) -> None:
        """Drop every graph, its outputs, the private memory pool and the input buffers."""
        self.graphs.clear()
        self.pool = None
        self._buffers = None
        self.key = self.last_key = None

    def drop_recording(self) -> None:
        """Drop the recording graphs (and the op outputs they hold) once no recorder is attached."""
        for key in [k for k in self.graphs if k[3]]:
            del self.graphs[key]

    def _alloc(self):
        dev, n = self.runner.device, self.runner.buckets[-1]
        # ids, positions, slots, state slots; then the sampler's int64 rows (seed, index, top_k, greedy)
        i64 = torch.zeros((8, n), dtype=torch.int64, device=dev)
        sl = torch.ones(n, dtype=torch.int32, device=dev)
        bt = torch.full((n, self.width), self.runner.scratch_block, dtype=torch.int32, device=dev)
        qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
        f32 = torch.ones((2, n), dtype=torch.float32, device=dev)    # the sampler's temperature, top_p
        self._buffers = (i64, sl, bt, qsl, f32)

    def _param_key(self):
        return tuple(p.data_ptr() for p in self.runner.model.parameters())

    def _ctx(self, b, cap):
        i64, sl, bt, qsl, _ = self._buffers
        return ForwardContext(positions=i64[1, :b], slot_mapping=i64[2, :b], state_slots=i64[3, :b],
                              query_start_loc=qsl[:b + 1], seq_lens=sl[:b], block_table=bt[:b],
                              caches=self.runner.caches, max_query_len=1, max_seq_len=cap,
                              quantization=self.runner.quantization)

    def _step(self, b, cap, flags, tap=None):
        i64, _, _, _, f32 = self._buffers
        return decode_step(self.runner, i64[0, :b], self._ctx(b, cap), f32[:, :b], i64[4:, :b], flags, tap)

    def _capture(self, b, cap, flags, recorded: bool):
        # warm-up (Triton compiles, rope table, fused weights) on a side stream, as torch asks;
        # it runs this very step, which the replay then runs again: on the scratch block and slot
        s = capture_stream(self.runner.device)
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            i64 = self._buffers[0]
            warm_up_on_scratch(self.runner, i64[2, :b], i64[3, :b],
                               lambda: self._step(b, cap, flags, GraphTap() if recorded else None))
        torch.cuda.current_stream().wait_stream(s)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        tap = GraphTap() if recorded else None
        with torch.cuda.graph(g, pool=self.pool):
            out = self._step(b, cap, flags, tap)
        self.num_captures += 1
        return g, out, tap

    def run(self, inp, bucket: int, params, seeds, indices, on_replay=None):
        """Replay the graph of (bucket, context bucket, sampler flags) on the padded step inputs
        ``inp`` and the real rows' sampling parameters; the sampler's float64 [3, bucket] output
        (graph-owned: read before the next replay; padded rows' columns are garbage), or None
        when the step exceeds what the graphs were captured for (the caller runs it eagerly).
        ``on_replay(ctx, outputs)``: replay the recording graph of the key instead and hand it the
        graph's ForwardContext and its op outputs [(name, tensors)] (graph-owned) after the replay."""
        if inp.max_seq_len > self.cap_len or inp.block_table.shape[1] > self.width:
            return None
        if self._buffers is None:
            self._alloc()
        if self.runner.weights_changed:
            key = self._param_key()
            if key != self.key:  # a parameter was replaced: its old address is baked into the graphs
                self.graphs.clear()
                self.key = key
            self.family.refresh_derived_weights(self.lm)
            self.runner.weights_changed = False
        flags, sf32, si64 = padded_sampling(self.runner.sampler, params, seeds, indices, bucket)
        i64, sl, bt, qsl, f32 = self._buffers
        b, w = bucket, inp.block_table.shape[1]
        dev = self.runner.device
        # two uploads: every int64 row, then int32 (seq lens, block table, the fp32 rows' bits)
        a = upload(np.concatenate([inp.ids, inp.positions, inp.slots, inp.state_slots, si64.reshape(-1)]), dev)
        c = upload(np.concatenate([inp.seq_lens.astype(np.int32), inp.block_table.reshape(-1).astype(np.int32),
                                   sf32.reshape(-1).view(np.int32)]), dev)
        i64[:, :b].copy_(a.view(8, b))
        sl[:b].copy_(c[:b])
        bt[:b, :w].copy_(c[b:b + b * w].view(b, w))
        f32[:, :b].copy_(c[b + b * w:].view(torch.float32).view(2, b))
        cap = next(c for c in self.ctx_buckets if c >= inp.max_seq_len)
        recorded = on_replay is not None
        gkey = (b, cap, flags, recorded)
        entry = self.graphs.get(gkey)
        if entry is None:
            entry = self.graphs[gkey] = self._capture(b, cap, flags, recorded)
        entry[0].replay()
        self.num_replays += 1
        self.last_key = gkey
        if recorded:
            on_replay(self._ctx(b, cap), entry[2].outputs)
        return entry[1]

"""Runs one scheduled step: builds the paged ForwardContext, runs the model, samples.

The model path is M's ``bitmatch.models.forward_hidden`` / ``compute_logits`` on the HF
module's own parameters (read at every step, so a weight update is seen at once). In paged
mode each attention layer writes the step's K/V at ``slot_mapping`` and calls
``kernels.attention_paged`` (or, for a step of fresh prefills, ``attention_prefill`` on the
step's own K/V: same bits), so the bits of a token's logits do not depend on how its prefix was
scheduled.

Step inputs are built on the host with numpy (no per-token Python loop) into two packed arrays
and uploaded in one pinned, non-blocking copy each; the step's host metadata (longest query and
context) rides in the ForwardContext, so the forward reads nothing back: the sampled tokens'
transfer is the step's one host sync.

Pure-decode steps on CUDA replay a CUDA graph (``graphs.DecodeGraphs``): one per padded batch
bucket, persistent input buffers, padded rows pointed at a scratch KV block. The kernels are
batch-invariant, so a real row's bits do not depend on its bucket or on the padding
(tests/test_engine_graphs.py; ``simulate_buckets`` runs the same padded inputs eagerly on CPU).

``recorders`` (``Engine.record``; ``bitmatch.engine.recording``) observe every step on the path it
takes unrecorded: eager steps through the forward's ``recorder``, graph steps through the
recording graph of their key.
"""
from __future__ import annotations

import numpy as np
import torch

from bitmatch.context import ForwardContext
from bitmatch.engine.config import EngineConfig, positive_int
from bitmatch.engine.graphs import (
    DecodeGraphs,
    context_buckets,
    decode_step,
    graph_safe,
    padded_sampling,
    warm_up_on_scratch,
)
from bitmatch.engine.host import upload
from bitmatch.engine.recording import GraphTap, StepView, begin, emit, step_rows
from bitmatch.engine.sampling import Sampler, SamplingParams
from bitmatch.engine.sequence import Sequence
from bitmatch.models import allocate_caches, cache_groups, compute_logits, forward_hidden

_DEFAULT_CPU_KV_BYTES = 512 << 20  # the KV budget on CPU, where no profile run sizes it


def bytes_per_block(groups, block_size: int) -> int:
    """Cache bytes one block of ``block_size`` tokens costs over all of the model's cache groups."""
    return sum(g.bytes_per_block(block_size) for g in groups)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM-style padded batch buckets: 1, 2, 4, 8, 16, 24, 32, ... up to max_num_seqs (included)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs] + list(range(16, max_num_seqs + 1, 8))
    return sorted(set(sizes) | {max_num_seqs})


@torch.no_grad()
def kv_budget(total: int, utilization: float, other: int, base: int, in_use: int, peak: int, share: str) -> int:
    """The KV cache's bytes from a profile run's figures. share "device" (vLLM's rule): the
    device's memory x utilization, minus what is in use (weights, everything else of this process,
    other processes) and the activation peak. share "engine" (TRL's colocate rule,
    ``GRPOConfig.vllm_gpu_memory_utilization``): the fraction is the engine's own, beside a
    trainer in the same process: minus only what the engine adds (the activation peak and the
    derived weights its step created, ``in_use - base``)."""
    if share == "engine":
        kv = int(total * utilization) - peak - (in_use - base)
    elif share == "device":
        kv = int(total * utilization) - other - in_use - peak
    else:
        raise ValueError(f"Engine: memory_share must be 'device' or 'engine', got {share!r}")
    return max(0, kv)


def profile_kv_budget(model, groups, block_size: int, max_tokens: int, max_seqs: int, utilization: float,
                      share: str = "device", quantization: str | None = None) -> dict:
    """Bytes left for the KV cache on the model's CUDA device (vLLM's profile run, ``kv_budget``):
    the activation peak is that of one step of ``max_tokens`` fresh-prefill tokens whose
    ``max_seqs`` rows are sampled (logits, the sampler's [rows, V] int64 weights). Derived weights
    created by the step (fused projections, kept casts of parameters held in another dtype) stay
    allocated and are counted as in use."""
    dev = next(model.parameters()).device
    torch.cuda.synchronize(dev)
    free, total = torch.cuda.mem_get_info(dev)
    other = (total - free) - torch.cuda.memory_reserved(dev)    # other processes, CUDA context
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    nb = -(-max_tokens // block_size) + 1
    has_state = any(g.kind == "per_seq" for g in groups)
    caches = allocate_caches(groups, nb, block_size, dev, num_seqs=1 if has_state else 0)
    cache_bytes = torch.cuda.memory_allocated(dev) - base
    T, S = max_tokens, min(max_seqs, max_tokens)
    pos = np.arange(T, dtype=np.int64)
    inp = StepInputs.__new__(StepInputs)
    inp.B, inp.T = 1, T
    inp.ids, inp.positions, inp.slots = np.zeros(T, np.int64), pos, pos.copy()
    inp.qsl, inp.seq_lens = np.array([0, T], np.int64), np.array([T], np.int64)
    inp.block_table = np.arange(nb, dtype=np.int64)[None]
    inp.state_slots = np.zeros(1, np.int64)
    inp.sample_rows = np.zeros(0, np.int64)
    inp.max_query_len = inp.max_seq_len = T
    inp.fresh_prefill = True
    ids, ctx, _ = inp.context(dev, caches, quantization)
    hidden = forward_hidden(model, ids, ctx)
    # kept=True: the head's kept cast (fp32 masters) is made here and counted as in use
    logits = compute_logits(model, hidden[torch.arange(S, device=dev) % T], kept=True)
    Sampler()(logits, [SamplingParams()] * S, list(range(S)), [0] * S)
    del hidden, logits, ctx, ids, caches
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base - cache_bytes
    in_use = torch.cuda.memory_allocated(dev)
    return {"total_bytes": total, "utilization": utilization, "share": share, "other_processes_bytes": other,
            "in_use_bytes": in_use, "activation_peak_bytes": peak,
            "kv_cache_bytes": kv_budget(total, utilization, other, base, in_use, peak, share)}



def kv_cache_blocks(model, groups, cfg: EngineConfig, max_model_len: int | None,
                    quantization: str | None = None) -> tuple[int, dict | None]:
    """(number of KV blocks, the profile run's figures or None) for ``cfg``: its ``num_gpu_blocks``, else
    ``kv_cache_bytes`` (default: on CUDA ``profile_kv_budget``'s, 512 MiB on CPU) less the per-sequence
    state of ``max_num_seqs`` sequences, in blocks; a model with no paged state gets enough blocks for
    ``max_num_seqs`` sequences of ``max_model_len`` (32768 when unknown)."""
    block_size, max_num_seqs, num_gpu_blocks = cfg.block_size, cfg.max_num_seqs, cfg.num_gpu_blocks
    per_block = bytes_per_block(groups, block_size)
    state_bytes = max_num_seqs * sum(g.bytes_per_seq() for g in groups)
    profile = None
    if num_gpu_blocks is None:
        kv_cache_bytes = cfg.kv_cache_bytes
        if kv_cache_bytes is None:
            kv_cache_bytes = _DEFAULT_CPU_KV_BYTES
            if next(model.parameters()).device.type == "cuda":
                profile = profile_kv_budget(model, groups, block_size, cfg.max_num_batched_tokens, max_num_seqs,
                                            float(cfg.gpu_memory_utilization), cfg.memory_share, quantization)
                kv_cache_bytes = profile["kv_cache_bytes"]
                if kv_cache_bytes < per_block + state_bytes:
                    trl = (" (under TRL's attach: GRPOConfig(vllm_gpu_memory_utilization=...))"
                           if cfg.memory_share == "engine" else "")
                    raise ValueError(f"Engine: no memory left for the KV cache at gpu_memory_utilization="
                                     f"{cfg.gpu_memory_utilization} ({profile}); raise it{trl}, or lower "
                                     "max_num_batched_tokens / max_num_seqs")
        positive_int("kv_cache_bytes", kv_cache_bytes)
        if per_block == 0:  # no paged state at all: blocks only bound the sequence lengths
            num_gpu_blocks = max_num_seqs * -(-(max_model_len or 32768) // block_size)
        else:
            num_gpu_blocks = (kv_cache_bytes - state_bytes) // per_block
        if num_gpu_blocks < 1:
            raise ValueError(f"Engine: kv_cache_bytes={kv_cache_bytes} is less than one KV block "
                             f"({per_block} bytes at block_size={block_size}) after the per-sequence "
                             f"state of max_num_seqs={max_num_seqs} sequences ({state_bytes} bytes)")
    return num_gpu_blocks, profile


class StepInputs:
    """Host arrays of one step (numpy), built without a per-token loop."""

    def __init__(self, scheduled: list[tuple[Sequence, int]], block_size: int):
        B = len(scheduled)
        seqs = [s for s, _ in scheduled]
        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, B)
        ns = np.fromiter((n for _, n in scheduled), np.int64, B)
        ends = starts + ns
        lens = np.fromiter((len(s) for s in seqs), np.int64, B)
        qsl = np.zeros(B + 1, np.int64)
        np.cumsum(ns, out=qsl[1:])
        T = int(qsl[-1])
        width = max(len(s.block_table) for s in seqs)
        bt = np.zeros((B, max(width, 1)), np.int64)
        for i, s in enumerate(seqs):  # per sequence, not per token
            bt[i, :len(s.block_table)] = s.block_table
        tok_seq = np.repeat(np.arange(B), ns)
        positions = np.arange(T, dtype=np.int64) + np.repeat(starts - qsl[:-1], ns)
        if all(n == 1 for _, n in scheduled):
            ids = np.fromiter((s.token_ids[a] for s, a in zip(seqs, starts.tolist())), np.int64, B)
        else:
            ids = np.concatenate([np.asarray(s.token_ids[a:a + n], np.int64)
                                  for (s, n), a in zip(scheduled, starts.tolist())])
        self.B, self.T = B, T
        self.ids, self.positions, self.qsl, self.seq_lens, self.block_table = ids, positions, qsl, ends, bt
        self.slots = bt[tok_seq, positions // block_size] * block_size + positions % block_size
        self.state_slots = np.fromiter((s.state_slot for s in seqs), np.int64, B)
        self.sample_mask = ends == lens          # prefill done or decode: the last row samples
        self.sample_rows = qsl[1:][self.sample_mask] - 1
        self.max_query_len = int(ns.max())
        self.max_seq_len = int(ends.max())
        self.fresh_prefill = bool((starts == 0).all())
        self.pure_decode = bool((ns == 1).all() and self.sample_mask.all())

    def context(self, device, caches, quantization: str | None = None) -> tuple[torch.Tensor, ForwardContext,
                                                                                torch.Tensor]:
        """(input_ids, ForwardContext, sample_rows) on ``device``: two uploads (int64, int32)."""
        B, T = self.B, self.T
        i64 = np.concatenate([self.ids, self.positions, self.slots, self.state_slots, self.sample_rows])
        i32 = np.concatenate([self.qsl, self.seq_lens, self.block_table.reshape(-1)]).astype(np.int32)
        a, b = upload(i64, device), upload(i32, device)
        S = self.sample_rows.shape[0]
        ctx = ForwardContext(positions=a[T:2 * T], slot_mapping=a[2 * T:3 * T], state_slots=a[3 * T:3 * T + B],
                             query_start_loc=b[:B + 1], seq_lens=b[B + 1:2 * B + 1],
                             block_table=b[2 * B + 1:].view(B, -1), caches=caches,
                             max_query_len=self.max_query_len, max_seq_len=self.max_seq_len,
                             fresh_prefill=self.fresh_prefill, quantization=quantization)
        return a[:T], ctx, a[3 * T + B:3 * T + B + S]


class ModelRunner:
    """Allocates the caches (plus one scratch KV block and state slot for padded graph rows),
    prepares each step's inputs and runs it, eagerly or by graph replay.

    enforce_eager: never use CUDA graphs (vLLM's flag). max_seq_len_to_capture: longest context a
    graph serves (its attention is captured for that bound); longer decode steps run eagerly.
    simulate_buckets: run pure-decode steps eagerly on the padded bucket inputs a graph would get
    (CPU tests of the padding, where graphs do not exist), for a model whose family opts into the
    graphs (``graph_safe``: the others run eagerly on the GPU too); ``num_simulated_steps`` counts them.
    """

    def __init__(self, model: torch.nn.Module, block_size: int, num_blocks: int, num_state_slots: int = 0, *,
                 max_num_seqs: int | None = None, enforce_eager: bool = False, max_seq_len_to_capture: int = 8192,
                 simulate_buckets: bool = False, quantization: str | None = None):
        self.model = model
        self.quantization = quantization  # every step's ForwardContext carries it (fp8_mode)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = next(model.parameters()).device
        # the family says which caches it needs; the engine never names an architecture
        self.cache_groups = cache_groups(model)
        has_state = any(g.kind == "per_seq" for g in self.cache_groups)
        # the last block / slot is scratch: padded graph rows write and read only there
        self.scratch_block = num_blocks
        self.scratch_slot = num_state_slots if has_state else -1
        self.caches = allocate_caches(self.cache_groups, num_blocks + 1, block_size, self.device,
                                      num_seqs=num_state_slots + 1 if has_state else 0)
        # per-sequence state tensors, zeroed for every sequence that starts at token 0
        self._state_tensors = [t for g in self.cache_groups if g.kind == "per_seq"
                               for entry in self.caches[g.name].values() for t in entry]
        self.sampler = Sampler()
        self.buckets = capture_sizes(max_num_seqs or 1)
        self.simulate_buckets = bool(simulate_buckets)
        self.max_seq_len_to_capture = int(max_seq_len_to_capture)
        # set when the weights may have changed (the engine: on every idle -> busy transition);
        # the decode graphs then re-check parameter addresses and derived weights (graphs.py)
        self.weights_changed = True
        self.graphs = None
        self._pending = None
        self.graph_safe = graph_safe(model, quantization)
        self.num_simulated_steps = 0
        self._simulated_keys = set()  # the graph keys a simulated run has "captured"
        self.num_steps = 0  # forwards run (bitmatch.parallel.step_data_parallel: did this step run one)
        self.recorders: list = []  # Engine.record's, outermost first
        if self.device.type == "cuda" and not enforce_eager and self.graph_safe:
            self.graphs = DecodeGraphs(self, max_seq_len_to_capture)

    def close(self) -> None:
        """Free the caches and the decode graphs (their pool and buffers) now; the runner is unusable
        after (``Engine.close``)."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        self.caches = None
        self._state_tensors = []
        self._pending = None

    def reset_state_slots(self, slots: list[int]) -> None:
        """Zero the per-sequence state of ``slots`` (a sequence (re)starting from token 0)."""
        if slots and self._state_tensors:
            idx = torch.tensor(slots, dtype=torch.long, device=self.device)
            for t in self._state_tensors:
                t.index_fill_(0, idx, 0)

    def bucket_for(self, B: int) -> int | None:
        for b in self.buckets:
            if b >= B:
                return b
        return None

    def pad(self, inp: StepInputs, bucket: int) -> StepInputs:
        """The step's inputs padded to ``bucket`` rows: padded rows decode token 0 at position 0
        with a 1-token context in the scratch block (and scratch state slot), so they never touch a
        real sequence's cache; real rows are unchanged."""
        import copy
        p = copy.copy(inp)
        n = bucket - inp.B
        if n <= 0:
            return p
        bs, sb = self.block_size, self.scratch_block

        def ext(x, v):
            return np.concatenate([x, np.full(n, v, np.int64)])
        p.B = p.T = bucket
        p.ids, p.positions, p.slots = ext(inp.ids, 0), ext(inp.positions, 0), ext(inp.slots, sb * bs)
        p.state_slots = ext(inp.state_slots, self.scratch_slot)
        p.seq_lens = ext(inp.seq_lens, 1)
        p.qsl = np.arange(bucket + 1, dtype=np.int64)
        pad_bt = np.zeros((n, inp.block_table.shape[1]), np.int64)
        pad_bt[:, 0] = sb
        p.block_table = np.concatenate([inp.block_table, pad_bt])
        p.sample_rows = inp.sample_rows  # only real rows are sampled
        return p

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        """(input_ids [T], ForwardContext, sample_rows [S] device tensor) of an eager step."""
        pending = self._pending
        self._pending = None
        inp = pending[1] if pending is not None and pending[0] is scheduled else StepInputs(scheduled, self.block_size)
        self._reset_fresh(scheduled)
        return inp.context(self.device, self.caches, self.quantization)

    def _reset_fresh(self, scheduled):
        self.reset_state_slots([seq.state_slot for seq, _ in scheduled
                                if seq.num_computed_tokens == 0 and seq.state_slot >= 0])

    @torch.no_grad()
    def run(self, scheduled: list[tuple[Sequence, int]]):
        """Run the step; returns (sequences that sample, tokens, logprobs, sampled_logprobs)."""
        self.num_steps += 1
        inp = StepInputs(scheduled, self.block_size)
        seqs = [seq for (seq, _), m in zip(scheduled, inp.sample_mask.tolist()) if m]
        params, seeds = [s.params for s in seqs], [s.seed for s in seqs]
        indices = [s.num_completion_tokens for s in seqs]
        recorders = tuple(self.recorders)
        out = None
        bucket = self.bucket_for(inp.B) if inp.pure_decode else None
        if bucket is not None and self.graphs is not None:
            self._reset_fresh(scheduled)
            on_replay = self._on_replay(recorders, scheduled, inp, bucket, "graph")
            out = self.graphs.run(self.pad(inp, bucket), bucket, params, seeds, indices, on_replay)  # None: eager
        elif bucket is not None and self.simulate_buckets and self.graph_safe:
            self._reset_fresh(scheduled)
            on_replay = self._on_replay(recorders, scheduled, inp, bucket, "simulated graph")
            out = self._simulated_graph_step(inp, bucket, params, seeds, indices, on_replay)
            self.num_simulated_steps += out is not None
        if out is not None:
            tokens, lps, sampled = self.sampler.finish(out[:, :inp.B])
            return seqs, tokens, lps, sampled
        self._pending = (scheduled, inp)
        ids, ctx, rows = self.prepare(scheduled)
        view = StepView(self.num_steps, "eager", self._rows(scheduled, inp), ctx) if recorders else None
        rec = begin(recorders, view) if recorders else None
        hidden = forward_hidden(self.model, ids, ctx, recorder=rec)
        if not seqs:
            return [], [], [], []
        if rows.shape[0] != hidden.shape[0]:
            hidden = hidden.index_select(0, rows)
        logits = compute_logits(self.model, hidden, kept=True)
        if recorders:
            head = tuple(view.rows[i] for i in inp.sample_rows.tolist())
            for r in recorders:
                r.record("lm_head", logits, head)
        tokens, lps, sampled = self.sampler(logits, params, seeds, indices)
        return seqs, tokens, lps, sampled

    @staticmethod
    def _rows(scheduled, inp: StepInputs, padded: int = 0) -> tuple:
        return step_rows([seq.seq_id for seq, n in scheduled for _ in range(n)], inp.positions.tolist(), padded)

    def _on_replay(self, recorders, scheduled, inp, bucket: int, path: str):
        """None without recorders; else the ``on_replay(ctx, outputs)`` of a graph step, which hands
        the recorders the step's view and the graph's op outputs (padded rows keyed None)."""
        if not recorders:
            return None
        rows = self._rows(scheduled, inp, bucket - inp.B)
        return lambda ctx, outputs: emit(recorders, StepView(self.num_steps, path, rows, ctx), outputs)

    def _simulated_graph_step(self, inp, bucket, params, seeds, indices, on_replay=None):
        """What a graph replay computes, run eagerly (CPU tests): the padded inputs at the context
        bucket's host bound with the graph's full-width block table, the LM head and the sampler on
        every padded row; None (an eager step) past the captured length, as ``DecodeGraphs.run``
        (``on_replay`` too: the recording step of the key, its outputs handed over after it ran)."""
        width = max(1, -(-self.max_seq_len_to_capture // self.block_size))
        cap_len = width * self.block_size
        if inp.max_seq_len > cap_len or inp.block_table.shape[1] > width:
            return None
        p = self.pad(inp, bucket)
        p.max_seq_len = next(c for c in context_buckets(cap_len, self.block_size) if c >= inp.max_seq_len)
        extra = width - p.block_table.shape[1]
        if extra > 0:  # the graph's block table is full width (scratch entries past each row's blocks)
            p.block_table = np.concatenate([p.block_table, np.full((bucket, extra), self.scratch_block, np.int64)], 1)
        ids, ctx, _ = p.context(self.device, self.caches, self.quantization)
        flags, f32, i64 = padded_sampling(self.sampler, params, seeds, indices, bucket)
        f32, i64 = torch.from_numpy(f32).to(self.device), torch.from_numpy(i64).to(self.device)
        recorded = on_replay is not None
        key = (bucket, p.max_seq_len, flags, recorded)
        if key not in self._simulated_keys:  # a capture: its warm-up runs the step once before the replay
            self._simulated_keys.add(key)
            warm_up_on_scratch(self, ctx.slot_mapping, ctx.state_slots,
                               lambda: decode_step(self, ids, ctx, f32, i64, flags, GraphTap() if recorded else None))
        tap = GraphTap() if recorded else None
        out = decode_step(self, ids, ctx, f32, i64, flags, tap)
        if recorded:
            on_replay(ctx, tap.outputs)
        return out

"""Runs one scheduled step: builds the paged ForwardContext, runs the model, samples.

The model path is M's ``bitmatch.models.forward_hidden`` / ``compute_logits`` on the HF
module's own parameters (read at every step, so a weight update is seen at once). In paged
mode each attention layer writes the step's K/V at ``slot_mapping`` and calls
``kernels.attention_paged`` for every token, decode and prefill chunk alike, so the bits of a
token's logits do not depend on how its prefix was scheduled.
"""
from __future__ import annotations

import torch

from bitmatch.context import ForwardContext
from bitmatch.engine.sampling import Sampler
from bitmatch.engine.sequence import Sequence


def bytes_per_block(groups, block_size: int) -> int:
    """Cache bytes one block of ``block_size`` tokens costs over all of the model's cache groups."""
    return sum(g.bytes_per_block(block_size) for g in groups)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, block_size: int, num_blocks: int, num_state_slots: int = 0):
        from bitmatch.models import allocate_caches, cache_groups

        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = next(model.parameters()).device
        # the family says which caches it needs; the engine never names an architecture
        self.cache_groups = cache_groups(model)
        self.caches = allocate_caches(self.cache_groups, num_blocks, block_size, self.device,
                                      num_seqs=num_state_slots)
        # per-sequence state tensors, zeroed for every sequence that starts at token 0
        self._state_tensors = [t for g in self.cache_groups if g.kind == "per_seq"
                               for entry in self.caches[g.name].values() for t in entry]
        self.sampler = Sampler()

    def reset_state_slots(self, slots: list[int]) -> None:
        """Zero the per-sequence state of ``slots`` (a sequence (re)starting from token 0)."""
        if slots and self._state_tensors:
            idx = torch.tensor(slots, dtype=torch.long, device=self.device)
            for t in self._state_tensors:
                t.index_fill_(0, idx, 0)

    def prepare(self, scheduled: list[tuple[Sequence, int]]):
        """(input_ids [T], ForwardContext, indices of the rows whose logits are sampled)."""
        bs = self.block_size
        input_ids, positions, slots, qsl, seq_lens, sample_rows = [], [], [], [0], [], []
        fresh = [seq.state_slot for seq, _ in scheduled if seq.num_computed_tokens == 0 and seq.state_slot >= 0]
        self.reset_state_slots(fresh)
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            end = start + n
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            if end == len(seq):  # prefill done or decode: the last row gives the next token
                sample_rows.append(qsl[-1] - 1)
        max_blocks = max(len(seq.block_table) for seq, _ in scheduled)
        block_table = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq, _ in scheduled]
        dev = self.device

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype, device=dev)

        ctx = ForwardContext(positions=t(positions, torch.int64), query_start_loc=t(qsl, torch.int32),
                             seq_lens=t(seq_lens, torch.int32), block_table=t(block_table, torch.int32),
                             slot_mapping=t(slots, torch.int64), caches=self.caches,
                             state_slots=t([seq.state_slot for seq, _ in scheduled], torch.int64))
        return t(input_ids, torch.int64), ctx, sample_rows

    @torch.no_grad()
    def run(self, scheduled: list[tuple[Sequence, int]]):
        """Run the step; returns (sequences that sample, tokens, logprobs, sampled_logprobs)."""
        from bitmatch.models import compute_logits, forward_hidden

        input_ids, ctx, sample_rows = self.prepare(scheduled)
        hidden = forward_hidden(self.model, input_ids, ctx)
        seqs = [seq for seq, n in scheduled if seq.num_computed_tokens + n == len(seq)]
        if not seqs:
            return [], [], [], []
        rows = torch.tensor(sample_rows, dtype=torch.long, device=hidden.device)
        logits = compute_logits(self.model, hidden.index_select(0, rows))
        tokens, lps, sampled = self.sampler(logits, [s.params for s in seqs], [s.seed for s in seqs],
                                            [s.num_completion_tokens for s in seqs])
        return seqs, tokens, lps, sampled

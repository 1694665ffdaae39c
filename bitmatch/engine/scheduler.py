"""Continuous batching with chunked prefill and recompute preemption (vLLM v1's unified step).

Every step has a budget of ``max_num_batched_tokens`` tokens: running sequences first (one
token each for decode, the next chunk for a prefill in progress), then waiting ones in
arrival order while ``max_num_seqs`` and the free KV blocks allow. So a step may mix decode
tokens with prefill chunks, and requests join and leave every step. When a running sequence
needs a block and none is free, the lowest-priority (latest) running sequence is preempted:
its blocks are freed and it goes back to the front of the queue with prompt + generated
tokens as its new prompt (recompute). Its sampled tokens and logprobs are kept (its sampling
noise is keyed by seed and token index), and the recomputed K/V and logits have the same bits
(schedule invariance), so a preempted request reports the same tokens and logprobs as one that never was.
"""
from __future__ import annotations

from collections import deque

from bitmatch.engine.block_manager import BlockManager
from bitmatch.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def _chunk(self, seq: Sequence, num_new: int, budget: int) -> int:
        """Tokens of ``seq`` to run this step (0: wait). Without chunked prefill a prefill runs
        whole, except a recompute prompt longer than the whole budget, which must be split."""
        if num_new <= budget:
            return num_new
        if self.enable_chunked_prefill or num_new > self.max_num_batched_tokens:
            return budget
        return 0

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The step's (sequence, number of new tokens) list; blocks already allocated."""
        bm = self.block_manager
        bm.begin_step()
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, seq.num_uncomputed_tokens, budget)
            if n == 0:
                i += 1
                continue
            while not bm.can_append(seq, n):
                victim = self.running.pop()
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                bm.append_slots(seq, n)
                bm.note_scheduled(seq, n)
                scheduled.append((seq, n))
                budget -= n
                i += 1
        # Admit waiting requests (not in a step that had to preempt: memory is short). A request whose
        # next prefix block another request computes in this step waits one step and hits it then.
        held: list[Sequence] = []
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = bm.get_computed_blocks(seq)
            if bm.computing_next(seq, hits):
                held.append(self.waiting.popleft())
                continue
            computed = len(hits) * bm.block_size
            n = self._chunk(seq, len(seq) - computed, budget)
            if n == 0:
                break
            need = bm.num_new_blocks(seq, n, num_computed=computed) + bm.num_free_blocks_taken_by(hits)
            if need > bm.num_free_blocks:
                break
            self.waiting.popleft()
            bm.allocate_prefix(seq, hits)
            bm.append_slots(seq, n)
            bm.note_scheduled(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        self.waiting.extendleft(reversed(held))
        if not scheduled and not self.is_finished():
            raise RuntimeError("Scheduler: no request could be scheduled (internal error: every request "
                               "was checked to fit the KV cache alone)")
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the blocks, re-queue at the front."""
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.block_manager.deallocate(seq)
        self.running.remove(seq)

"""The pieces of a gather-only tensor-parallel layout: sharded linears and the ``Sharder`` that makes them.

A family's ``Family.shard`` declares which module splits how; the ``Sharder`` builds each piece, so no
rank ever adds another rank's numbers and no kernel's canonical order changes:

- column-parallel (``Sharder.column``: q/k/v by heads, gate/up by intermediate columns): each output
  element is computed on one rank by the same kernel with the full K reduction (``shard_linear``;
  ``kernels.linear``'s contract: a column's bits depend only on its row of x, its weight row and
  bias). Attention, q/k norms, RoPE and silu_and_mul work per head / per element, so they run on
  the rank's heads / columns.
- row-parallel by gather (``Sharder.row``, ``gathered_row_parallel_linear``): all-gather the layer's
  input (each rank's heads' outputs or MLP intermediate columns) in rank order, i.e. in K order;
  each rank computes its hidden/N output columns with the full K; all-gather the columns.
- MoE layers (``Sharder.experts``): the experts spread over the same ranks (``expert_parallel``),
  after the family's own router, replicated.
- vocab-parallel head (``Sharder.vocab``): each rank's vocab slice of the logits, all-gathered to
  full rows, then the same ``kernels.token_logprobs`` / sampler as TP = 1.

``allreduce_row_parallel_linear`` / ``AllreduceRowShard`` are the stock row-parallel layer, kept as
the control that differs (``row_parallel="allreduce"``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import bitmatch.kernels as K
from bitmatch.models import lora
from bitmatch.precision import cast_param

from .collectives import TPGroup, all_gather_cat, copy_to_ranks
from .expert_parallel import (
    ExpertRows,
    allreduce_data_parallel_experts,
    data_parallel_experts,
    expert_parallel_experts,
)


def shard_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, full_n: int) -> torch.Tensor:
    """``kernels.linear(x, weight, bias)`` where ``weight`` is a row slice of a weight of ``full_n``
    rows. Invariance: bit for bit those columns of the full layer's ``kernels.linear``.

    The reference backend is exact (any column split, same bits). On Triton the canonical K split is
    a function of the weight's (N, K) (``linear_split_table``: Qwen3-8B's o_proj 4096 x 4096 runs 2 K
    chunks, a 2048 x 4096 slice would run 1), so the slice runs the full weight's split: the op
    table's ``linear`` with ``rows_of`` (an override, a fault or a control reaches it too).
    """
    return K.linear(x, weight, bias, rows_of=full_n)


def gathered_row_parallel_linear(x_shard, weight_rows, bias_rows, full_n: int, tp: TPGroup) -> torch.Tensor:
    """A row-parallel layer with no cross-rank sum: ``x_shard`` [T, K/N] is this rank's K columns
    (rank order = K order), ``weight_rows`` [full_n/N, K] this rank's output rows with the full K.
    Invariance: bit for bit ``kernels.linear(x, W, b)`` at TP = 1, for any N."""
    x = all_gather_cat(x_shard, tp, dim=-1, reduce_grad=True)
    return all_gather_cat(shard_linear(x, weight_rows, bias_rows, full_n), tp, dim=-1)


def allreduce_row_parallel_linear(x_shard, weight_kcols, bias, tp: TPGroup) -> torch.Tensor:
    """The stock row-parallel layer (Megatron, vLLM): this rank's partial ``x_shard @ W[:, K/N]^T``
    in x's dtype, all-reduced (summed in the collective's order), then + bias. Not TP-invariant:
    the control of tests/test_tensor_parallel.py."""
    y = K.linear(x_shard, weight_kcols)
    if tp.world > 1:
        dist.all_reduce(y, group=tp.group)
    return y if bias is None else y + bias


@dataclass
class ColumnShard:
    """This rank's rows [lo, hi) of ``module``'s linear (column-parallel), sliced from the model's
    parameters and cast at use as the one-process forward does: autograd reaches the parameters and
    an in-place weight update is seen."""
    module: torch.nn.Module
    lo: int
    hi: int
    dtype: torch.dtype

    @property
    def full_n(self) -> int:
        return self.module.weight.shape[0]

    def params(self):
        b = getattr(self.module, "bias", None)
        return (cast_param(self.module.weight[self.lo:self.hi], self.dtype),
                None if b is None else cast_param(b[self.lo:self.hi], self.dtype))

    def __call__(self, x):
        return shard_linear(x, *self.params(), self.full_n)


@dataclass
class GatherRowShard(ColumnShard):
    """A row-parallel layer run by gather: this rank's output rows, full K."""
    tp: TPGroup = None

    def __call__(self, x_shard):
        return gathered_row_parallel_linear(x_shard, *self.params(), self.full_n, self.tp)


@dataclass
class AllreduceRowShard:
    """The stock row-parallel layer (``allreduce_row_parallel_linear``): this rank's K columns
    [lo, hi) of the weight, the partials all-reduced. Not TP-invariant: the whole-model control and
    the speed baseline (``shard_dense_model(..., row_parallel="allreduce")``)."""
    module: torch.nn.Module
    lo: int
    hi: int
    dtype: torch.dtype
    tp: TPGroup = None

    def __call__(self, x_shard):
        b = getattr(self.module, "bias", None)
        return allreduce_row_parallel_linear(x_shard, cast_param(self.module.weight[:, self.lo:self.hi], self.dtype),
                                             None if b is None else cast_param(b, self.dtype), self.tp)


@dataclass
class VocabShard(ColumnShard):
    """A vocab-parallel head: this rank's vocab rows of ``module``'s linear, the logits all-gathered to
    full rows in rank order. Invariance: bit for bit the unsharded head's logits."""
    tp: TPGroup = None

    def __call__(self, hidden):
        return all_gather_cat(shard_linear(copy_to_ranks(hidden, self.tp), *self.params(), self.full_n), self.tp,
                              dim=-1)


@dataclass
class ExpertShard(ExpertRows):
    """A MoE layer's routed experts [lo, hi) on this rank of ``tp``, called after the family's own
    router as ``experts(x, ids, w)`` -> [T, hidden]: through ``expert_parallel_experts`` (every rank
    holds every token: EP = TP) or, with ``data_parallel``, ``data_parallel_experts`` (each rank its
    own tokens); both end in the one-rank slot-order combine. ``stock`` (with ``data_parallel``): the
    all-reduce combine, the control."""
    module: torch.nn.Module  # the layer's MoE block (``module.experts`` holds the stacked expert tensors)
    lo: int
    hi: int
    dtype: torch.dtype
    tp: TPGroup
    data_parallel: bool = False
    stock: bool = False
    num_experts: int = 0  # the layer's routed experts (its expert tensors may hold this rank's only)
    tensors: tuple = ("gate_up_proj", "down_proj")  # module.experts' stacked [in, out] tensors
    activation: str = "swiglu"
    limit: float | None = None  # the SwiGLU clamp (DeepSeek-V4's swiglu_limit)

    @property
    def EXPERT_TENSORS(self) -> tuple:  # noqa: N802 (ExpertRows' name)
        return self.tensors

    @property
    def ACTIVATION(self) -> str:  # noqa: N802 (ExpertRows' name)
        return self.activation

    def __call__(self, x, ids, w):
        w_in, w_out = self.expert_weights()
        if self.data_parallel and self.stock:
            return allreduce_data_parallel_experts(x, ids, w, w_in, w_out, self.num_experts, self.tp)
        if self.data_parallel:
            return data_parallel_experts(x, ids, w, w_in, w_out, self.num_experts, self.tp, activation=self.activation,
                                         swiglu_limit=self.limit)
        return expert_parallel_experts(copy_to_ranks(x, self.tp), ids, w, w_in, w_out, self.num_experts, self.tp,
                                       activation=self.activation, swiglu_limit=self.limit)


@dataclass
class Sharder:
    """The mechanisms a family's ``Family.shard`` hook builds one rank's layout from: the family
    declares which module splits how (by heads, columns, vocab rows, experts), this object makes
    the pieces (column slices, row-parallel layers by gather, the vocab-parallel head, the expert
    dispatch, the entry of a replicated tensor into the column shards), so a family module never
    imports ``bitmatch.parallel``. ``row_parallel="allreduce"``: the stock row-parallel layers (and,
    under ``data_parallel_experts``, the stock expert combine), the control and the speed baseline."""
    tp: TPGroup
    dtype: torch.dtype
    row_parallel: str = "gather"
    data_parallel_experts: TPGroup | None = None  # each rank its own tokens, experts over this group
    who: str = "enable_tensor_parallel"

    def __post_init__(self):
        if self.data_parallel_experts is not None and self.tp.world != 1:
            raise ValueError(f"{self.who}: data_parallel_experts needs tp of one rank (data-parallel attention); "
                             "tensor parallel attention with experts over another group is not built")
        if self.row_parallel not in ("gather", "allreduce"):
            raise ValueError(f"{self.who}: row_parallel must be 'gather' or 'allreduce', got {self.row_parallel!r}")

    @property
    def rank(self) -> int:
        return self.tp.rank

    @property
    def world(self) -> int:
        return self.tp.world

    def even(self, n: int, field: str) -> int:
        """``n`` / TP degree, or a ValueError naming ``field`` when the degree does not divide it."""
        if n % self.world:
            raise ValueError(f"{self.who}: {field} = {n} is not divisible by the TP degree {self.world}; "
                             "use a degree that divides it")
        return n // self.world

    def _plain(self, mod, what: str):
        if lora.is_lora_layer(mod) or hasattr(mod, "base_layer") or hasattr(mod, "lora_A"):
            raise ValueError(f"{self.who}: {what} is a PEFT adapter layer; merge the adapters "
                             "(peft merge_and_unload) before sharding")
        return mod

    def column(self, mod, lo: int, hi: int, what: str) -> ColumnShard:
        """Rows [lo, hi) of ``mod``'s linear, each output column with the full K."""
        return ColumnShard(self._plain(mod, what), lo, hi, self.dtype)

    def row(self, mod, rows: int, kcols: int, what: str):
        """A row-parallel layer: by gather (this rank's ``rows`` output rows, full K) or the stock
        all-reduce layer (this rank's ``kcols`` input columns)."""
        r = self.rank
        if self.row_parallel == "gather":
            return GatherRowShard(self._plain(mod, what), r * rows, (r + 1) * rows, self.dtype, tp=self.tp)
        return AllreduceRowShard(self._plain(mod, what), r * kcols, (r + 1) * kcols, self.dtype, tp=self.tp)

    def vocab(self, head, what: str = "lm_head") -> VocabShard:
        """The LM head by vocab rows, its logits gathered to full rows."""
        n = self.even(head.weight.shape[0], "vocab_size")
        return VocabShard(self._plain(head, what), self.rank * n, (self.rank + 1) * n, self.dtype, tp=self.tp)

    def enter(self, x):
        """A replicated tensor entering the rank's column shards (identity forward; its gradient
        summed over the ranks in backward)."""
        return copy_to_ranks(x, self.tp)

    def experts(self, module, num_experts: int, field: str = "num_experts", **kind) -> ExpertShard:
        """``module``'s routed experts spread over the ranks: EP = TP, or over ``data_parallel_experts``.
        ``kind``: the expert tensors' names, activation and clamp (``ExpertShard.tensors`` / ``activation`` /
        ``limit``)."""
        ep = self.data_parallel_experts
        if ep is None:
            e = self.even(num_experts, field)
            return ExpertShard(module, self.rank * e, (self.rank + 1) * e, self.dtype, self.tp, num_experts=num_experts,
                               **kind)
        if num_experts % ep.world:
            raise ValueError(f"enable_expert_parallel: {field} = {num_experts} is not divisible by the EP "
                             f"degree {ep.world}; use a degree that divides it")
        e = num_experts // ep.world
        return ExpertShard(module, ep.rank * e, (ep.rank + 1) * e, self.dtype, ep, data_parallel=True,
                           stock=self.row_parallel == "allreduce", num_experts=num_experts, **kind)

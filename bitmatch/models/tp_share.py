"""What a family's tensor-parallel share is made of, whatever the family: the rank's model share
(``ModelShare``: the family's own ``run`` over its per-layer shares) and the attention share that
dense and Nemotron-H layers take. A family's ``<family>_tp.py`` builds them from the ``sharder``
``bitmatch.parallel`` passes in."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class AttentionShare:
    """A rank's share of one attention block: ``enter`` (the replicated input into the column
    shards), its q/k/v heads' projections and o_proj (any callable [T, Hq_rank * D] -> [T, hidden])."""
    enter: Callable
    q: Callable
    k: Callable
    v: Callable
    o: Callable


@dataclass
class ModelShare:
    """One rank's share of a causal LM: the model's own modules (the simulation keeps the whole model on
    every rank; the pieces read their slices at use, so autograd reaches the parameters and an in-place
    update is seen) and, per layer, the family's share of it (``layers``)."""
    family: object
    tp: object  # the TP group (rank, world)
    spec: object  # the family's spec (the rank's heads and groups where the family sets them)
    dtype: torch.dtype
    model: torch.nn.Module  # the unwrapped causal LM
    layers: list
    lm_head: Callable  # hidden -> full logits (vocab rows, gathered)

    def forward_hidden(self, input_ids, ctx, recorder=None):
        """Packed tokens [T] -> final-norm hidden states [T, hidden], the same on every rank.
        Invariance: bit for bit the unsharded model's ``bitmatch.models.forward_hidden``."""
        return self.family.run(self.model, self.spec, input_ids, ctx, self.dtype, recorder, self.layers)

    def compute_logits(self, hidden):
        """Full logits on every rank (vocab slices gathered). Invariance: the unsharded model's bits."""
        return self.lm_head(hidden)

    def cache_groups(self):
        return self.family.cache_groups(self.spec, self.dtype)

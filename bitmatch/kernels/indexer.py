"""indexer_topk: DeepSeek-V4's Lightning Indexer selection for compressed sparse attention (CSA).

For the query at absolute position t and compressed index key s (s = 0..C-1, key s pools the
window ending at position (s+1)*m - 1):

    score[t, s] = sum_h  w[t, h] * (ReLU(q[t, h] . k[s]) * softmax_scale)

Canonical order: each dot product q[t, h] . k[s] from ``exact_matmul`` (exact in float64 for
bf16, on the row grid for fp32) rounded to fp32 as HF's fp32 matmul; ReLU, the two products in
fp32; the sum over heads a ``tree_sum`` fold in float64, rounded once to fp32. A score depends
on (q_t, w_t, k_s) alone. Keys not yet complete at t (s >= (t+1) // m) are excluded; among the
visible keys the top ``k`` by (score desc, index asc) are selected: ties go to the LOWEST index,
so the same entries are chosen whatever the batch, the chunking or the number of keys present.
The result is a boolean selection mask, so the attention reads the chosen entries in index
order (order-free). The selection is piecewise constant: no gradient (HF's neither).
``indexer_select`` is the same selection for every query row of a step in one call: row i reads
the index keys of its own sequence through a ``KeyRows`` address (key c at the address of its
window's closing position (c+1)*m - 1), scores the keys c < static bound ``max_len // m`` (keys
not complete at t score -inf) and returns the selected indices [T, top_k] ascending, -1 padded
(the list ``sink_attention_rows`` reads). No host read on the Triton backend.
Reference: CPU (rows grouped by sequence on the host). Triton backend (CUDA):
kernels/triton/indexer.py: one fused score kernel (a row's scores from its q, w and the keys
alone, in fixed tiles), then a stable sort (ties to the lowest index).
"""
from __future__ import annotations

import torch

from . import _exact
from ._backend import (
    backend_for,
    check_float,
    check_in_range,
    check_int,
    check_same_device,
    triton_impl,
)
from .compressed_attention import KeyRows, entry_list

F64 = torch.float64


def indexer_scores_reference(q, keys, weights, softmax_scale):
    """fp32 [Tq, C] scores: per (t, s) from q[t], weights[t] and keys[s] alone."""
    tq, h, d = q.shape
    dots = _exact.exact_matmul(q.reshape(tq * h, d), keys, _exact.slices_for(q.dtype),
                               _exact.slices_for(keys.dtype)).float().view(tq, h, -1)
    per_head = (torch.relu(dots) * float(softmax_scale)) * weights.float().unsqueeze(-1)  # fp32 roundings
    return _exact.tree_sum(per_head.to(F64), 1).float()


def select_topk(scores, qpos, rate, top_k):
    """Boolean [Tq, C]: the top ``top_k`` visible keys of each row, ties to the lowest index."""
    tq, c = scores.shape
    visible = torch.arange(c, device=scores.device).view(1, -1) < torch.div(qpos.view(-1, 1) + 1, rate,
                                                                             rounding_mode="floor")
    masked = torch.where(visible, scores, -torch.inf)
    k = min(int(top_k), c)
    mask = torch.zeros(tq, c, dtype=torch.bool, device=scores.device)
    if k == 0:
        return mask
    # a stable descending sort keeps equal scores in index order: the lowest index wins a tie
    idx = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]
    mask.scatter_(1, idx, True)
    return mask & visible


def indexer_topk(q, qpos, keys, weights, *, rate: int, top_k: int, softmax_scale: float):
    """q [Tq, H, Di] (RoPE'd indexer queries), qpos [Tq] absolute positions, keys [C, Di]
    (compressed index keys 0..C-1 of the sequence), weights [Tq, H] fp32 (weights_proj * H^-0.5)
    -> bool [Tq, C]: the entries each query attends to.

    Invariance: row t depends only on q_t, w_t, its position and the keys; ties go to the
    lowest index, keys past t never count, so any chunking or batch selects the same entries.
    """
    op = "indexer_topk"
    for n, t in (("q", q), ("keys", keys), ("weights", weights)):
        check_float(n, t, op)
    check_int("qpos", qpos, op)
    if q.dim() != 3 or keys.dim() != 2 or keys.shape[1] != q.shape[2]:
        raise ValueError(f"{op}: q must be [Tq, H, Di] and keys [C, Di], got {tuple(q.shape)}, {tuple(keys.shape)}")
    if weights.shape != q.shape[:2] or qpos.shape != (q.shape[0],):
        raise ValueError(f"{op}: weights must be [Tq, H] and qpos [Tq], "
                         f"got {tuple(weights.shape)}, {tuple(qpos.shape)}")
    if q.dtype != keys.dtype:
        raise ValueError(f"{op}: q ({q.dtype}) and keys ({keys.dtype}) must share a dtype")
    if not isinstance(rate, int) or rate < 1 or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"{op}: rate and top_k must be positive ints, got {rate!r}, {top_k!r}")
    check_same_device(op, q=q, qpos=qpos, keys=keys, weights=weights)
    q, keys, weights = q.detach(), keys.detach(), weights.detach()
    if backend_for(q) == "reference":
        scores = indexer_scores_reference(q.contiguous(), keys.contiguous(), weights, softmax_scale)
    else:
        scores = triton_impl("indexer", "indexer_scores")(q.contiguous(), keys.contiguous(), weights,
                                                          float(softmax_scale))
    return select_topk(scores, qpos, rate, top_k)


def select_rows(scores, qpos, rate, top_k):
    """int32 [T, top_k]: the top ``top_k`` visible keys of each row of ``scores`` [T, C] (ties to
    the lowest index), ascending, -1 padded; device ops only (no host read). The definition the
    Triton backend's one-launch ``select_rows`` (kernels/triton/indexer.py) is tested against."""
    tq, c = scores.shape
    n_vis = torch.div(qpos.long().view(-1, 1) + 1, rate, rounding_mode="floor")
    k = min(int(top_k), c)
    idx = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    sel = torch.where(idx < n_vis, idx, c).sort(1).values
    if k < top_k:
        sel = torch.cat([sel, torch.full((tq, top_k - k), c, dtype=sel.dtype, device=sel.device)], 1)
    return torch.where(sel >= c, -1, sel).to(torch.int32)


def _select_reference(q, qpos, keys, weights, rows, rate, top_k, softmax_scale):
    out = torch.full((q.shape[0], top_k), -1, dtype=torch.int32, device=q.device)
    key = rows.group_key()
    for g in torch.unique(key).tolist():
        r = (key == g).nonzero()[:, 0]
        pos = qpos[r]
        n_ent = (int(pos.max()) + 1) // rate
        if n_ent == 0:
            continue
        ends = ((torch.arange(n_ent, device=q.device) + 1) * rate - 1).view(1, -1)
        scores = indexer_scores_reference(q[r], keys[rows.slots(ends, r[:1])[0]], weights[r], softmax_scale)
        out[r] = entry_list(select_topk(scores, pos, rate, top_k), top_k)
    return out


def indexer_select(q, qpos, keys, weights, rows: KeyRows, *, rate: int, top_k: int, softmax_scale: float):
    """Every query row of a step: q [T, H, Di] (RoPE'd indexer queries) at positions qpos [T],
    keys [S, Di] the index-key store addressed through ``rows`` (key c of a sequence at the
    address of position (c+1)*rate - 1), weights [T, H] fp32 -> int32 [T, top_k]: each row's
    selected key indices, ascending, -1 padded.

    Invariance: row t depends only on q_t, w_t, its position and its sequence's complete keys;
    ties go to the lowest index, so any batch, chunking or store layout selects the same keys.
    """
    op = "indexer_select"
    for n, t in (("q", q), ("keys", keys), ("weights", weights)):
        check_float(n, t, op)
    check_int("qpos", qpos, op)
    if not isinstance(rows, KeyRows):
        raise ValueError(f"{op}: rows must be a KeyRows, got {type(rows).__name__}")
    if q.dim() != 3 or keys.dim() != 2 or keys.shape[1] != q.shape[2] or q.dtype != keys.dtype:
        raise ValueError(f"{op}: q [T, H, Di] and keys [S, Di] of one dtype, got {tuple(q.shape)} {q.dtype}, "
                         f"{tuple(keys.shape)} {keys.dtype}")
    if weights.shape != q.shape[:2] or qpos.shape != (q.shape[0],):
        raise ValueError(f"{op}: weights must be [T, H] and qpos [T], got {tuple(weights.shape)}, {tuple(qpos.shape)}")
    if not isinstance(rate, int) or rate < 1 or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"{op}: rate and top_k must be positive ints, got {rate!r}, {top_k!r}")
    check_same_device(op, q=q, qpos=qpos, keys=keys, weights=weights)
    q, keys, weights = q.detach().contiguous(), keys.detach().contiguous(), weights.detach().float().contiguous()
    if backend_for(q) == "reference":
        if q.shape[0] and int(qpos.max()) >= rows.max_len:
            raise ValueError(f"{op}: a query position is >= max_len={rows.max_len}")
        return _select_reference(q, qpos, keys, weights, rows, rate, top_k, softmax_scale)
    if q.shape[0]:
        check_in_range(qpos, 0, rows.max_len,
                       f"{op}: a query position is outside 0..max_len-1 (max_len={rows.max_len})")
    n_cols = max(1, rows.max_len // rate)
    scores = triton_impl("indexer", "indexer_scores_rows")(q, qpos, keys, weights, rows, rate, n_cols,
                                                          float(softmax_scale))
    return triton_impl("indexer", "select_rows")(scores, qpos, rate, top_k)

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
Reference: CPU. Triton backend (CUDA): kernels/triton/indexer.py (dots from the invariant Triton
linear in fp32 IEEE, the same fold over heads).
"""
from __future__ import annotations

import torch

from . import _exact
from ._backend import backend_for, check_float, check_int, check_same_device, triton_impl

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
        raise ValueError(f"{op}: weights must be [Tq, H] and qpos [Tq], got {tuple(weights.shape)}, {tuple(qpos.shape)}")
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

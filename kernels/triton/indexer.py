"""indexer_scores on the Triton backend: the Lightning Indexer's scores from the invariant Triton
``linear`` (fp32, IEEE dots: each (query-head row, key) element depends on those two rows only,
never on how many keys or queries the call holds) and elementwise fp32 ops; the sum over heads
is a fixed fold (``_exact.tree_sum``). The top-k selection is kernels.indexer.select_topk (stable
sort: ties to the lowest index) on either backend.
"""
import torch

from .._exact import tree_sum
from ..linear import linear


def indexer_scores(q, keys, weights, softmax_scale):
    tq, h, d = q.shape
    dots = linear(q.reshape(tq * h, d).float(), keys.float()).view(tq, h, -1)
    per_head = (torch.relu(dots) * float(softmax_scale)) * weights.float().unsqueeze(-1)
    return tree_sum(per_head, 1)

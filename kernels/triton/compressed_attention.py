"""sink_attention on the Triton backend: scores and value sums from the invariant Triton
``linear`` (fp32 IEEE dots), the softmax in elementwise fp32 with fixed folds.

Canonical order (this backend's bits), for the query row (t, h):
    s      = linear(fp32 q, fp32 keys) * scale            each element from (q row, key row) alone
    M      = max(max_j s_j, max_c s_c, sink)               (exact, order-free)
    den    = (fold_j exp(s_j - M) + fold_c exp(s_c - M)) + exp(sink - M)
    num    = linear(p_local, kv^T) + linear(p_entries, entries^T)
             (K = key positions from 0 / entry index from 0, sequential fp32 accumulation:
              positions past t hold p = 0 exactly, so a shorter or longer key range adds zeros)
    out    = round_dtype(num / den)
``fold`` is ``_exact.tree_sum`` at absolute positions (zero padding does not change it): a
query's bits do not depend on L, C, the number of queries or the batch. Queries run in chunks
that bound the score matrix; chunking changes M only, never a row's bits.
"""
import torch

from .._exact import tree_sum
from ..linear import linear

_SCRATCH = 1 << 26  # fp32 score elements per query chunk


def sink_attention(q, qpos, kv, entries, entry_mask, sinks, scale, window):
    tq, h, d = q.shape
    n_loc, n_ent = kv.shape[0], entries.shape[0]
    keys = torch.cat([kv, entries], 0).float()
    kv_t = kv.float().t().contiguous()
    ent_t = entries.float().t().contiguous()
    j = torch.arange(n_loc, device=q.device)
    sink = sinks.float().view(1, -1)
    out = []
    step = max(1, _SCRATCH // max(1, h * (n_loc + n_ent)))
    for s0 in range(0, tq, step):
        qc, pc = q[s0:s0 + step], qpos[s0:s0 + step]
        n = qc.shape[0]
        sc = linear(qc.reshape(n * h, d).float(), keys).view(n, h, -1) * scale
        valid = (j.view(1, -1) <= pc.view(-1, 1)) & (j.view(1, -1) > pc.view(-1, 1) - window)
        valid = torch.cat([valid, entry_mask[s0:s0 + step]], 1).unsqueeze(1)  # [n, 1, L + C]
        sc = torch.where(valid, sc, -torch.inf)
        mx = torch.maximum(sc.amax(-1), sink)                                  # [n, h]
        p = torch.where(valid, torch.exp(sc - mx.unsqueeze(-1)), 0.0)
        den = (tree_sum(p[..., :n_loc], -1) + tree_sum(p[..., n_loc:], -1)) + torch.exp(sink - mx)
        num = linear(p[..., :n_loc].reshape(n * h, n_loc), kv_t)
        if n_ent:
            num = num + linear(p[..., n_loc:].reshape(n * h, n_ent).contiguous(), ent_t)
        o = num.view(n, h, d) / den.unsqueeze(-1)
        out.append((o + 0.0).to(q.dtype))
    return torch.cat(out, 0) if out else q.new_zeros(q.shape)

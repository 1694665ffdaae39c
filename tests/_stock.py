"""Stock torch versions of the ops, for the controls: the same harness must find mismatches."""
import torch
import torch.nn.functional as F


def sdpa_prefill(q, k, v, cu, scale, window=None):
    outs = []
    for b in range(len(cu) - 1):
        s, e = int(cu[b]), int(cu[b + 1])
        outs.append(_sdpa(q[s:e], k[s:e], v[s:e], scale, offset=0, window=window))
    return torch.cat(outs)


def _sdpa(q, k, v, scale, offset, window):
    rep = q.shape[1] // k.shape[1]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
    i = torch.arange(q.shape[0]).unsqueeze(1) + offset
    j = torch.arange(k.shape[0]).unsqueeze(0)
    mask = j <= i
    if window is not None:
        mask &= j > i - window
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)[0].transpose(0, 1)


def sdpa_paged(q, kc, vc, bt, qsl, lens, scale, window=None):
    bs = kc.shape[1]
    kf, vf = kc.reshape(-1, *kc.shape[2:]), vc.reshape(-1, *vc.shape[2:])
    outs = []
    for b in range(len(lens)):
        s, e, n = int(qsl[b]), int(qsl[b + 1]), int(lens[b])
        pos = torch.arange(n)
        slots = bt[b, pos // bs].long() * bs + pos % bs
        outs.append(_sdpa(q[s:e], kf[slots], vf[slots], scale, offset=n - (e - s), window=window))
    return torch.cat(outs)

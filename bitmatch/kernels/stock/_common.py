"""What the stock files share: the fp32 dtype and a packed batch's sequence spans."""
from __future__ import annotations

import torch

F32 = torch.float32


def spans(cu):
    """(start, end) of each sequence of a packed batch, from its cumulative lengths (read on the host)."""
    c = cu.tolist()
    return list(zip(c[:-1], c[1:]))

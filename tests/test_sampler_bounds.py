"""The sampler's contract at its edges (issue 24, item 8): every token is in [0, V), on the CPU
reference and on the Triton kernel (under TRITON_INTERPRET=1, as tests/test_sampler_triton.py),
even for rows outside the contract (logits / T overflowing float32, NaN logits): such rows once
drew id == V and crashed the logprob gather with "index 128 is out of bounds"."""
import os
import sys

if not ("triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"):
    os.environ["TRITON_INTERPRET"] = "1"  # must precede triton's import (see test_triton_interpret)

import pytest  # noqa: E402
import torch  # noqa: E402

import bitmatch.kernels as K  # noqa: E402
from bitmatch.kernels import sampling as S  # noqa: E402

interpret = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                               reason="triton was imported before TRITON_INTERPRET=1 could be set")
F64 = torch.float64
V = 128


def _edge_rows():
    """Rows outside the contract beside valid ones, u at 0 and just below 1: logits / T that
    overflow float32 (T a float32 subnormal, and the smallest normal T with logits > 4), NaN
    logits, and valid rows whose tail is -inf (the last drawable token is not V - 1)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, V, generator=g) * 3
    x[2, 0] = float("nan")
    x[3] = float("nan")
    x[4, 100:] = float("-inf")
    x[5, 100:] = float("-inf")
    temps = torch.tensor([1e-45, 1e-39, 1.0, 1.0, 0.7, 0.7, 2.0 ** -126, 1.3])
    u = torch.tensor([1 - 2 ** -53, 0.5, 0.3, 0.9, 1 - 2 ** -53, 0.0, 1 - 2 ** -53, 1 - 2 ** -53], dtype=F64)
    return x, temps, u


def _check(tokens, x):
    assert tokens.dtype == torch.int64 and bool(((tokens >= 0) & (tokens < V)).all()), tokens.tolist()
    assert tokens[4] < 100 and tokens[5] < 100  # u just below 1 and 0 stay on drawable tokens


def test_reference_sampler_never_draws_outside_the_vocabulary():
    x, temps, u = _edge_rows()
    _check(S.categorical_sample_reference(x, temps, u), x)
    greedy = torch.tensor([True, False, True, True, False, False, False, True])
    _check(K.categorical_sample(x, temps, u, greedy), x)
    # the valid rows are untouched by the guard: the same draw as an unclamped searchsorted
    z = S.scaled_logits(x[4:6], temps[4:6])
    w = S._int_weights(z, z.amax(-1, keepdim=True), S._weight_bits(V))
    cdf = torch.cumsum(w, -1)
    r = torch.minimum(torch.floor(u[4:6, None] * cdf[:, -1:].to(F64)).to(torch.int64), cdf[:, -1:] - 1)
    assert torch.equal(S.categorical_sample_reference(x, temps, u)[4:6],
                       torch.searchsorted(cdf, r, right=True).squeeze(1))


@interpret
def test_triton_sampler_never_draws_outside_the_vocabulary():
    pytest.importorskip("triton")
    from bitmatch.kernels.triton import sampling as TS
    x, temps, u = _edge_rows()
    bits = S._weight_bits(V)
    for block, split in ((32, 1), (64, 2), (2048, None)):
        tok = TS.categorical_sample(x, temps, u, None, bits, block=block, split=split)
        _check(tok, x)
        valid = [4, 5, 7]
        assert torch.equal(tok[valid], S.categorical_sample_reference(x, temps, u)[valid])
    greedy = torch.ones(8, dtype=torch.bool)  # greedy rows with a NaN max once reported column V
    _check(TS.categorical_sample(x, temps, u, greedy, bits, block=32, split=2), x)

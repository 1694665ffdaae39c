"""The trainer's step on the Triton backend reads nothing back to the host (issue 22).

A host read on CUDA stalls the CPU until the GPU drains, so Python's launch overhead stops
hiding behind GPU work: a Qwen3-MoE step with a few per layer was host-bound at 0.56x HF. Here
``bitmatch.token_logprobs`` forward + backward runs on the Triton backend in the interpreter (the
branch CUDA takes: ``kernels.host_readable`` is False on the Triton backend) under the host-read
detector of tests/host_reads.py, for a tiny dense Qwen3 and a tiny Qwen3-MoE (and, without a mask,
a tiny Nemotron-H):
- no mask: zero reads (lengths and the longest sequence come from the shape);
- a mask: reads only on its host copy (the mask is read once, before any launch; a CPU mask not
  at all), none in the forward or the backward;
- the same bits as the path that reads the longest sequence back (the metadata only sizes grids),
  and ``pack_rows``' host layout equals ``bitmatch.models.pack``'s device path.
Controls: a planted ``.item()`` is caught, and so is attention's read-back once the host's
longest sequence is dropped.
"""
from __future__ import annotations

import pytest
import torch

import bitmatch
import bitmatch.kernels as K
import bitmatch.logprobs as trainer
from bitmatch.models import pack
from bitmatch.testing.models import tiny_model
from host_reads import host_reads

pytest.importorskip("triton")
pytestmark = pytest.mark.interpreter

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             intermediate_size=32, vocab_size=64)
MODELS = {"dense": ("qwen3", {}), "moe": ("qwen3moe-e8-k2", dict(moe_intermediate_size=16, mlp_only_layers=[]))}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    name, extra = MODELS[request.param]
    m = tiny_model(name, dtype=torch.float32, seed=1, **SMALL, **extra)
    m.train()
    return m


def _batch(masked: bool):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (3, 7), generator=g)
    mask = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]]) if masked else None
    return ids, mask


def _step(model, ids, mask):
    """One training step: logprobs forward, a weighted sum, backward; the logprobs."""
    model.zero_grad(set_to_none=True)
    with K.use_backend("triton"):
        lp = bitmatch.token_logprobs(model, ids, mask, temperature=0.7)
        (lp * torch.linspace(0.5, 1.5, lp.numel()).reshape(lp.shape)).sum().backward()
    return lp.detach()


def _reads(model, ids, mask):
    _step(model, ids, mask)  # first step: builds the per-device rope table (once per process)
    with host_reads(depth=4) as reads:
        _step(model, ids, mask)
    return reads


def test_training_step_reads_nothing_on_the_host(model):
    reads = _reads(model, *_batch(masked=False))
    assert not reads, "host reads in the training step:\n" + "\n".join(f"{w}: {s}" for w, s in reads)


def _hybrid():
    # every block type; chunk 16 (the Triton scan's smallest)
    from bitmatch.models import nemotron_h as NH
    m = bitmatch.patch(NH.FAMILY.tiny_model(dtype=torch.float32, seed=1, chunk_size=16))
    m.train()
    return m


def test_hybrid_step_reads_nothing_on_the_host():
    # Nemotron-H: the Mamba backward builds its chunk layout from the trainer's host copy of the
    # boundaries, attention takes the host's longest sequence, the packed-start check is an
    # asynchronous device assert
    ids = torch.randint(3, 60, (3, 21), generator=torch.Generator().manual_seed(2))
    reads = _reads(_hybrid(), ids, None)
    assert not reads, "host reads in the training step:\n" + "\n".join(f"{w}: {s}" for w, s in reads)


def test_control_mamba_backward_without_the_host_layout_reads_back(monkeypatch):
    # the detector's control for the hybrid: without the trainer's host copy of cu_seqlens the Mamba
    # backward reads the boundaries back
    from bitmatch.context import ForwardContext
    orig = ForwardContext.__init__

    def no_host_copy(self, *a, **kw):
        orig(self, *a, **kw)
        self.cu_seqlens_host = None
    monkeypatch.setattr(ForwardContext, "__init__", no_host_copy)
    reads = _reads(_hybrid(), torch.randint(3, 60, (3, 21), generator=torch.Generator().manual_seed(2)), None)
    assert any("_seqs <- mamba.py" in s and "backward" in s for _, s in reads), reads


def test_masked_step_reads_only_the_masks_host_copy(model):
    reads = _reads(model, *_batch(masked=True))
    # _refuse_mask_holes and pack_rows read the CPU copy token_logprobs takes of the mask (on CUDA:
    # one device -> host copy before the first launch); nothing after them
    assert reads and all(s.split(" ")[1] in ("_refuse_mask_holes", "pack_rows") for _, s in reads), reads


@pytest.mark.parametrize("masked", [False, True])
def test_host_metadata_keeps_every_bit(model, masked, monkeypatch):
    ids, mask = _batch(masked)
    ours = _step(model, ids, mask)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # the old path: no host bound, so attention reads cu_seqlens back and rope computes directly
    _drop_host_bound(monkeypatch)
    old = _step(model, ids, mask)
    assert torch.equal(ours, old), (ours - old).abs().max()
    for n, p in model.named_parameters():
        if n in grads:
            assert torch.equal(grads[n], p.grad), n


def _drop_host_bound(monkeypatch):
    pack_rows = trainer.pack_rows
    monkeypatch.setattr(trainer, "pack_rows", lambda ids, mask: (pack_rows(ids, mask)[0], None))


@pytest.mark.parametrize("rows", [
    [[1, 1, 1, 1, 1]], [[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]], [[0, 0, 0, 0, 0], [0, 1, 1, 1, 0], [1, 0, 0, 0, 0]],
    [[0, 0, 0, 0, 0]]])
def test_host_layout_is_the_device_paths(rows):
    mask = torch.tensor(rows)
    ids = torch.arange(mask.numel()).reshape(mask.shape) + 3
    # the general path (position_ids) on positions counting from 0 at each row's first real token
    pos = (torch.cumsum(mask, 1) - 1).clamp_min(0)
    want = pack(ids, mask, position_ids=pos)
    got, longest = trainer.pack_rows(ids, mask)
    for f in ("input_ids", "positions", "cu_seqlens", "rows", "cols", "seq_start", "seq_end"):
        a, b = getattr(got, f), getattr(want, f)
        assert a.dtype == b.dtype and torch.equal(a, b), (f, a, b)
    assert got.cu_host == tuple(want.cu_seqlens.tolist())
    lengths = mask.sum(1)
    assert longest == int(lengths.max())
    if mask.all():  # no mask: the layout from the shape alone
        full, longest = trainer.pack_rows(ids, None)
        assert longest == mask.shape[1] and full.cu_host == tuple(want.cu_seqlens.tolist())
        for f in ("input_ids", "positions", "cu_seqlens", "rows", "cols", "seq_start", "seq_end"):
            assert torch.equal(getattr(full, f), getattr(want, f)), f


# ---------------------------------------------------------------- controls
def test_control_a_planted_item_is_caught(model, monkeypatch):
    rms = K.rms_norm

    def planted(x, *a, **kw):
        x.detach().abs().max().item()
        return rms(x, *a, **kw)
    monkeypatch.setattr(K, "rms_norm", planted)
    reads = _reads(model, *_batch(masked=False))
    assert reads and all(w == "aten._local_scalar_dense" and "planted" in s for w, s in reads), reads


def test_control_attention_reads_back_without_the_host_bound(model, monkeypatch):
    _drop_host_bound(monkeypatch)
    reads = _reads(model, *_batch(masked=False))
    assert any("attention_prefill" in s for _, s in reads), reads

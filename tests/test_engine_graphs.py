"""CUDA-graph decode buckets: a real row's bits do not depend on the padded bucket it runs in.

On CPU there are no graphs; ``ModelRunner.simulate_buckets`` runs every pure-decode step eagerly on
exactly the padded inputs a graph replay gets (scratch block, padded rows decoding token 0), so the
padding / bucket logic is tested here; the capture itself is tested on the GPU
(benchmarks/engine/gpu_e2e.py, section diff, graphs on vs enforce_eager). The control pads into a real
sequence's block instead of the scratch block and the same comparison fails.
"""
from __future__ import annotations

import pytest

from bitmatch.engine import SamplingParams
from bitmatch.engine.model_runner import capture_sizes
from bitmatch.testing import same_outputs
from bitmatch.testing.models import random_prompts, tiny_model
from graph_buckets import one_request_in_buckets, padding_into_a_real_block, run


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _run(model, prompts, params, simulate, max_num_seqs=8):
    return run(model, prompts, params, simulate, max_num_seqs=max_num_seqs, num_gpu_blocks=256)


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(37) == [1, 2, 4, 8, 16, 24, 32, 37]


def test_padded_buckets_same_bits_as_unpadded(model):
    # 7 requests finishing at different times: decode steps of 7, 6, ..., 1 rows run in buckets
    # 8, 8, 4, 4, 4, 2, 1 (padded with 1..3 rows) and must give the unpadded bits
    prompts = random_prompts(7, 3, 30, seed=11)
    params = [SamplingParams(temperature=0.8, max_tokens=2 + i, ignore_eos=True, seed=i) for i in range(7)]
    _, ref = _run(model, prompts, params, simulate=False)
    eng, got = _run(model, prompts, params, simulate=True)
    assert same_outputs(ref, got)


def test_same_request_in_every_bucket(model):
    # one fixed request, alone and with 1, 3, 6 neighbours (buckets 1, 2, 4, 8): identical bits
    runs = one_request_in_buckets(model, (0, 1, 3, 6), max_tokens=5, neighbour_temperature=1.0)
    assert all(same_outputs([runs[0]], [r]) for r in runs[1:])


def test_control_padding_into_a_real_block_changes_bits(model, monkeypatch):
    # the control: padded rows write into a real sequence's block instead of the scratch block
    prompts = random_prompts(3, 20, 30, seed=12)
    params = [SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, seed=i) for i in range(3)]
    _, ref = _run(model, prompts, params, simulate=False)
    with padding_into_a_real_block(monkeypatch):
        _, got = _run(model, prompts, params, simulate=True)
    assert not same_outputs(ref, got)

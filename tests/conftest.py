import os

import pytest
import torch

os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/bitmatch-vllm-cache")


@pytest.fixture(autouse=True)
def _seeded():
    # every test draws the same random inputs whichever xdist worker runs it, so a control
    # that finds a mismatch finds it on every run
    torch.manual_seed(1234)
    yield

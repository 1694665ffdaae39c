"""The vLLM plugin's switch and gates, without starting an engine: the entry point vLLM loads in
every process, disabled = nothing changed, enabled = registered once however often it loads,
and the request check names each option that would change the reported logprob."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (pip install -e '.[vllm]' or scripts/install_vllm.sh)"),
]

_PROBE = r"""
import logging, os, sys
import bitmatch.adapters.vllm as bv
from vllm import ModelRegistry
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine.input_processor import InputProcessor
import vllm.v1.worker.gpu_model_runner as runner

def state():
    m = ModelRegistry.models["Qwen3ForCausalLM"]
    return (getattr(m, "module_name", type(m).__name__), runner.Sampler.__name__,
            getattr(EngineArgs.create_engine_config, "_bitmatch", False),
            getattr(InputProcessor._validate_params, "_bitmatch", False))

class Records(logging.Handler):
    seen = []
    def emit(self, record):
        self.seen.append((record.levelname, record.getMessage()))

logging.getLogger("vllm.bitmatch").addHandler(Records())
logging.getLogger("vllm.bitmatch").setLevel(logging.INFO)
bv.register(); bv.register()
print("disabled", state())
print("logged_disabled", repr(Records.seen))
bv.enable(); bv.register(); bv.enable()
print("enabled", state(), os.environ.get("BITMATCH"))
print("logged_enabled", repr(Records.seen))
print("expected_line", repr(bv.activation_message()))
# wrapped once, not once per load
print("single", not getattr(EngineArgs.create_engine_config.__wrapped__, "_bitmatch", False),
      not getattr(InputProcessor._validate_params.__wrapped__, "_bitmatch", False))
"""


def test_entry_point_is_installed():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("bitmatch") == "bitmatch.adapters.vllm:register", (
        f"vllm.general_plugins entry points: {eps}; run `pip install -e .` so vLLM's processes load the plugin")


def test_register_disabled_is_noop_and_enabled_is_idempotent():
    env = {k: v for k, v in os.environ.items() if k != "BITMATCH"}
    p = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    lines = dict(line.split(" ", 1) for line in p.stdout.strip().splitlines())
    disabled = eval(lines["disabled"])  # noqa: S307 - our own repr of a tuple of str/bool
    assert disabled[0] != "bitmatch.adapters.vllm.model" and disabled[1] == "Sampler"
    assert disabled[2:] == (False, False)
    assert lines["enabled"] == "('bitmatch.adapters.vllm.model', 'BitmatchSampler', True, True) 1"
    assert lines["single"] == "True True"
    # one INFO line when the plugin becomes active, none while disabled, none on repeated loads
    assert eval(lines["logged_disabled"]) == []  # noqa: S307
    (level, msg), = eval(lines["logged_enabled"])  # noqa: S307
    assert level == "INFO" and msg == eval(lines["expected_line"]), msg  # noqa: S307


def test_activation_line_names_version_backend_and_order_stamp():
    import bitmatch
    from bitmatch.adapters.vllm import activation_message
    from bitmatch.kernels.order import ORDER

    cpu, cuda = activation_message("cpu"), activation_message("cuda")
    ref, tri = ORDER.stamp("reference")["fingerprint"], ORDER.stamp("triton")["fingerprint"]
    assert f"bitmatch {bitmatch.__version__} " in cpu and "backend reference (cpu)" in cpu and ref in cpu, cpu
    assert "backend triton (cuda)" in cuda and tri in cuda, cuda
    assert ref != tri and tri not in cpu  # control: the line tells the two orders apart


def test_request_check_names_every_unsupported_option():
    from vllm import SamplingParams

    from bitmatch.adapters.vllm.checks import BitmatchUnsupportedError, check_request, unsupported_request_options

    assert unsupported_request_options(SamplingParams(temperature=0.7, logprobs=0), "processed_logprobs") == []
    sp = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, presence_penalty=0.5,
                        frequency_penalty=0.1, repetition_penalty=1.1, logit_bias={3: 1.0}, min_tokens=2)
    names = unsupported_request_options(sp, "processed_logprobs")
    for want in ("min_p=0.1", "presence_penalty=0.5", "frequency_penalty=0.1",
                 "repetition_penalty=1.1", "logit_bias", "min_tokens=2"):
        assert any(n.startswith(want) for n in names), (want, names)
    # raw_logprobs is the trainer's T = 1 log_softmax before any processing: these do not change it
    assert unsupported_request_options(sp, "raw_logprobs") == []
    assert not any(n.startswith(("top_k", "top_p")) for n in names)  # supported: bitmatch's mask
    with pytest.raises(BitmatchUnsupportedError, match="min_p=0.1"):
        check_request(SamplingParams(top_p=0.9, min_p=0.1), "processed_logprobs")


def test_engine_check_names_a_registered_family_the_plugin_does_not_run():
    """A family bitmatch runs in its own engine but not inside vLLM is refused with its reason."""
    from types import SimpleNamespace

    from bitmatch.adapters.vllm.checks import BitmatchUnsupportedError, check_engine_config
    from bitmatch.models import registry
    from bitmatch.models.dense import DenseFamily

    class NoVllm(DenseFamily):
        name = "probe-hybrid"
        model_types = {"probe_hybrid": "ProbeHybridForCausalLM"}
        vllm_supported = False
        vllm_refusal = "vLLM's CPU backend has no kernel for the probe mixer"

    registry.register(NoVllm())
    mc = SimpleNamespace(hf_config=SimpleNamespace(architectures=["ProbeHybridForCausalLM"]), quantization=None,
                         logprobs_mode="processed_logprobs", dtype=torch.bfloat16)
    cfg = SimpleNamespace(model_config=mc, parallel_config=SimpleNamespace(tensor_parallel_size=1,
                                                                            pipeline_parallel_size=1),
                          speculative_config=None, lora_config=None, cache_config=SimpleNamespace(cache_dtype="auto"))
    try:
        with pytest.raises(BitmatchUnsupportedError, match="probe-hybrid family.*no kernel for the probe mixer.*"
                                                           "bitmatch.Engine"):
            check_engine_config(cfg)
        mc.hf_config.architectures = ["Qwen3ForCausalLM"]
        check_engine_config(cfg)  # a supported family passes the same gate
        cfg.parallel_config.tensor_parallel_size = 2  # vLLM's K-split row-parallel layers: refused, pointing on
        with pytest.raises(BitmatchUnsupportedError,
                           match="tensor_parallel_size=2.*all-reduce.*enable_tensor_parallel"):
            check_engine_config(cfg)
    finally:
        registry._BY_MODEL_TYPE.pop("probe_hybrid", None)
        registry._BY_ARCH.pop("ProbeHybridForCausalLM", None)

"""bitmatch's vLLM plugin: rollout logprobs equal, bit for bit, to ``bitmatch.token_logprobs``.

Loaded by vLLM through the ``vllm.general_plugins`` entry point in every vLLM process (front
end, engine core, workers, the model-inspection subprocess). It does nothing unless enabled by
``BITMATCH=1`` in the environment, or by ``bitmatch.adapters.vllm.enable()`` before the engine
is built (which sets the variable, so the processes vLLM starts inherit it). When enabled:

- every architecture of a registered bitmatch family with a vLLM path (``bitmatch.models``)
  resolves to a bitmatch class (``model.py``) whose forward and logits are the family's, on
  vLLM's parameters and paged KV cache;
- the sampler reports ``kernels.token_logprobs`` for the sampled token, under the V1 model runner
  (``sampler.py``) and the V2 one (``sampler_v2.py``, where this vLLM ships it);
- an unsupported engine setting fails when the engine is configured, and an unsupported
  sampling option fails when the request is admitted, each naming what is unsupported
  (``checks.py``). Nothing falls back silently to vLLM's own kernels.

``register()`` is idempotent: vLLM may call it several times per process. When it activates
the plugin it logs one line (``activation_message``) through vLLM's logger: bitmatch's version,
the backend and the canonical-order stamp's fingerprint, so a run's log shows which bits it ran.

``VllmColocateSender`` (``weight_sync.py``): ``bitmatch.sync.publish`` into a vLLM engine through
its ``load_weights``; loaded on first use, since vLLM imports this package in every process.
"""
from __future__ import annotations

import importlib
import logging
import os

import bitmatch
from bitmatch import switch

ENV_VAR = switch.ENV_VAR
_registered = False
# a child of vLLM's "vllm" logger: printed by vLLM's handler, in its format, beside its own lines
logger = logging.getLogger("vllm.bitmatch")

__all__ = ["register", "enable", "is_enabled", "activation_message", "ENV_VAR", "model_classes",
           "VllmColocateSender"]
# name -> module of this package that defines it, imported on first access (bitmatch.sync, torch)
_LAZY = {"VllmColocateSender": "weight_sync"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def model_classes() -> dict[str, str]:
    """HF architecture -> "module:Class" of its bitmatch class (imported lazily by vLLM)."""
    from .checks import vllm_architectures

    return {arch: f"bitmatch.adapters.vllm.model:Bitmatch{arch}" for arch in vllm_architectures()}


def activation_message(device_type: str | None = None) -> str:
    """The line ``register`` logs: bitmatch's version, the backend of ``device_type`` (default: vLLM's
    platform) and the fingerprint of its canonical order (``bitmatch.kernels.order``), which
    ``bitmatch.sync`` compares between trainer and rollout."""
    from bitmatch.kernels.order import stamp_for_device

    if device_type is None:
        from vllm.platforms import current_platform
        device_type = current_platform.device_type
    stamp = stamp_for_device(device_type)
    return (f"bitmatch {bitmatch.__version__} vLLM plugin active: {len(model_classes())} architectures on "
            f"bitmatch kernels, backend {stamp['backend']} ({device_type}), canonical order v{stamp['version']} "
            f"stamp {stamp['fingerprint']}")


def is_enabled() -> bool:
    """``BITMATCH`` on, by the one rule every adapter uses (``bitmatch.switch``)."""
    return switch.enabled()


def enable() -> None:
    """Turn the plugin on for this process and every vLLM process it starts (call before the engine)."""
    os.environ[ENV_VAR] = "1"
    register()


def register() -> None:
    """The ``vllm.general_plugins`` entry point: a no-op unless enabled; safe to call repeatedly."""
    global _registered
    if _registered or not is_enabled():
        return
    try:
        from vllm import ModelRegistry
    except ImportError as e:
        raise ImportError("bitmatch.adapters.vllm needs vLLM: pip install 'bitmatch[vllm]' "
                          "(CPU: scripts/install_vllm.sh)") from e

    for arch, target in model_classes().items():
        # replaces vLLM's built-in class for this architecture (also for TRL, which cannot pass hf_overrides)
        ModelRegistry.register_model(arch, target)
    _select_v1_runner()
    _patch_sampler()
    _patch_engine_args()
    _patch_request_validation()
    _registered = True
    logger.info(activation_message())


V2_RUNNER_VAR = "VLLM_USE_V2_MODEL_RUNNER"


def _select_v1_runner() -> None:
    """vLLM 0.2x runs its V2 model runner by default on the GPU. Both runners' samplers are hooked, but
    V1 has the wider measured coverage (Qwen3-MoE on GPU vLLM): choose it unless the user chose a
    runner. Set in the environment, so the engine core and the workers vLLM starts inherit it;
    plugins load before the engine configuration is built."""
    if os.environ.get(V2_RUNNER_VAR) is None:
        os.environ[V2_RUNNER_VAR] = "0"
        logger.debug("bitmatch: %s=0 (the plugin runs under the V1 model runner)", V2_RUNNER_VAR)


def _patch_sampler() -> None:
    import vllm.v1.worker.gpu_model_runner as runner  # the CPU model runner subclasses it

    from .sampler import BitmatchSampler

    runner.Sampler = BitmatchSampler  # read when a model runner is built, after plugins load
    try:  # the V2 model runner (vLLM 0.2x's GPU default), where this vLLM ships it
        from . import sampler_v2
    except ImportError as e:
        logger.debug("bitmatch: no V2 model runner sampler hook (%s)", e)
        return
    sampler_v2.install()


def _patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs.create_engine_config
    if getattr(orig, "_bitmatch", False):
        return

    def create_engine_config(self, *args, **kwargs):
        from .checks import check_engine_config

        cfg = orig(self, *args, **kwargs)
        check_engine_config(cfg)  # in the caller's process, before any engine process starts
        return cfg

    create_engine_config._bitmatch = True
    create_engine_config.__wrapped__ = orig
    EngineArgs.create_engine_config = create_engine_config


def _patch_request_validation() -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    orig = InputProcessor._validate_params
    if getattr(orig, "_bitmatch", False):
        return

    def _validate_params(self, params, *args, **kwargs):
        from .checks import check_request

        out = orig(self, params, *args, **kwargs)
        if isinstance(params, SamplingParams):
            check_request(params, self.model_config.logprobs_mode)
        return out

    _validate_params._bitmatch = True
    _validate_params.__wrapped__ = orig
    InputProcessor._validate_params = _validate_params

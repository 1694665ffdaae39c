"""verl 0.9.1 on a CPU-only machine: the platform verl lacks, for CI and for trying the adapter without GPUs.

verl chooses its device through ``verl.plugin.platform`` (``VERL_PLATFORM``, else auto-detection,
else CUDA) and ships no CPU platform. ``register()`` adds one named ``cpu``: torch device ``cpu``,
gloo, no pinned memory, verl's FSDP engine registered for the ``cpu`` device. Its Ray resource is
``GPU``: verl's resource pools ask for one GPU per worker, and a local Ray takes declared GPUs at
their word (``ray.init(num_gpus=2)``), so ``RayPPOTrainer`` places its workers as on a GPU node
while every worker computes on CPU (inside them ``torch.cuda.is_available()`` is False).

Every process must have it before verl first asks for its platform, which ``import verl`` already
does while it loads the plugins (verl's FSDP engine module reads it at import). So the bitmatch
plugin registers it itself, first, in every process whose environment has ``VERL_PLATFORM=cpu``:
set it in the driver before ``import verl`` and in Ray's ``runtime_env`` ``env_vars``::

    os.environ["VERL_PLATFORM"] = "cpu"
    ray.init(num_cpus=16, num_gpus=2, runtime_env={"env_vars": {"VERL_PLATFORM": "cpu"}})
"""
from __future__ import annotations

import contextlib
import os

import torch


def _noop(*args, **kwargs):
    return None


class _CpuDevice:
    """``torch.cpu`` plus the memory queries verl makes of a device module (0 on CPU)."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name, lambda *a, **k: 0)

    def mem_get_info(self, *args):
        return 0, 0

    def get_device_name(self, *args):
        return "CPU"


def _platform_class():
    from verl.plugin.platform.platform_base import PlatformBase

    methods = dict(
        device_name=property(lambda s: "cpu"), vendor_name=property(lambda s: "cpu"),
        device_module=property(lambda s: _CpuDevice()), is_available=lambda s: True,
        current_device=lambda s: "cpu", device_count=lambda s: 1, set_device=_noop, synchronize=_noop,
        manual_seed=lambda s, x: torch.manual_seed(x), manual_seed_all=lambda s, x: torch.manual_seed(x),
        set_allocator_settings=_noop, empty_cache=_noop, get_device_capability=lambda s, i=0: (None, None),
        communication_backend_name=lambda s: "gloo", visible_devices_envvar=lambda s: "CUDA_VISIBLE_DEVICES",
        nvtx_range=lambda s, msg: contextlib.nullcontext(), profiler_start=_noop, profiler_stop=_noop,
        # Ray's declared GPUs: verl's pools and worker groups place by them (see the module doc)
        ray_resource_name=lambda s: "GPU", ray_noset_envvars=lambda s: [], is_ipc_supported=lambda s: False,
        cudart=lambda s: None)
    return type("PlatformCPU", (PlatformBase,), methods)


def register_platform() -> None:
    """Register verl's ``cpu`` platform (idempotent). Imports nothing that asks verl for its
    platform, so the plugin calls it first when ``VERL_PLATFORM=cpu``."""
    from verl.plugin.platform.platform_manager import PlatformRegistry

    if PlatformRegistry.get("cpu") is None:
        PlatformRegistry.register(platform="cpu")(_platform_class())


def register_engine() -> None:
    """verl's FSDP engine for the ``cpu`` device, and FSDP2's CPU offload without pinned memory
    (pinning needs an accelerator); idempotent. Its import reads the platform: after
    ``register_platform``."""
    import verl.workers.engine.fsdp.transformer_impl as ti
    from verl.workers.engine.base import EngineRegistry

    for backend in ("fsdp", "fsdp2"):
        EngineRegistry._engines["language_model"][backend].setdefault("cpu", ti.FSDPEngineWithLMHead)
    if not getattr(ti.CPUOffloadPolicy, "_bitmatch_cpu", False):
        policy = ti.CPUOffloadPolicy
        ti.CPUOffloadPolicy = lambda pin_memory=True: policy(pin_memory=False)
        ti.CPUOffloadPolicy._bitmatch_cpu = True
    # verl/utils/distributed.py:87 (initialize_global_process_group_ray) asks for the backend
    # "cpu:gloo,{device}:{comm backend}", which on the cpu device names cpu twice (torch refuses
    # "cpu:gloo,cpu:gloo"): the engine workers' call gets plain gloo
    import verl.workers.engine_workers as ew
    if not getattr(ew.initialize_global_process_group_ray, "_bitmatch_cpu", False):
        init = ew.initialize_global_process_group_ray

        def gloo_only(timeout_second=None, backend=None):
            return init(timeout_second=timeout_second, backend=backend or "gloo")
        gloo_only._bitmatch_cpu = True
        ew.initialize_global_process_group_ray = gloo_only


def requested() -> bool:
    """``VERL_PLATFORM=cpu`` in this process's environment."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"

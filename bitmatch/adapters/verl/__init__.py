"""verl adapter: ``actor_rollout_ref.rollout.name=bitmatch`` makes verl's rollout and actor logprobs
equal bit for bit, and every step proves it.

    pip install "bitmatch[verl]"     # verl 0.9.1; the plugin loads through the verl.plugins entry point
    python -m verl.trainer.main_ppo ... actor_rollout_ref.rollout.name=bitmatch \\
        actor_rollout_ref.rollout.calculate_log_probs=True actor_rollout_ref.actor.strategy=fsdp2

What the plugin does (``plugin.py``; verl 0.9.1):
- the rollout (``rollout.py``): ``bitmatch.Engine`` inside each hybrid worker on a rollout copy
  that receives the actor's weights through ``bitmatch.sync`` (fingerprints, version =
  ``global_steps``), registered in ``_ROLLOUT_REGISTRY`` and ``RolloutReplicaRegistry``;
- the actor and ref (``actor.py``): verl's FSDP2 engine on bitmatch kernels, ``log_probs`` =
  fp32 ``token_logprobs`` at verl's temperature instead of the bf16 ``logprobs_from_logits``;
- the check (``check.py``): each step, ``rollout_log_probs`` vs ``old_log_probs`` bit for bit,
  ``bitmatch/*`` metrics in verl's metric dict, policy raise / warn / log
  (``BITMATCH_ON_MISMATCH``), the shared message and repro bundle (``bitmatch.diagnostics.stepcheck``).
With the vLLM rollout (``rollout.name=vllm``) and the bitmatch vLLM plugin on (``BITMATCH=1`` in
the workers' environment) the actor patch and the check apply as well. Without GPUs:
``VERL_PLATFORM=cpu`` gives every verl process a CPU platform (``cpu.py``), and a local Ray's
declared GPUs (``+ray_kwargs.ray_init.num_gpus=2``) place verl's workers; tests/test_verl_ray.py
runs ``main_ppo`` that way.
"""
from __future__ import annotations

from bitmatch.diagnostics.stepcheck import BitmatchMismatchError, StepCheck

__all__ = ["require_plugin", "plugin_loaded", "BitmatchMismatchError", "StepCheck", "configure", "check_batch"]


def plugin_loaded() -> bool:
    """True when ``bitmatch.adapters.verl.plugin`` registered everything in this process."""
    import sys
    p = sys.modules.get("bitmatch.adapters.verl.plugin")
    return bool(p is not None and p.LOADED)


def require_plugin() -> None:
    """Raise unless the plugin is registered in this process (verl hides plugin load errors):
    imports it if ``import verl`` did not (entry points off, ``VERL_USE_EXTERNAL_PLUGINS``), and
    re-raises its load error with the fix."""
    if plugin_loaded():
        return
    import verl  # noqa: F401  (loads the entry points)

    from bitmatch.adapters.verl import plugin
    if plugin.LOAD_ERROR is not None:
        raise RuntimeError(f"bitmatch verl plugin failed to load: {plugin.LOAD_ERROR!r}. Check that verl==0.9.1 "
                           "and bitmatch are installed in this environment (pip install 'bitmatch[verl]')"
                           ) from plugin.LOAD_ERROR
    if not plugin.LOADED:
        plugin.register()


def configure(on_mismatch: str | None = None, repro_dir: str | None = None, max_bundles: int = 3):
    """Set the step check's policy (raise / warn / log) and repro folder for this process."""
    from bitmatch.adapters.verl import check
    return check.configure(on_mismatch, repro_dir, max_bundles)


def check_batch(batch, step: int | None = None, log_metrics=None):
    """The step check on a verl ``DataProto`` holding rollout_log_probs and old_log_probs."""
    from bitmatch.adapters.verl import check
    return check.check_batch(batch, step, log_metrics=log_metrics)

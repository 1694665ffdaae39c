"""The ``verl.plugins`` entry point: importing this module registers bitmatch with verl.

verl imports every ``verl.plugins`` entry point at the end of ``import verl`` and swallows any
exception at debug level (``verl/__init__.py``), so a broken plugin would only show up later as
"Rollout bitmatch with mode async not found". Here every failure is logged at ERROR level, kept
in ``LOAD_ERROR`` and re-raised by ``bitmatch.adapters.verl.require_plugin()``, which the
adapter's entry points (the rollout, the actor patch, the step check) call before doing anything.

What it registers (verl 0.9.1):
- ``_ROLLOUT_REGISTRY[("bitmatch", "async")]`` (worker side, ``verl/workers/rollout/base.py``):
  ``bitmatch.adapters.verl.rollout.BitmatchRollout``, built by ``ActorRolloutRefWorker.init_model``
  for ``actor_rollout_ref.rollout.name=bitmatch``;
- ``RolloutReplicaRegistry["bitmatch"]`` (driver side, ``verl/workers/rollout/replica.py``);
- a wrapper around ``ActorRolloutRefWorker.init_model`` that puts the actor and ref engines on
  bitmatch kernels after verl built them (``bitmatch.adapters.verl.actor``);
- a wrapper around ``verl.utils.debug.metrics.calculate_debug_metrics`` (the trainer imports it
  at each step, beside ``training/rollout_probs_diff_*``) that runs the bitmatch step check;
- with ``VERL_PLATFORM=cpu`` in the environment, a CPU platform (``cpu.py``), registered first:
  verl has none, and ``import verl`` asks for its platform while it loads this plugin.
"""
from __future__ import annotations

import logging

from bitmatch.adapters.verl import cpu

logger = logging.getLogger("bitmatch.verl")

ROLLOUT_CLASS = "bitmatch.adapters.verl.rollout.BitmatchRollout"
LOADED = False
LOAD_ERROR: BaseException | None = None


def _load_replica():
    from bitmatch.adapters.verl.rollout import BitmatchReplica
    return BitmatchReplica


def register() -> None:
    """Register the rollout (both registries), the actor patch and the step check; idempotent."""
    global LOADED
    if cpu.requested():   # before the imports below, which ask verl for its platform
        cpu.register_platform()
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    _ROLLOUT_REGISTRY[("bitmatch", "async")] = ROLLOUT_CLASS
    RolloutReplicaRegistry.register("bitmatch", _load_replica)
    from bitmatch.adapters.verl import actor, check
    actor.install()
    check.install()
    if cpu.requested():
        cpu.register_engine()
    LOADED = True


try:
    register()
except Exception as e:  # verl would hide this at debug level: say it loudly, keep it for require_plugin()
    LOAD_ERROR = e
    logger.error("bitmatch verl plugin failed to load: %r (actor_rollout_ref.rollout.name=bitmatch will not work; "
                 "bitmatch.adapters.verl.require_plugin() raises it)", e, exc_info=True)

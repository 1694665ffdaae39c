"""verl adapter end to end on CPU: verl 0.9.1's own hybrid worker and trainer code, in one process.

``ActorRolloutRefWorker`` (FSDP2 actor and ref on gloo, the ``bitmatch`` rollout built through
verl's ``_ROLLOUT_REGISTRY``), ``update_weights`` every step, ``RayPPOTrainer``'s own
``_compute_old_log_prob`` / ``_compute_ref_log_prob`` / ``_update_actor``, ``compute_advantage``
(GRPO), ``calculate_debug_metrics`` and ``compute_rollout_correction_and_add_to_batch``
(``examples/verl_grpo.py`` drives them). verl's Ray trainer itself (``RayPPOTrainer.fit``) runs in
tests/test_verl_ray.py.
Runs in the verl environment (scripts/test_verl.sh); skipped where verl is not installed.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import pathlib

import pytest

pytest.importorskip("verl")
torch = pytest.importorskip("torch")

_EX = pathlib.Path(__file__).resolve().parents[1] / "examples" / "verl_grpo.py"
STEPS = 3


def _example():
    spec = importlib.util.spec_from_file_location("bitmatch_example_verl_grpo", _EX)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ex = _example()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    ex.cpu_setup()
    return ex.save_tiny_model(str(tmp_path_factory.mktemp("verl") / "model"))


@pytest.fixture(scope="module")
def bitmatch_worker(model_dir):
    import bitmatch.adapters.verl as bv
    bv.configure(on_mismatch="raise", repro_dir=os.path.join(os.path.dirname(model_dir), "repro"))
    cfg = ex.make_config(model_dir, steps=STEPS)
    return cfg, ex.build_worker(cfg), bv


def _actor_fingerprints(worker):
    from bitmatch.sync import fingerprints
    params, _ = worker.actor.engine.get_per_tensor_param()
    return fingerprints(list(params), dtype=torch.float32)


def test_plugin_loaded_through_the_entry_point():
    import verl  # noqa: F401
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY, get_rollout_class
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    import bitmatch.adapters.verl as bv
    from bitmatch.adapters.verl.rollout import BitmatchReplica, BitmatchRollout

    assert bv.plugin_loaded()                                     # loaded by `import verl`, not by us
    assert get_rollout_class("bitmatch", "async") is BitmatchRollout
    assert ("bitmatch", "async") in _ROLLOUT_REGISTRY
    assert RolloutReplicaRegistry.get("bitmatch") is BitmatchReplica
    import verl.utils.debug.metrics as dm
    assert getattr(dm.calculate_debug_metrics, "_bitmatch", False)


def test_plugin_load_error_is_loud(monkeypatch):
    from bitmatch.adapters.verl import plugin, require_plugin

    monkeypatch.setattr(plugin, "LOADED", False)
    monkeypatch.setattr(plugin, "LOAD_ERROR", ImportError("no module named verl.workers.rollout.base"))
    with pytest.raises(RuntimeError, match="bitmatch verl plugin failed to load"):
        require_plugin()


def test_grpo_steps_diff_zero(bitmatch_worker):
    """3 GRPO steps with optimizer updates and a verified weight sync before each rollout:
    0 mismatching tokens, bitmatch/diff_max 0, rollout_corr/k3_kl 0, verl's own probs diff 0."""
    cfg, worker, bv = bitmatch_worker
    before = _actor_fingerprints(worker)
    hist = []
    for step in range(1, STEPS + 1):
        m = ex.grpo_step(worker, cfg, step)
        hist.append(m)
        assert m["bitmatch/mismatch_tokens"] == 0.0 and m["bitmatch/diff_max"] == 0.0, m
        assert m["rollout_corr/k3_kl"] == 0.0 and m["training/rollout_probs_diff_max"] == 0.0, m
        assert worker.rollout.receiver.version == step          # bitmatch.sync version = global_steps
    checks = bv.check.checker().history
    assert [c.step for c in checks] == [1, 2, 3] and all(c.total > 0 and c.mismatches == 0 for c in checks)
    # the zeros are over tokens and sequences that were compared, and verl's metric dict says how many
    assert [(h["bitmatch/compared_tokens"], h["bitmatch/compared_seqs"]) for h in hist] == \
        [(float(c.total), float(c.seqs)) for c in checks] and all(c.seqs > 0 for c in checks), hist
    assert any(h["actor/pg_loss"][0] != 0.0 for h in hist)     # a real policy-gradient signal
    after = _actor_fingerprints(worker)
    assert any(before[k] != after[k] for k in before), "no optimizer step changed an actor weight"
    # the last update left the rollout one version behind; verl's next sync makes it hold exactly
    # the actor's weights (bf16 casts, fingerprint-verified) under the next version

    def stale():
        params, _ = worker.actor.engine.get_per_tensor_param()
        return worker.rollout.copy.differing(list(params))

    assert stale()
    asyncio.run(worker.update_weights(global_steps=STEPS + 1, mode="naive"))
    assert stale() == [] and worker.rollout.receiver.version == STEPS + 1


def test_fault_in_rollout_weights_raises_and_names_layer(bitmatch_worker):
    """A corrupted rollout weight (after the verified sync) is caught at that step, located."""
    cfg, worker, bv = bitmatch_worker

    def corrupt(w, step):
        with torch.no_grad():
            # through .data, behind the receiver's version counters (an in-place mul_ is refused before
            # the step: tests/test_sync_security.py), so the step check must find and name it
            w.rollout.model.model.layers[1].mlp.down_proj.weight.data.mul_(1.5)

    with pytest.raises(bv.BitmatchMismatchError) as ei:
        ex.grpo_step(worker, cfg, STEPS + 2, after_sync=corrupt)
    msg = str(ei.value)
    assert f"at step {STEPS + 2}" in msg and "First divergence: sequence" in msg and "(0x" in msg
    assert "First divergent layer: layers.1.mlp.down_proj" in msg
    assert "'model.layers.1.mlp.down_proj.weight'" in msg
    path = bv.check.checker().history[-1].bundle
    assert path and path in msg
    cfg_json = json.load(open(os.path.join(path, "config.json")))
    assert cfg_json["step"] == STEPS + 2 and cfg_json["first_divergence"]["rollout_hex"].startswith("0x")
    tokens = torch.load(os.path.join(path, "tokens.pt"))
    assert tokens["responses"].shape == tokens["rollout_logprobs"].shape


def test_control_stock_actor_has_nonzero_diff(bitmatch_worker, model_dir):
    """The same loop with the actor left stock (verl's bf16 autocast logprobs): every step differs,
    and verl's own rollout_corr/k3_kl sees it."""
    import bitmatch.adapters.verl as bv
    bv.configure(on_mismatch="log", repro_dir=os.path.join(os.path.dirname(model_dir), "repro_control"))
    cfg = ex.make_config(model_dir, bitmatch=False, steps=2)
    worker = ex.build_worker(cfg)
    assert not getattr(worker.actor.engine, "_bitmatch_patched", False)
    for step in (1, 2):
        m = ex.grpo_step(worker, cfg, step)
        assert m["bitmatch/mismatch_tokens"] > 0 and m["bitmatch/diff_max"] > 0, m
        assert m["rollout_corr/k3_kl"] > 0, m


def test_config_refusals_name_the_setting():
    from types import SimpleNamespace as NS

    from bitmatch.adapters.verl.rollout import check_rollout_config

    ok = dict(calculate_log_probs=True, temperature=0.9, do_sample=True, top_k=-1, top_p=1.0, dtype="bfloat16",
              tensor_model_parallel_size=1, data_parallel_size=1, pipeline_model_parallel_size=1)
    check_rollout_config(NS(**ok))
    for bad, key in ((dict(calculate_log_probs=False), "calculate_log_probs=True"), (dict(top_p=0.9), "top_p"),
                     (dict(top_k=5), "top_k"), (dict(temperature=0.0), "temperature"),
                     (dict(tensor_model_parallel_size=2), "tensor"), (dict(dtype="float16"), "dtype")):
        with pytest.raises(ValueError, match=key):
            check_rollout_config(NS(**{**ok, **bad}))

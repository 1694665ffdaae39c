"""Real vLLM (CPU build) with the bitmatch plugin: every sampled token's reported logprob equals
``bitmatch.token_logprobs`` on the patched HF model, bit for bit.

Each test runs vLLM in a child process (this file run as a script: the plugin's enable/disable
is per process, and vLLM's engine is in-process there, VLLM_ENABLE_V1_MULTIPROCESSING=0); the
child writes the sampled tokens and reported logprobs to JSON, and the test recomputes them on
the trainer side. 64 prompts of 2..56 tokens (temperatures 0.7 and 1.0 alternating) with
``max_num_batched_tokens`` 32/64 force chunked prefill; ``max_num_seqs`` 1, 8 and 64 change the
batches every token is computed in.
"""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (pip install -e '.[vllm]' or scripts/install_vllm.sh)"),
]

N_PROMPTS, MAX_TOKENS, TEMPS, MAX_PROMPT = 64, 8, (0.7, 1.0), 56
ENGINES = [dict(max_num_seqs=1, max_num_batched_tokens=32), dict(max_num_seqs=8, max_num_batched_tokens=32),
           dict(max_num_seqs=64, max_num_batched_tokens=64)]
MODELS = {  # name -> (family, overrides, engines): Qwen3 untied (q/k norms, GQA 4), Llama tied (GQA 2),
    # and one engine each for Qwen2 (q/k/v bias: sliced like the weights) and Mistral
    "qwen3": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=64, tie_word_embeddings=False),
              ENGINES),
    "llama": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
              ENGINES),
    "qwen2": ("qwen2", dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64), ENGINES[1:2]),
    "mistral": ("mistral", dict(num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                                tie_word_embeddings=True), ENGINES[2:]),
    # Qwen3-MoE (8 experts top-2, a dense layer between sparse ones): vLLM's FusedMoE holds the experts
    "qwen3moe": ("qwen3moe-e8-k2", dict(), ENGINES[1:2]),
}


def _prompts():
    from bitmatch.testing.models import random_prompts

    return random_prompts(N_PROMPTS, min_len=2, max_len=MAX_PROMPT, seed=7)


def _write_checkpoint(path, name, seed=0, **extra):
    from bitmatch.testing.models import tiny_model

    family, overrides, _ = MODELS[name]
    model = tiny_model(family, dtype=torch.bfloat16, seed=seed, **{**overrides, **extra})
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    return str(path)


# ----------------------------------------------------------------------------------- child side

def _generate(llm, spec):
    import vllm

    prompts, temps = spec["prompts"], spec["temps"]
    reqs = [{"prompt_token_ids": p} for p in prompts]
    params = [vllm.SamplingParams(temperature=t, max_tokens=spec["max_tokens"], logprobs=0) for t in temps]
    outs = llm.generate(reqs, params, use_tqdm=False)
    rows = []
    for i, (o, t) in enumerate(zip(outs, temps)):
        c = o.outputs[0]
        rows.append([i, t, list(c.token_ids),
                     [lp[tok].logprob for lp, tok in zip(c.logprobs, c.token_ids)]])
    return rows


def _perturbed(src, seed):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.05)
    return model


def _child(spec):
    if spec["plugin"] == "enable()":
        import bitmatch.adapters.vllm as bv

        bv.enable()
    # plugin == "env": BITMATCH=1 set by the parent; vLLM loads the plugin through its entry point
    import vllm

    from bitmatch.adapters.vllm import VllmColocateSender

    prompts, result = spec["prompts"], {"runs": [], "errors": {}}
    for i, eng in enumerate(spec["engines"]):
        llm = vllm.LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                       gpu_memory_utilization=0.1, max_model_len=128,
                       logprobs_mode="processed_logprobs", **eng)
        result["runs"].append({"label": f"max_num_seqs={eng['max_num_seqs']}", "weights": spec["model"],
                               "rows": _generate(llm, spec)})
        last = i == len(spec["engines"]) - 1
        for k, (path, how) in enumerate(spec.get("updates", []) if last else []):
            new = _perturbed(spec["model"], seed=100 + k)
            VllmColocateSender(llm, use_rpc=how == "collective_rpc").send(new, version=k + 1)
            new.save_pretrained(path)
            result["runs"].append({"label": f"after update via {how}", "weights": path,
                                   "rows": _generate(llm, spec)})
        if last and spec.get("bad_request"):
            try:
                llm.generate([{"prompt_token_ids": prompts[0]}], vllm.SamplingParams(min_p=0.1, logprobs=0))
                result["errors"]["top_p"] = None
            except Exception as e:  # noqa: BLE001 - the message is what the test checks
                result["errors"]["top_p"] = f"{type(e).__name__}: {e}"
        del llm
        gc.collect()
    for key, kwargs in spec.get("bad_engines", {}).items():
        try:
            vllm.LLM(skip_tokenizer_init=True, gpu_memory_utilization=0.1, max_model_len=128, **kwargs)
            result["errors"][key] = None
        except Exception as e:  # noqa: BLE001
            result["errors"][key] = f"{type(e).__name__}: {e}"
    with open(spec["out"], "w") as f:
        json.dump(result, f)


def _run_child(tmp_path, multiprocess=False, temps=TEMPS, **spec):
    # everything the child generates from travels in the spec (the child may run newer code)
    prompts = _prompts()
    # the temperatures alternate over the prompts: all in every batch, a fraction of the CPU time
    spec.update(prompts=prompts, temps=[temps[i % len(temps)] for i in range(len(prompts))],
                max_tokens=MAX_TOKENS, out=str(tmp_path / "result.json"))
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # collective_rpc with a function (multi-process)
    env.pop("BITMATCH", None)
    if spec["plugin"] == "env":
        env["BITMATCH"] = "1"
    p = subprocess.run([sys.executable, __file__, str(spec_path)], env=env, capture_output=True, text=True,
                       timeout=1500)
    assert p.returncode == 0, f"vLLM child failed (rc {p.returncode}):\n{p.stderr[-6000:]}"
    return json.loads((tmp_path / "result.json").read_text())


# --------------------------------------------------------------------------------- trainer side

def _compare(run, models):
    """(tokens compared, list of mismatches) of one run against bitmatch.token_logprobs."""
    import transformers

    import bitmatch
    from bitmatch.testing.models import pad_batch

    if run["weights"] not in models:
        m = transformers.AutoModelForCausalLM.from_pretrained(run["weights"], dtype=torch.bfloat16).eval()
        models[run["weights"]] = bitmatch.patch(m)
    model, prompts = models[run["weights"]], _prompts()
    total, bad = 0, []
    for t in sorted({r[1] for r in run["rows"]}):
        rows = [r for r in run["rows"] if r[1] == t and r[2]]
        ids, mask = pad_batch([prompts[i] + toks for i, _, toks, _ in rows], "right")
        with torch.no_grad():  # greedy requests (T = 0) report the T = 1 logprob, as vLLM defines it
            ref = bitmatch.token_logprobs(model, ids, mask, temperature=t if t > 0 else 1.0)
        for k, (i, _, toks, lps) in enumerate(rows):
            start = len(prompts[i]) - 1
            got = torch.tensor(lps, dtype=torch.float32)
            want = ref[k, start:start + len(toks)]
            total += len(toks)
            for j in (got != want).nonzero().flatten().tolist():
                bad.append((run["label"], t, i, j, float(got[j]), float(want[j])))
    return total, bad


def _assert_all_equal(result):
    models, total, bad = {}, 0, []
    for run in result["runs"]:
        n, b = _compare(run, models)
        assert n >= N_PROMPTS, f"{run['label']}: only {n} tokens sampled"
        total += n
        bad += b
    print(f"\n{total} sampled tokens compared bitwise over {len(result['runs'])} engine runs")
    assert not bad, f"{len(bad)} of {total} logprobs differ (label, T, prompt, pos, vllm, trainer): {bad[:10]}"
    return total


@pytest.mark.parametrize("name", sorted(MODELS))
def test_vllm_logprobs_bitwise_equal_trainer(tmp_path, name):
    ckpt = _write_checkpoint(tmp_path / name, name)
    spec = dict(model=ckpt, plugin="enable()", engines=MODELS[name][2])
    if name == "qwen3":  # weight updates pushed into the running engine, both transport paths
        spec.update(updates=[(str(tmp_path / "v1"), "load_weights"), (str(tmp_path / "v2"), "collective_rpc")],
                    bad_request=True)
    # Mistral's single engine also mixes greedy requests into the batches
    result = _run_child(tmp_path, temps=TEMPS + (0.0,) if name == "mistral" else TEMPS, **spec)
    _assert_all_equal(result)
    if name == "qwen3":
        assert [r["label"] for r in result["runs"]][-2:] == ["after update via load_weights",
                                                            "after update via collective_rpc"]
        err = result["errors"]["top_p"]  # the key's old name: min_p is refused (top-p is supported)
        assert err is not None and "min_p=0.1" in err and "bitmatch" in err, err


def test_vllm_multiprocess_engine_enabled_by_env(tmp_path):
    """BITMATCH=1 only: vLLM's entry point loads the plugin in its engine-core process; the
    weight update crosses the process boundary through collective_rpc."""
    ckpt = _write_checkpoint(tmp_path / "llama", "llama")
    result = _run_child(tmp_path, multiprocess=True, model=ckpt, plugin="env", engines=ENGINES[1:2],
                        updates=[(str(tmp_path / "v1"), "collective_rpc")])
    assert [r["label"] for r in result["runs"]] == ["max_num_seqs=8", "after update via collective_rpc"]
    _assert_all_equal(result)


@pytest.mark.parametrize("name", ["qwen3", "qwen3moe"])
def test_vllm_control_plugin_disabled_mismatches(tmp_path, name):
    ckpt = _write_checkpoint(tmp_path / name, name)
    result = _run_child(tmp_path, model=ckpt, plugin="off", engines=ENGINES[1:2])
    total, bad = _compare(result["runs"][0], {})
    print(f"\nplugin disabled: {len(bad)} of {total} logprobs differ from the trainer's")
    assert total >= N_PROMPTS and len(bad) > total // 2, (len(bad), total)


def test_vllm_unsupported_options_fail_at_engine_start(tmp_path):
    import transformers

    ckpt = _write_checkpoint(tmp_path / "qwen3", "qwen3")
    windowed = _write_checkpoint(tmp_path / "mistral-sw", "mistral", sliding_window=16)
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=128, vocab_size=128, n_positions=256)
    gpt2 = transformers.GPT2LMHeadModel(cfg).to(torch.bfloat16)
    gpt2.config.architectures = ["GPT2LMHeadModel"]
    gpt2.save_pretrained(tmp_path / "gpt2")
    bad = {"logprobs_mode": dict(model=ckpt, logprobs_mode="processed_logits"),
           "architecture": dict(model=str(tmp_path / "gpt2"), logprobs_mode="processed_logprobs"),
           "speculative": dict(model=ckpt, logprobs_mode="processed_logprobs",
                               speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                   "prompt_lookup_max": 3}),
           # raised where the model is built (in-process here; a worker's log in multi-process mode)
           "sliding_window": dict(model=windowed, logprobs_mode="processed_logprobs")}
    result = _run_child(tmp_path, model=ckpt, plugin="enable()", engines=[], bad_engines=bad)
    errs = result["errors"]
    want = {"logprobs_mode": "logprobs_mode='processed_logits'", "architecture": "GPT2LMHeadModel",
            "speculative": "speculative decoding", "sliding_window": "sliding-window attention"}
    for key, text in want.items():
        assert errs[key] is not None and text in errs[key] and "bitmatch" in errs[key], (key, errs[key])


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        _child(json.load(f))

"""Real vLLM (CPU build) with the bitmatch plugin under top-k / top-p: tokens are drawn from
bitmatch's mask and the reported ``processed_logprobs`` equal, bit for bit,
``bitmatch.token_logprobs(model, ids, mask, T, top_k=, top_p=)``; the unmasked trainer logprob
(the control) differs. One small engine (chunked prefill, batches of 8) in a child process, the
(T, k, p) grid mixed in its batches with plain and greedy requests."""
from __future__ import annotations

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

# (temperature, top_k, top_p): top-k only, top-p only, both, plain and greedy rows in one batch
GRID = [(0.7, 5, 1.0), (1.0, -1, 0.8), (1.3, 20, 0.9), (1.0, 3, 0.5), (0.9, 40, 0.95), (1.0, -1, 1.0),
        (0.0, -1, 1.0)]
N_PROMPTS, MAX_TOKENS = 28, 6


def _child(spec):
    import bitmatch.adapters.vllm as bv

    bv.enable()
    import vllm

    llm = vllm.LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                   gpu_memory_utilization=0.1, max_model_len=128, logprobs_mode="processed_logprobs",
                   max_num_seqs=8, max_num_batched_tokens=32)
    params = [vllm.SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=spec["max_tokens"], logprobs=0,
                                  ignore_eos=True)
              for t, k, p in spec["grid"]]
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
    rows = [[list(o.outputs[0].token_ids), [lp[tok].logprob for lp, tok in zip(o.outputs[0].logprobs,
                                                                                o.outputs[0].token_ids)]]
            for o in outs]
    with open(spec["out"], "w") as f:
        json.dump(rows, f)


def test_vllm_top_k_top_p_processed_logprobs_bitwise_equal_trainer(tmp_path):
    import transformers

    import bitmatch
    from bitmatch.testing.models import pad_batch, random_prompts
    from test_vllm_logprobs import _write_checkpoint

    ckpt = _write_checkpoint(tmp_path / "qwen3", "qwen3")
    prompts = random_prompts(N_PROMPTS, min_len=2, max_len=40, seed=3)
    grid = [GRID[i % len(GRID)] for i in range(N_PROMPTS)]
    spec = dict(model=ckpt, prompts=prompts, grid=grid, max_tokens=MAX_TOKENS, out=str(tmp_path / "out.json"))
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="nobind")
    env.pop("BITMATCH", None)
    p = subprocess.run([sys.executable, __file__, str(tmp_path / "spec.json")], env=env, capture_output=True,
                       text=True, timeout=1500)
    assert p.returncode == 0, f"vLLM child failed (rc {p.returncode}):\n{p.stderr[-6000:]}"
    rows = json.loads((tmp_path / "out.json").read_text())

    model = bitmatch.patch(transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval())
    total = bad = control = masked_tokens = 0
    for t, k, pp in GRID:
        idx = [i for i, g in enumerate(grid) if g == (t, k, pp)]
        ids, mask = pad_batch([prompts[i] + rows[i][0] for i in idx], "right")
        T = t if t > 0 else 1.0  # greedy rows report the T = 1 logprob, unmasked (vLLM's definition)
        kk, pk = (k, pp) if t > 0 else (None, None)
        with torch.no_grad():
            want = bitmatch.token_logprobs(model, ids, mask, temperature=T, top_k=kk, top_p=pk)
            full = bitmatch.token_logprobs(model, ids, mask, temperature=T)
        for b, i in enumerate(idx):
            toks, lps = rows[i]
            got = torch.tensor(lps, dtype=torch.float32)
            a = len(prompts[i]) - 1
            ref = want[b, a:a + len(toks)]
            assert torch.isfinite(got).all(), f"prompt {i} (T={t}, k={k}, p={pp}): a token outside bitmatch's mask"
            bad += int((got.view(torch.int32) != ref.view(torch.int32)).sum())
            total += len(toks)
            if t > 0 and (k > 0 or pp < 1):
                masked_tokens += len(toks)
                control += int((got.view(torch.int32) != full[b, a:a + len(toks)].view(torch.int32)).sum())
    print(f"\n{total} vLLM tokens under top-k/top-p compared bitwise; {bad} differ; control {control} of "
          f"{masked_tokens} masked tokens differ from the full-vocabulary logprob")
    assert total == N_PROMPTS * MAX_TOKENS and bad == 0
    assert control > masked_tokens // 2


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        _child(json.load(f))

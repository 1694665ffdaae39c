"""Qwen3-MoE end to end on one device: bitmatch.Engine vs bitmatch.token_logprobs (Diff = 0 over
several batch / schedule configs) and the control (HF's own MoE forward), plus engine decode
tokens/s against the same engine with HF's own MoE block (its default experts implementation).

    python benchmarks/moe_e2e.py --out DIR [--device cuda] [--hidden 1024 --experts 32 --top-k 4 ...]

Writes DIR/moe_e2e.json with the command, machine and versions. Random weights, bf16.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch


def build(a, device):
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=128, num_experts=a.experts,
        num_experts_per_tok=a.top_k, moe_intermediate_size=a.inter, norm_topk_prob=True, decoder_sparse_step=1,
        max_position_embeddings=4096, initializer_range=0.02, router_aux_loss_coef=0.0)
    torch.manual_seed(a.seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(device).eval()


def diff_check(model, hf, prompts, device, temperature):
    import bitmatch
    from bitmatch.testing_models import pad_batch

    rows = []
    for label, kw in (("64 seqs, chunked 512", dict(max_num_seqs=64, max_num_batched_tokens=512)),
                      ("3 seqs, block 32, 97-token steps", dict(max_num_seqs=3, max_num_batched_tokens=97,
                                                               block_size=32)),
                      ("1 seq, no chunking", dict(max_num_seqs=1, enable_chunked_prefill=False,
                                                  max_num_batched_tokens=4096))):
        eng = bitmatch.Engine(model, kv_cache_bytes=4 << 30, **kw)
        params = [bitmatch.SamplingParams(temperature=temperature, max_tokens=16, seed=i) for i in range(len(prompts))]
        outs = eng.generate(prompts, params, use_tqdm=False)
        seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
        mism = tot = ctrl = 0
        for s in range(0, len(seqs), 5):
            group = list(reversed(seqs[s:s + 5]))      # other batch, other order than the engine's
            ids, mask = pad_batch(group, "right")
            ids, mask = ids.to(device), mask.to(device)
            with torch.no_grad():
                lp = bitmatch.token_logprobs(model, ids, mask, temperature=temperature)
                stock = torch.log_softmax(hf(input_ids=ids, attention_mask=mask).logits.float() / temperature, -1)
            for b, seq in enumerate(group):
                o = outs[seqs.index(seq)]
                p, c = len(o.prompt_token_ids), len(o.outputs[0].token_ids)
                got = torch.tensor(o.outputs[0].logprobs, device=device)
                want = lp[b, p - 1:p + c - 1]
                toks = ids[b, p:p + c]
                st = stock[b, p - 1:p + c - 1].gather(-1, toks[:, None])[:, 0]
                mism += int((got != want).sum())
                ctrl += int((got != st).sum())
                tot += c
        rows.append({"config": label, "tokens": tot, "mismatches": mism, "control_stock_hf_mismatches": ctrl})
    return rows


def decode_speed(model, prompts, a):
    import bitmatch

    eng = bitmatch.Engine(model, kv_cache_bytes=8 << 30, max_num_seqs=len(prompts), max_num_batched_tokens=8192)
    params = bitmatch.SamplingParams(temperature=1.0, max_tokens=a.new_tokens, ignore_eos=True)
    eng.generate(prompts, params, use_tqdm=False)  # warm up on the same batch: every Triton config compiled
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = eng.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64, help="decode batch of the speed run")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    import copy

    import transformers

    import bitmatch
    from bitmatch.testing_models import random_prompts

    dev = torch.device(a.device)
    hf = build(a, dev)
    model = bitmatch.patch(copy.deepcopy(hf))
    prompts = random_prompts(a.prompts, 8, a.prompt_len, seed=1, vocab_hi=a.vocab - 1)
    res = {"command": " ".join([sys.executable] + sys.argv), "machine": platform.node(),
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "bitmatch": bitmatch.__version__}, "args": vars(a)}
    res["diff"] = diff_check(model, hf, prompts, dev, 0.9)
    if dev.type == "cuda":
        speed_prompts = random_prompts(a.batch, a.prompt_len, a.prompt_len, seed=2, vocab_hi=a.vocab - 1)
        ours = decode_speed(model, speed_prompts, a)
        import bitmatch.models.qwen3_moe as qm

        # the same engine with HF's own MoE block (its default experts implementation) in the sparse layers
        orig = qm._moe_block
        qm._moe_block = lambda mod, x, dtype, rec=None, prefix="mlp": type(mod).forward(mod, x[None])[0]
        try:
            stock = decode_speed(model, speed_prompts, a)
        finally:
            qm._moe_block = orig
        res["rollout"] = {"batch": a.batch, "tokens_per_s": ours, "stock_moe_block_tokens_per_s": stock,
                          "ratio": ours / stock}
    with open(f"{a.out}/moe_e2e.json", "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""Nemotron-H end to end on one device: bitmatch vs HF with the real Mamba kernels, side by side in one run.

Random-weight Nemotron-H, bf16 (default: hidden 2048, 8 blocks Mamba2 / MoE / attention / MLP x 2,
64 Mamba heads x 64, 8 groups, state 128, chunk 128, conv 4; 32 attention heads x 128, 8 KV heads;
MoE 64 experts top-6 of width 1024 + a shared expert; vocab 131072). HF's Mamba mixer takes each
kernel from its package when importable (transformers' per-function lookup): ``--mamba-src`` (an
unpacked mamba-ssm sdist: its Triton ``mamba_chunk_scan_combined``, ``selective_state_update`` and
``mamba_split_conv1d_scan_combined``, imported without the package's compiled __init__) and
``--causal-conv1d-path`` (a folder holding a built ``causal_conv1d``, e.g. built on the GPU machine
with nvcc). The JSON says which implementation each HF function resolved to (``hf_kernels``).
Without causal_conv1d, mamba_ssm's fused split-conv1d scan (which calls causal_conv1d's CUDA
extension) is withheld from HF, so HF runs its torch conv with the Triton scan.

Sections (the JSON is rewritten after each; ``--budget-s`` skips what would start too late):
- diff: bitmatch.Engine (decode CUDA graphs on where the family opts in) in two batch/schedule
  configs vs bitmatch.token_logprobs on the same tokens; control: HF's own forward (want > 0).
- rollout: B in --batches, --prompt-len random tokens, --new-tokens sampled at T = 1: the engine
  with graphs, the same engine eager, HF ``generate`` (its hybrid cache and Mamba kernels).
- diff_blocks: the diff on one-block models of each block type in --diff-blocks (same widths):
  which block type's ops differ between the engine and the trainer.
- locate: ``bitmatch.diagnostics.verify.locate_pair("engine")`` on the whole model (a few prompts, the first
  diff config's step budget): the first op whose bits differ, as a table.
- train: fwd + bwd of token_logprobs on the patched model vs HF's own forward + backward (training
  mode: the fused split-conv1d scan when HF has it), --train-shape tokens: step time, tokens/s,
  peak memory above the weights, top kernels, host syncs per step; each parameter's gradient against
  HF's (same weights).

  python benchmarks/families/nemotron_h_e2e.py --out DIR --mamba-src .whl/mamba_ssm-2.3.2.post1
      [--causal-conv1d-path DIR] [--sections diff,rollout,train] [--batches 32,64]
  python benchmarks/families/nemotron_h_e2e.py --out DIR --device cpu --smoke   (tiny shapes: the logic only)

Writes DIR/nemotron_h_e2e.json (command, machine, versions, every figure).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common, the groups
import _common
from training import gpu_train  # stock_token_logprobs, _peak

SMOKE = dict(hidden=64, blocks="MEM*-M", mamba_heads=4, mamba_head_dim=16, groups=2, state=16, chunk=16, heads=4,
             kv_heads=2, head_dim=16, experts=8, top_k=2, inter=32, vocab=256, prompts=3, prompt_len=24,
             batches="2,3", new_tokens=4, diff_tokens=4, train_shape="2x32")
BLOCKS = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
HF_KERNELS = ("causal_conv1d_fn", "causal_conv1d_update", "mamba2_split_conv1d_scan_combined",
              "mamba2_selective_state_update", "mamba2_chunk_scan")


def load_kernels(a) -> dict:
    """Put mamba_ssm (Triton kernels) and causal_conv1d where transformers looks for them, before
    it imports the Nemotron-H modeling file; what was found."""
    out = {}
    if a.causal_conv1d_path:
        sys.path.insert(0, os.path.abspath(a.causal_conv1d_path))
    try:
        import causal_conv1d  # noqa: F401
        out["causal_conv1d"] = getattr(causal_conv1d, "__version__", "importable")
    except Exception as exc:  # noqa: BLE001 - reported, HF then runs its torch conv
        out["causal_conv1d"] = f"not importable: {exc!r}"[:300]
    ssd, ssu, note = _common.load_mamba_ssm(a.mamba_src)
    out["mamba_ssm"] = note
    if ssd is not None and out["causal_conv1d"].startswith("not importable"):
        # the fused split-conv1d scan calls causal_conv1d's CUDA extension: without it HF must not
        # pick it (HF then runs its own conv and the Triton chunk scan)
        ssd.mamba_split_conv1d_scan_combined = None
        out["mamba_split_conv1d_scan_combined"] = "withheld (needs causal_conv1d)"
    return out


def hf_kernels() -> dict:
    """The implementation each of HF's Nemotron-H Mamba functions resolved to (module.name)."""
    import transformers.models.nemotron_h.modeling_nemotron_h as mh
    out = {}
    for name in HF_KERNELS:
        fn = getattr(mh, name, None)
        impl = None
        for cell in (getattr(fn, "__closure__", None) or ()):
            v = cell.cell_contents
            if callable(v) and getattr(v, "__module__", "") and not v.__module__.startswith("transformers"):
                impl = f"{v.__module__}.{getattr(v, '__name__', '?')}"
        out[name] = impl or "transformers torch path"
    return out


def build(a, device):
    import transformers

    blocks = [BLOCKS[c] for c in a.blocks]
    cfg = transformers.NemotronHConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, layers_block_type=blocks, num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads, head_dim=a.head_dim, intermediate_size=4 * a.hidden,
        mamba_num_heads=a.mamba_heads, mamba_head_dim=a.mamba_head_dim, n_groups=a.groups,
        ssm_state_size=a.state, conv_kernel=4, chunk_size=a.chunk, n_routed_experts=a.experts,
        num_experts_per_tok=a.top_k, moe_intermediate_size=a.inter, moe_shared_expert_intermediate_size=2 * a.inter,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=8192, initializer_range=0.02,
        use_conv_bias=True, use_bias=False, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(a.seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    finally:
        torch.set_default_dtype(prev)
    return m.eval()


def rollout(model, hf, a, device, rec, deadline):
    import bitmatch
    batches = [int(b) for b in a.batches.split(",")]
    Bmax, L, n_new = max(batches), a.prompt_len, a.new_tokens
    kw = dict(max_num_seqs=Bmax, max_num_batched_tokens=Bmax * L + Bmax)
    graphs, eager = _common.engine(model, device, **kw), _common.engine(model, device, enforce_eager=True, **kw)

    def params(i):
        return bitmatch.SamplingParams(temperature=1.0, max_tokens=n_new, ignore_eos=True, seed=i)

    def warm(i):
        return bitmatch.SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=i)
    out = rec.data["sections"].setdefault("rollout", {})
    for B in batches:
        if time.time() > deadline:
            out.setdefault("skipped_for_time", []).append(B)
            continue
        ids = torch.randint(3, a.vocab, (B, L), generator=torch.Generator().manual_seed(B))
        try:
            r = _common.rollout_row(graphs, eager, hf, ids, n_new, device, params, warm)
        except Exception:
            r = {"B": B, "error": traceback.format_exc()[-2000:]}
            print(r["error"], flush=True)
        out[f"B{B}"] = r
        print("rollout", {k: v for k, v in r.items() if k != "error"}, flush=True)
        rec.flush()


def few_decode_config(over: dict) -> None:
    """Apply ``over`` to the Triton scan's config of decode launches of few programs (the
    launches mamba_ssd.few_programs names, as config_for does)."""
    from bitmatch.kernels.triton import mamba_ssd
    _common.override_scan_config(
        mamba_ssd, over, lambda dtype, kw: dtype != torch.float32 and kw.get("decode", False)
        and mamba_ssd.few_programs(kw.get("programs"), kw.get("sms")), "--few-decode-config")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (with --device cpu: the script's logic only)")
    ap.add_argument("--sections", default="diff,rollout,train")
    ap.add_argument("--mamba-src", default=None, help="unpacked mamba-ssm sdist (e.g. .whl/mamba_ssm-2.3.2.post1)")
    ap.add_argument("--causal-conv1d-path", default=None, help="folder holding a built causal_conv1d package")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--blocks", default="MEM*M-M*", help="one letter per block: M Mamba2, E MoE, * attention, - MLP")
    ap.add_argument("--mamba-heads", type=int, default=64)
    ap.add_argument("--mamba-head-dim", type=int, default=64)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--state", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--inter", type=int, default=1024, help="expert width")
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--prompts", type=int, default=20, help="diff: prompts of 8..--prompt-len tokens")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--diff-tokens", type=int, default=16)
    ap.add_argument("--batches", default="32,64")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--train-shape", default="4x512")
    ap.add_argument("--diff-blocks", default="M,E,*,-", help="diff_blocks: the block types, one model each")
    ap.add_argument("--budget-s", type=float, default=400, help="no new section or batch after this many s")
    ap.add_argument("--host-profile", action="store_true", help="train: where each step's host time goes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--few-decode-config", default=None,
                    help='JSON: Mamba scan config keys for decode launches of few programs (one or two sequences), '
                         'e.g. \'{"BP": 16, "num_warps": 4}\': the whole model\'s Diff under a candidate '
                         'before it lands')
    a = ap.parse_args(argv)
    if a.smoke:
        explicit = {t.split("=")[0].lstrip("-").replace("-", "_") for t in (argv or sys.argv[1:]) if t.startswith("--")}
        for k, v in SMOKE.items():
            if k not in explicit:
                setattr(a, k, v)
    kernels = load_kernels(a)  # before transformers imports the Nemotron-H modeling file
    if a.few_decode_config:
        few_decode_config(json.loads(a.few_decode_config))

    import bitmatch
    from bitmatch.engine.graphs import graph_safe
    from bitmatch.models import spec_of
    from bitmatch.testing.models import random_prompts

    t_start = time.time()
    deadline = t_start + a.budget_s
    dev = torch.device(a.device)
    _common.DEV = dev.type
    os.makedirs(a.out, exist_ok=True)
    rec = _common.Recorder(os.path.join(a.out, "nemotron_h_e2e.json"), a, extra={"kernels": kernels})
    hf = build(a, dev)
    rec.data["hf_kernels"] = hf_kernels()
    model = bitmatch.patch(copy.deepcopy(hf))
    rec.data["cuda_graph_safe"] = graph_safe(model)
    rec.data["scan_chunk"] = spec_of(model)[1].chunk_size  # ours; HF scans at --chunk
    rec.flush()
    for name in a.sections.split(","):
        if time.time() > deadline:
            rec.data.setdefault("skipped_for_time", []).append(name)
            rec.flush()
            continue
        t0 = time.time()
        try:
            if name == "diff":
                prompts = random_prompts(a.prompts, 8, a.prompt_len, seed=1, vocab_hi=a.vocab - 1)
                rec.put("diff", _common.engine_diff(model, hf, prompts, dev, 0.9, a.diff_tokens))
            elif name == "diff_blocks":
                prompts = random_prompts(a.prompts, 8, a.prompt_len, seed=1, vocab_hi=a.vocab - 1)
                out = {}
                for blk in a.diff_blocks.split(","):
                    one = build(argparse.Namespace(**{**vars(a), "blocks": blk}), dev)
                    # no stock control: HF's cache needs an attention layer in the model
                    out[blk] = _common.engine_diff(bitmatch.patch(one), None, prompts, dev, 0.9, a.diff_tokens)
                    del one
                    rec.put("diff_blocks", out)
            elif name == "locate":
                from bitmatch.diagnostics.verify import format_table, locate_pair
                prompts = random_prompts(min(a.prompts, 6), 8, a.prompt_len, seed=1, vocab_hi=a.vocab - 1)
                res = locate_pair("engine", model, prompts, temperature=0.9, max_tokens=a.diff_tokens,
                                  engine_kw=dict(_common.DIFF_CONFIGS[0][1]))
                table = format_table(res)
                print(table, flush=True)
                rec.put("locate", table)
            elif name == "rollout":
                rollout(model, hf, a, dev, rec, deadline)
            elif name == "train":
                B, L = (int(v) for v in a.train_shape.split("x"))
                rec.put("train", gpu_train.train_compare(model, hf, B, L, a.vocab, dev, host_profile=a.host_profile,
                                                            grads=True, syncs=True))
            else:
                raise ValueError(f"unknown section {name!r}")
        except Exception:
            rec.err(name)
        rec.data.setdefault("section_seconds", {})[name] = round(time.time() - t0, 1)
        rec.flush()
    rec.data["total_seconds"] = round(time.time() - t_start, 1)
    rec.flush()
    print("wrote", rec.path, "in", rec.data["total_seconds"], "s", flush=True)


if __name__ == "__main__":
    main()

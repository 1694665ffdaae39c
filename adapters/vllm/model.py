"""vLLM model classes that run the dense decoder on bitmatch kernels.

Each class subclasses vLLM's own (so construction, ``load_weights`` and the registry's interface
checks stay vLLM's) and replaces ``forward`` and ``compute_logits``. The forward is
``bitmatch.models.dense.forward_hidden_lm``, the very function the trainer runs, applied to an
HF-shaped view of vLLM's parameters: fused ``qkv_proj`` / ``gate_up_proj`` weights are sliced
by rows, which gives each output column exactly the bits of the unmerged projection (a column
of the invariant linear depends only on its own weight row). The model config is the HF
config vLLM loaded, so shapes, RoPE and sliding windows come from the same place as on the
trainer side.

vLLM's ``Attention`` modules stay only so that vLLM sizes and allocates the paged KV cache and
builds the per-step metadata; each layer writes and reads its own plain layout inside its
``attn.kv_cache`` tensor (``kv_cache.py``) through ``kernels.write_kv_cache`` and
``kernels.attention_paged``.

Invariance: the hidden state and fp32 logits of every token equal, bit for bit, the ones
``bitmatch.token_logprobs`` computes on the HF model with the same weights, for any batch,
chunked-prefill split, decode step, block size or block table vLLM schedules.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from bitmatch.context import ForwardContext
from bitmatch.models import dense

from .checks import BitmatchUnsupportedError, check_engine_config
from .kv_cache import check_backend, paged_kv_views


class PlainLinearMethod(UnquantizedLinearMethod):
    """Unquantized linear that keeps ``layer.weight`` the plain ``[out, in]`` Parameter.

    vLLM's CPU method repacks each weight for oneDNN after loading and leaves ``layer.weight``
    empty, without its ``weight_loader``: bitmatch's kernels could not read it, and a later
    per-parameter ``load_weights`` (TRL's and verl's weight sync) would update nothing.
    """

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass  # keep the loaded layout: bitmatch reads layer.weight directly

    def apply(self, layer, x, bias=None):
        raise RuntimeError("bitmatch: this linear layer's forward runs on bitmatch.kernels, not on vLLM's gemm")


def keep_plain_linear_weights(model: torch.nn.Module) -> None:
    for name, mod in model.named_modules():
        if not isinstance(mod, LinearBase):
            continue
        if type(mod.quant_method) is UnquantizedLinearMethod:
            mod.quant_method = PlainLinearMethod()
        elif not isinstance(mod.quant_method, PlainLinearMethod):
            raise BitmatchUnsupportedError(
                f"bitmatch: linear layer {name} uses {type(mod.quant_method).__name__}; only unquantized "
                "weights are supported")


def _row_blocks(mod, names):
    """HF-shaped projections over row blocks of a fused vLLM linear (views: no copy, always the
    live parameter, so an in-place weight update is seen at the next step)."""
    sizes = list(mod.output_sizes)
    if len(sizes) != len(names) or sum(sizes) != mod.weight.shape[0]:
        raise BitmatchUnsupportedError(
            f"bitmatch: fused layer with output sizes {sizes} does not split into {names} "
            f"(weight rows {mod.weight.shape[0]}); tensor parallelism is not supported")
    bias = getattr(mod, "bias", None)
    out, row = {}, 0
    for n, rows in zip(names, sizes):
        out[n] = SimpleNamespace(weight=mod.weight.narrow(0, row, rows),
                                 bias=None if bias is None else bias.narrow(0, row, rows))
        row += rows
    return out


def _layer_view(layer):
    a = layer.self_attn
    attn = SimpleNamespace(o_proj=a.o_proj, **_row_blocks(a.qkv_proj, ("q_proj", "k_proj", "v_proj")))
    for n in ("q_norm", "k_norm"):  # Qwen3's per-head norms; their presence selects the op order
        if hasattr(a, n):
            setattr(attn, n, getattr(a, n))
    mlp = SimpleNamespace(down_proj=layer.mlp.down_proj, **_row_blocks(layer.mlp.gate_up_proj, ("gate_proj", "up_proj")))
    return SimpleNamespace(self_attn=attn, mlp=mlp, input_layernorm=layer.input_layernorm,
                           post_attention_layernorm=layer.post_attention_layernorm)


class BitmatchDenseMixin:
    """Put first in the bases of a vLLM dense causal LM: replaces forward and compute_logits."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        check_engine_config(vllm_config)  # again here: a worker may be started by other means
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        keep_plain_linear_weights(self)
        spec = dense.model_spec(self.hf_view())  # raises for what dense.py does not support
        if len(set(spec.sliding_windows)) > 1:
            raise BitmatchUnsupportedError(
                f"bitmatch: layers with different sliding windows {spec.sliding_windows} use separate vLLM "
                "KV cache groups (one block table each); not supported yet")
        if any(w is not None for w in spec.sliding_windows):
            raise BitmatchUnsupportedError(
                f"bitmatch: sliding-window attention (window {spec.sliding_windows[0]}) under vLLM is not "
                "tested yet (vLLM frees blocks outside the window); use a full-attention model")
        for layer in self.model.layers:
            check_backend(layer.self_attn.attn)

    def hf_view(self):
        """The model as ``bitmatch.models.dense`` reads an HF causal LM (parameters are vLLM's own)."""
        cfg = self.config
        head = self.lm_head
        # vLLM pads the vocabulary rows of lm_head/embeddings; the trainer's head has vocab_size rows
        lm_head = SimpleNamespace(weight=head.weight.narrow(0, 0, cfg.vocab_size),
                                  bias=getattr(head, "bias", None))
        model = SimpleNamespace(embed_tokens=self.model.embed_tokens, norm=self.model.norm,
                                layers=[_layer_view(layer) for layer in self.model.layers])
        return SimpleNamespace(config=cfg, model=model, lm_head=lm_head)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        from vllm.forward_context import get_forward_context

        if inputs_embeds is not None or intermediate_tensors is not None:
            raise BitmatchUnsupportedError("bitmatch: inputs_embeds / pipeline-parallel inputs are not supported")
        all_md = get_forward_context().attn_metadata
        hidden = torch.zeros((input_ids.shape[0], self.config.hidden_size),
                             dtype=self.model.embed_tokens.weight.dtype, device=input_ids.device)
        if all_md is None:
            return hidden  # vLLM's dummy/profile run: no KV cache and no real tokens
        if isinstance(all_md, list):
            raise BitmatchUnsupportedError("bitmatch: micro-batched (DBO) forward is not supported")
        attns = [layer.self_attn.attn for layer in self.model.layers]
        md = all_md[attns[0].layer_name]
        if any(all_md[a.layer_name] is not md for a in attns[1:]):
            raise BitmatchUnsupportedError("bitmatch: layers with different KV cache groups are not supported")
        n = int(md.num_actual_tokens)
        nreq = md.seq_lens.shape[0]
        ctx = ForwardContext(
            positions=positions[:n].long(), query_start_loc=md.query_start_loc[:nreq + 1],
            seq_lens=md.seq_lens, block_table=md.block_table[:nreq], slot_mapping=md.slot_mapping[:n].long(),
            kv_caches=[paged_kv_views(a) for a in attns])
        hidden[:n] = dense.forward_hidden_lm(self.hf_view(), input_ids[:n], ctx)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """fp32 logits: the compute-dtype logits of ``dense.compute_logits_lm`` cast exactly, as the
        trainer's ``token_logprobs`` casts them before dividing by T."""
        return dense.compute_logits_lm(self.hf_view(), hidden_states).float()


class BitmatchQwen2ForCausalLM(BitmatchDenseMixin, Qwen2ForCausalLM):
    pass


class BitmatchQwen3ForCausalLM(BitmatchDenseMixin, Qwen3ForCausalLM):
    pass


class BitmatchLlamaForCausalLM(BitmatchDenseMixin, LlamaForCausalLM):
    pass


class BitmatchMistralForCausalLM(BitmatchDenseMixin, MistralForCausalLM):
    pass


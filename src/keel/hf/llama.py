"""Hugging Face Llama <-> the `pre_ln` TransformerLM: the config and weight names map one to one.

Works on plain config dicts and state dicts, so `transformers` is not needed to import this module.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from keel.model.architecture import ModelConfig

# (Hugging Face name, Keel name); {i} is the block index
_LAYER_NAMES = (
    ("model.layers.{i}.self_attn.q_proj.weight", "blocks.{i}.attn.wq.weight"),
    ("model.layers.{i}.self_attn.k_proj.weight", "blocks.{i}.attn.wk.weight"),
    ("model.layers.{i}.self_attn.v_proj.weight", "blocks.{i}.attn.wv.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "blocks.{i}.attn.wo.weight"),
    ("model.layers.{i}.mlp.gate_proj.weight", "blocks.{i}.ffn.w_gate.weight"),
    ("model.layers.{i}.mlp.up_proj.weight", "blocks.{i}.ffn.w_up.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "blocks.{i}.ffn.w_down.weight"),
    ("model.layers.{i}.input_layernorm.weight", "blocks.{i}.attn_res.norm_in.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blocks.{i}.ffn_res.norm_in.weight"),
)
_GLOBAL_NAMES = (
    ("model.embed_tokens.weight", "embed.weight"),
    ("model.norm.weight", "final_norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
)


def config_from_llama(hf: Mapping) -> ModelConfig:
    """A `pre_ln` ModelConfig equal to a Llama config (as a dict, e.g. `LlamaConfig.to_dict()`)."""
    def need(key, ok, allowed):
        if not ok:
            raise ValueError(f"Llama config field {key}={hf.get(key)!r} has no Keel equivalent; allowed: {allowed}")

    need("hidden_act", hf.get("hidden_act", "silu") == "silu", "silu")
    need("attention_bias", not hf.get("attention_bias", False), "false")
    need("mlp_bias", not hf.get("mlp_bias", False), "false")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    need("rope_parameters", rope.get("rope_type", "default") == "default", "rope_type 'default'")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    need("head_dim", hf.get("head_dim") in (None, hidden // heads), f"{hidden // heads} (hidden_size/heads)")
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=hidden, n_blocks=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, d_ffn=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        scheme="pre_ln",
    )


def state_dict_from_llama(hf_state: Mapping[str, torch.Tensor], n_blocks: int) -> dict[str, torch.Tensor]:
    """Rename a LlamaForCausalLM state dict to TransformerLM names. Unknown or missing names raise."""
    names = dict(_GLOBAL_NAMES)
    for i in range(n_blocks):
        names.update((hf.format(i=i), ours.format(i=i)) for hf, ours in _LAYER_NAMES)
    unknown = [k for k in hf_state if k not in names and not re.search(r"rotary_emb", k)]
    if unknown:
        raise ValueError(f"Llama state dict has names with no Keel equivalent: {unknown[:5]}")
    out = {names[k]: v for k, v in hf_state.items() if k in names}
    missing = [hf for hf, ours in names.items() if hf not in hf_state and ours != "lm_head.weight"]
    if missing:
        raise ValueError(f"Llama state dict lacks: {missing[:5]}")
    if "lm_head.weight" not in out:  # tied: the head is the embedding
        out["lm_head.weight"] = out["embed.weight"]
    return out


def state_dict_to_llama(state: Mapping[str, torch.Tensor], n_blocks: int) -> dict[str, torch.Tensor]:
    """The inverse of `state_dict_from_llama` for a `pre_ln` TransformerLM."""
    names = {ours: hf for hf, ours in _GLOBAL_NAMES}
    for i in range(n_blocks):
        names.update((ours.format(i=i), hf.format(i=i)) for hf, ours in _LAYER_NAMES)
    return {names[k]: v for k, v in state.items() if k in names}

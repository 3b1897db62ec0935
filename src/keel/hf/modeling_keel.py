"""`KeelForCausalLM`: the project's `TransformerLM` as a `transformers` causal LM, with a KV cache.

This wraps `keel.model.transformer.TransformerLM` (weights live under `model.`); it is not a second implementation.
`keel export-hf` copies this file into an exported directory with its `keel` imports made relative, so
keep every import of this project on one `from keel.<module> import ...` line.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from keel.hf.configuration_keel import KeelConfig
from keel.model.layers import KVCache
from keel.model.transformer import TransformerLM

# transformers 5.24 renamed the cache argument and output field `past_key_values` to `cache`; speak both
_CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


class KeelForCausalLM(PreTrainedModel, GenerationMixin):
    """A causal LM whose forward is `TransformerLM`'s; `generate()` reuses keys and values through the cache
    `transformers` passes (a DynamicCache; the argument is `cache` from transformers 5.24, `past_key_values`
    before), or a `keel.model.layers.KVCache`.

    Padded batches are not supported: every row must be the same length (right padding without an
    attention mask, as lm-evaluation-harness scores log-likelihoods, is fine: causal attention never
    lets a real token see the padding after it).
    """

    config_class = KeelConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}

    def __init__(self, config: KeelConfig):
        super().__init__(config)
        self.model = TransformerLM(config.model_config())
        self.post_init()

    def _init_weights(self, module):
        # TransformerLM initialises itself (scheme gains included); transformers must not overwrite it
        if isinstance(module, TransformerLM):
            module.reset_parameters()

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                past_key_values=None, use_cache: bool | None = None, labels: torch.LongTensor | None = None,
                return_dict: bool | None = None, cache=None, **kwargs) -> CausalLMOutputWithPast:
        """`labels` are the inputs themselves (shifted inside, as in transformers); -100 is ignored."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("KeelForCausalLM does not support padded batches (attention_mask has zeros); "
                             "pass sequences of equal length, e.g. one at a time")
        if cache is None:
            cache = past_key_values
        if cache is None and use_cache:
            cache = KVCache()
        targets = None if labels is None else F.pad(labels[:, 1:], (0, 1), value=-100)
        logits, loss = self.model(input_ids, targets=targets, cache=cache)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})

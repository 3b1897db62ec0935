"""The pre_ln model is a real Llama: same logits as Hugging Face's LlamaForCausalLM, weights copied across."""

import pytest
import torch

from keel import TransformerLM
from keel.hf.llama import config_from_llama, state_dict_from_llama, state_dict_to_llama

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("tied", [False, True])
def test_pre_ln_reproduces_llama_logits(tied):
    hf_config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=tied, attn_implementation="eager",
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():  # non-trivial norm gains, so a misplaced norm shows
        for _name, p in hf.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    config = config_from_llama(hf_config.to_dict())
    assert (config.scheme, config.n_blocks, config.kv_heads, config.tie_embeddings) == ("pre_ln", 3, 2, tied)
    model = TransformerLM(config).eval()
    model.load_state_dict(state_dict_from_llama(hf.state_dict(), config.n_blocks))
    idx = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(idx).logits
        got, _ = model(idx)
    assert expected.abs().max() > 0.1  # the comparison is not between near-zero tensors
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_llama_names_round_trip():
    hf_config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1)
    hf_state = transformers.LlamaForCausalLM(hf_config).state_dict()
    ours = state_dict_from_llama(hf_state, 2)
    back = state_dict_to_llama(ours, 2)
    assert set(back) == set(hf_state)
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)


def test_unsupported_llama_config_is_named():
    with pytest.raises(ValueError, match="attention_bias"):
        config_from_llama(dict(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=16, attention_bias=True))

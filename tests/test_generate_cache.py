"""The KV cache: feeding a sequence piece by piece through the cache gives the logits of one full
forward pass, and cached greedy decoding the same tokens as recomputing the context every step."""

import pytest
import torch

from keel import SCHEMES, ModelConfig, TransformerLM
from keel.generate import generate
from keel.model.layers import KVCache


def model_for(scheme: str, **overrides) -> TransformerLM:
    config = ModelConfig(vocab_size=64, d_model=32, n_blocks=3, n_heads=4, n_kv_heads=2, max_seq_len=24,
                         init_std=0.3, scheme=scheme, **overrides)
    torch.manual_seed(0)
    return TransformerLM(config).eval()


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_pieces_through_the_cache_equal_one_full_pass(scheme):
    model = model_for(scheme)
    idx = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = model(idx)
        cache, pieces = KVCache(), []
        for a, b in ((0, 7), (7, 8), (8, 15), (15, 20)):  # a prompt, one token, a chunk (the offset mask), ...
            pieces.append(model(idx[:, a:b], cache=cache)[0])
    assert cache.get_seq_length() == 20 and len(cache.layers) == 3
    assert full.abs().max() > 0.5
    # float32 rounding differs with the kernel shapes (~1e-5 on logits of size ~10); a wrong position or
    # mask is off by O(1)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-4)


@pytest.mark.parametrize("scheme", ["keel", "pre_ln", "hybrid_norm"])
def test_cached_and_uncached_greedy_decoding_give_the_same_tokens(scheme):
    model = model_for(scheme)
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    # 30 new tokens run past max_seq_len=24, so the sliding window (cache rebuilt each step) is covered
    cached = generate(model, prompt, 30, temperature=0, use_cache=True)
    uncached = generate(model, prompt, 30, temperature=0, use_cache=False)
    assert cached.shape == (2, 35)
    assert torch.equal(cached, uncached)
    assert len(set(cached[0, 5:].tolist())) > 3  # not one token repeated: the comparison has teeth


def test_cached_sampling_draws_the_same_tokens():
    model = model_for("keel")
    prompt = torch.tensor([[1, 2, 3]])
    runs = [generate(model, prompt, 15, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(3),
                     use_cache=use_cache) for use_cache in (True, False)]
    assert torch.equal(*runs)


def test_cache_past_max_seq_len_is_refused():
    model = model_for("keel")
    cache = KVCache()
    model(torch.zeros(1, 20, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="sequence length 25 exceeds"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)

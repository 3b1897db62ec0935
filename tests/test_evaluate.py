"""keel.train.evaluate.evaluate against the validation loss written out: evenly spaced windows, each next token's
minus log-softmax, summed and divided by the tokens counted; bits per byte by the bytes of those tokens; a
data-parallel replica's share of the windows adding up to one process's."""

import math

import numpy as np
import pytest
import torch

from keel.model import ModelConfig, TransformerLM
from keel.train.evaluate import evaluate

T, VOCAB = 16, 64


@pytest.fixture(scope="module")
def model_and_tokens():
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=VOCAB, d_model=32, n_blocks=2, n_heads=4, max_seq_len=T))
    tokens = np.random.default_rng(0).integers(0, VOCAB, 1000).astype(np.uint16)
    return model, tokens


def by_hand(model, tokens, starts, token_bytes):
    """Per window: the model's logits on tokens[s:s+T], minus the log-softmax at tokens[s+1:s+T+1], in float64."""
    nll, n_bytes = 0.0, 0
    with torch.no_grad():
        for s in starts:
            x = torch.from_numpy(tokens[s:s + T].astype(np.int64))[None]
            y = torch.from_numpy(tokens[s + 1:s + T + 1].astype(np.int64))
            logits, _ = model(x)
            nll -= torch.log_softmax(logits[0].double(), -1)[torch.arange(T), y].sum().item()
            n_bytes += int(token_bytes[y.numpy()].sum())
    return nll, len(starts) * T, n_bytes


def test_the_validation_loss_is_the_next_token_cross_entropy_over_evenly_spaced_windows(model_and_tokens):
    model, tokens = model_and_tokens
    token_bytes = np.arange(VOCAB) % 3 + 1
    # 3 x 4 = 12 windows of the 62 that fit, spread from the first token to the last
    starts = np.linspace(0, len(tokens) - T - 1, 12).astype(np.int64)
    nll, n, n_bytes = by_hand(model, tokens, starts, token_bytes)
    model.train()
    got = evaluate(model, tokens, T, 3, 4, torch.device("cpu"), token_bytes=token_bytes)
    assert model.training  # put back as it was
    assert got["val_tokens"] == n == 12 * T
    assert got["val_loss"] == pytest.approx(nll / n, rel=1e-6)
    assert got["val_ppl"] == pytest.approx(math.exp(nll / n), rel=1e-6)
    assert got["val_bits_per_byte"] == pytest.approx(nll / (math.log(2) * n_bytes), rel=1e-6)


def test_two_replicas_windows_add_up_to_one_processs(model_and_tokens):
    """Replica r of 2 takes every second window from r, its share of a global batch of 3 at a time (2 + a
    forward it does not count when it runs short): their sums are one process's."""
    model, tokens = model_and_tokens
    one = evaluate(model, tokens, T, 3, 5, torch.device("cpu"))  # 15 windows: replica 0 gets 8, replica 1 gets 7
    parts = [evaluate(model, tokens, T, 3, 5, torch.device("cpu"), replica=r, replicas=2) for r in (0, 1)]
    assert [p["val_tokens"] for p in parts] == [8 * T, 7 * T]
    starts = np.linspace(0, len(tokens) - T - 1, 15).astype(np.int64)
    for r, part in enumerate(parts):
        nll, n, _ = by_hand(model, tokens, starts[r::2], np.ones(VOCAB, dtype=np.int64))
        assert part["val_loss"] == pytest.approx(nll / n, rel=1e-6)
    total = sum(p["val_loss"] * p["val_tokens"] for p in parts) / sum(p["val_tokens"] for p in parts)
    assert total == pytest.approx(one["val_loss"], rel=1e-6)  # float32 forwards of other batch shapes

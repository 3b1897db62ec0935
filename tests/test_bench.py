"""`keel bench` on a tiny shape: both schemes timed on the same batches, and its outputs written."""

import argparse
import json

import torch

from keel.experiments.bench import Bench, register, to_markdown
from keel.model.config import ModelConfig
from keel.model.transformer import TransformerLM
from keel.runtime import resolve_device


def test_bench_trains_the_model_it_times():
    config = ModelConfig(n_blocks=2, d_model=32, n_heads=2, max_seq_len=16)
    b = Bench(config, 2, 16, resolve_device("cpu"))
    before = [p.detach().clone() for p in b.model.parameters()]
    b.step(record=False)
    b.step()
    assert len(b.times) == 1 and b.times[0] > 0
    assert all(not torch.equal(p, q) for p, q in zip(b.model.parameters(), before))
    torch.manual_seed(0)
    fresh = TransformerLM(config)  # the same seed: the bench starts from the model's own init
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), before))


def test_bench_command_writes_json_and_table(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["bench", "--preset", "tiny", "n_blocks=2", "d_model=32", "--batch-size", "2",
                              "--seq-len", "16", "--steps", "2", "--warmup", "1", "--depths", "4,8",
                              "--depth-steps", "1", "--out", str(tmp_path)])
    assert args.func(args) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    keel, pre_ln = result["compare"]["keel"], result["compare"]["pre_ln"]
    assert result["compare"]["keel_over_pre_ln_step_time"] == keel["step_time_s"] / pre_ln["step_time_s"]
    assert keel["tokens_per_s"] == 2 * 16 / keel["step_time_s"] and keel["mfu"] is None  # no GPU peak on CPU
    assert keel["memory_estimate_bytes"] > 0 and keel["peak_memory_bytes"] is None
    assert [r["n_sublayers"] for r in result["depth"]] == [4, 8]
    assert (tmp_path / "bench.md").read_text() == to_markdown(result)
    assert "Keel / Pre-LN step time" in capsys.readouterr().out

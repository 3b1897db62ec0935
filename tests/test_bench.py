"""`keel bench`: step times read from a fake clock (conftest's fake_clock) give hand-computed tokens/s and MFU, the
table matches a committed golden file, the merged config's run.* / optim.* settings reach the step it times (and a
setting it does not read is refused); the flags of the suites that moved to benchmarks/ say where they went. The
CPU suite and time per sub-layer against depth: test_cpu_suite.py; the GPU campaign: test_gpu_campaign.py."""

import argparse
import json
from pathlib import Path

import pytest
import torch

from keel.bench import core
from keel.bench.core import Bench, compare, depth_series
from keel.cli import bench as bench_cli
from keel.cli import main
from keel.cli.bench import register
from keel.config import RunConfig
from keel.errors import ConfigError
from keel.model import SCHEMES, ModelConfig, TransformerLM

GOLDEN = Path(__file__).parent / "golden"


def bench(*argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


def test_bench_trains_the_model_it_times():
    config = ModelConfig(n_blocks=2, d_model=32, n_heads=2, max_seq_len=16)
    b = Bench(config, RunConfig(batch_size=2, seq_len=16, device="cpu"))
    before = [p.detach().clone() for p in b.model.parameters()]
    b.step(record=False)
    b.step()
    assert len(b.times) == 1 and b.times[0] > 0
    assert all(not torch.equal(p, q) for p, q in zip(b.model.parameters(), before))
    torch.manual_seed(0)
    fresh = TransformerLM(config)  # the same seed: the bench starts from the model's own init
    assert all(torch.equal(p, q) for p, q in zip(fresh.parameters(), before))


def test_tokens_per_second_and_mfu_are_those_of_the_clock(fake_clock, monkeypatch):
    monkeypatch.setattr(core, "peak_flops", lambda device: 1e9)  # a made-up device peak, so MFU is defined
    config = ModelConfig(vocab_size=256, d_model=32, n_blocks=1, n_heads=2, max_seq_len=16)
    out = compare(config, RunConfig(batch_size=2, seq_len=16, device="cpu"), ["keel", "pre_ln"], steps=3, warmup=1)
    # 2 sub-layers: Keel 0.10 s and Pre-LN 0.08 s a step, 2 x 16 = 32 tokens each
    assert out["keel"]["step_time_s"] == pytest.approx(0.10) and out["pre_ln"]["step_time_s"] == pytest.approx(0.08)
    assert out["keel"]["tokens_per_s"] == pytest.approx(320.0) and out["pre_ln"]["tokens_per_s"] == pytest.approx(400.0)
    assert out["keel_over_pre_ln_step_time"] == pytest.approx(1.25)
    # Pre-LN's parameters in matmuls: attention 4 x 32 x 32 = 4096, SwiGLU FFN 3 x 32 x 96 = 9216, two pre-norms
    # 64, final norm 32, LM head 256 x 32 = 8192: N = 21600. FLOPs per token 6 N + 12 x blocks x d x T
    # = 129600 + 12 x 1 x 32 x 16 = 135744; MFU = 400 tokens/s x 135744 / 1e9
    assert out["pre_ln"]["mfu"] == pytest.approx(400 * 135744 / 1e9)
    assert len(fake_clock) == 2 * (3 + 1)


def test_a_looped_model_is_timed_per_unrolled_sub_layer_and_counted_once(fake_clock):
    config = ModelConfig(vocab_size=256, d_model=32, n_blocks=4, loop_blocks=2, n_heads=2, max_seq_len=16)
    rows = depth_series(config, RunConfig(batch_size=2, seq_len=16, device="cpu"), [8], steps=1)
    # a step runs all 8 sub-layers (2 blocks, twice): 8 x 0.05 s on the fake clock
    assert rows[0]["n_sublayers"] == 8 and rows[0]["ms_per_sublayer"] == pytest.approx(50.0)
    model = fake_clock[-1]["step"].model
    assert rows[0]["n_params"] == sum(p.numel() for p in model.parameters())  # what the optimiser holds


@pytest.mark.slow  # over a second in tests/durations.json
def test_the_table_matches_the_golden_file(fake_clock, monkeypatch, tmp_path):
    machine = {"device": "cpu", "gpu": None, "cpu": "x86_64", "cpu_count": 2}
    monkeypatch.setattr(bench_cli, "machine", lambda device: machine)
    # the estimate is keel.scale.memory's, tested there: a fixed number keeps this file about the table
    monkeypatch.setattr(core, "estimate_memory", lambda *a, **k: {"total": 3 * 2**20})
    assert bench("--preset", "tiny", "n_blocks=1", "d_model=32", "n_heads=2", "run.batch_size=2", "run.seq_len=16",
                 "--steps", "3", "--warmup", "1", "--depths", "4,8", "--depth-steps", "2", "--out", str(tmp_path)) == 0
    assert (tmp_path / "bench.md").read_text() == (GOLDEN / "bench.md").read_text()
    result = json.loads((tmp_path / "bench.json").read_text())
    assert [r["n_sublayers"] for r in result["depth"]] == [4, 8]


def test_run_and_optim_overrides_reach_the_step_bench_times(fake_clock, tmp_path):
    bench("--preset", "tiny", "n_blocks=1", "run.batch_size=3", "run.seq_len=8", "run.grad_accum=2",
          "run.dtype=bfloat16", "optim.lr=0.01", "optim.weight_decay=0.25", "--schemes", "pre_ln", "--steps", "2",
          "--warmup", "0", "--depths", "", "--out", str(tmp_path))
    assert fake_clock, "bench took no step"
    for seen in fake_clock:
        assert seen["batch"][0].shape == (3, 8) and seen["lr"] == 0.01
        assert seen["step"].grad_accum == 2
        assert isinstance(seen["autocast"], torch.autocast) and seen["autocast"].fast_dtype == torch.bfloat16
        assert any(g["weight_decay"] == 0.25 for g in seen["step"].optimizer.param_groups)
    result = json.loads((tmp_path / "bench.json").read_text())
    # 3 x 8 tokens x 2 micro-batches in 2 sub-layers x 0.04 s
    assert result["compare"]["pre_ln"]["tokens_per_s"] == pytest.approx(48 / 0.08)


@pytest.mark.parametrize("override", ["run.steps=5", "run.eval_every=5", "run.fsdp_group=2", "optim.warmup_steps=3",
                                      "data.source=corpus.txt", "guard.policy=rollback", "scheme=deepnorm"])
def test_an_override_bench_does_not_read_is_refused_in_one_line(override, capsys):
    assert main(["bench", "--preset", "tiny", override, "--steps", "1", "--warmup", "0", "--depths", ""]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    key = override.split("=")[0]
    assert len(err) == 1 and err[0].startswith(f"keel: error: {'model.' if '.' not in key else ''}{key}: ")


@pytest.mark.parametrize("flags, where", [
    (["--suite", "cpu", "run.batch_size=3"], "python benchmarks/cpu/suite.py (was --suite cpu)"),
    (["--suite", "gpu", "--toy"], "python benchmarks/gpu/campaign.py (was --suite gpu)"),
    (["--toy"], "python benchmarks/gpu/campaign.py --toy"),
    (["--sections", "flatness"], "python benchmarks/cpu/suite.py"),
    (["--idle-wait", "0"], "python benchmarks/cpu/suite.py --idle-wait"),
    (["--idle-load", "1"], "python benchmarks/cpu/suite.py --idle-load"),
    (["--validate-model"], "python benchmarks/gpu/validate_model.py")])
def test_the_flags_of_the_suites_that_moved_say_in_one_line_where_they_went(flags, where, capsys):
    assert main(["bench", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"keel: error: {flags[0]}: no longer a keel bench flag")
    assert where in err[0]


def test_schemes_and_their_options_come_from_the_registry(fake_clock):
    with pytest.raises(ConfigError, match="allowed: " + ", ".join(SCHEMES)):
        bench("--preset", "tiny", "--schemes", "keel,no_such_scheme", "--depths", "")
    config = ModelConfig(vocab_size=256, d_model=32, n_blocks=1, n_heads=2, max_seq_len=16, scheme="deepnorm",
                         deepnorm_beta="paper")
    compare(config, RunConfig(batch_size=2, seq_len=16, device="cpu"), ["deepnorm", "keel"], steps=1, warmup=0)
    configs = {s["step"].model.config.scheme: s["step"].model.config for s in fake_clock}
    assert configs["deepnorm"].deepnorm_beta == "paper" and configs["keel"].deepnorm_beta is None

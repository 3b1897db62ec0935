"""`keel bench`: step times read from a fake clock give hand-computed tokens/s and MFU, the table matches a
committed golden file, the merged config's run.* / optim.* settings reach the step it times (and a setting it does
not read is refused); the cpu and gpu suites at toy size, end to end; time per sub-layer against depth
(keel.bench.flatness) from a fake clock. The GPU campaign's plan, profiler and window: test_gpu_campaign.py."""

import argparse
import gc
import json
import os
import subprocess
import sys
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from keel.bench import cli as bench_cli
from keel.bench import core
from keel.bench import cpu as bench_cpu
from keel.bench import flatness as bench_flatness
from keel.bench.cli import register
from keel.bench.core import Bench, compare, depth_series
from keel.bench.cpu import CPU_FLATNESS, cpu_markdown, cpu_suite
from keel.bench.flatness import flatness_series
from keel.bench.gpu import GPU_SECTIONS, META, GpuSuite, compare_points, gpu_markdown, gpu_suite
from keel.cli import main
from keel.errors import ConfigError
from keel.model import SCHEMES, ModelConfig, TransformerLM
from keel.train.config import RunConfig
from keel.train.step import TrainStep

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden"
# seconds one training step takes on the fake clock, per sub-layer, by scheme
COST_PER_SUBLAYER = {"keel": 0.05, "pre_ln": 0.04, "deepnorm": 0.06}
TINY_FLAT = {"model": {"vocab_size": 64, "d_model": 16, "n_heads": 2, "n_kv_heads": 1, "max_seq_len": 8},
             "batch_size": 1, "seq_len": 8, "sublayers": (4, 8, 16), "steps": 3, "warmup": 1, "repeats": 2,
             "threads": 1}


class Seen(list):
    """What the fake clock saw, one entry per step."""


@pytest.fixture
def fake_clock(monkeypatch):
    """core.clock reads a fake time that only a training step advances: n_sublayers x COST_PER_SUBLAYER[scheme]
    seconds, plus `seen.overhead(model config, call)` where a test sets one (`call`: 1 for a TrainStep's first
    step). Returns what each step saw: its TrainStep, the batch, the lr and the autocast context."""
    now, seen = [0.0], Seen()
    real = TrainStep.__call__

    def timed(self, next_batch, lr):
        batch = next_batch()
        seen.append({"step": self, "batch": batch, "lr": lr, "autocast": self.autocast()})
        result = real(self, lambda: batch, lr)
        config = self.model.config
        now[0] += COST_PER_SUBLAYER[config.scheme] * config.n_sublayers
        if hasattr(seen, "overhead"):
            now[0] += seen.overhead(config, sum(e["step"] is self for e in seen))
        return result
    monkeypatch.setattr(TrainStep, "__call__", timed)
    monkeypatch.setattr(core, "clock", lambda: now[0])
    return seen


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


def test_the_suites_refuse_overrides_they_do_not_read(capsys):
    assert main(["bench", "--suite", "cpu", "run.batch_size=3", "--idle-wait", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "keel: error: run.batch_size: not used by keel bench (--suite cpu is a fixed campaign)\n"


def test_schemes_and_their_options_come_from_the_registry(fake_clock):
    with pytest.raises(ConfigError, match="allowed: " + ", ".join(SCHEMES)):
        bench("--preset", "tiny", "--schemes", "keel,no_such_scheme", "--depths", "")
    config = ModelConfig(vocab_size=256, d_model=32, n_blocks=1, n_heads=2, max_seq_len=16, scheme="deepnorm",
                         deepnorm_beta="paper")
    compare(config, RunConfig(batch_size=2, seq_len=16, device="cpu"), ["deepnorm", "keel"], steps=1, warmup=0)
    configs = {s["step"].model.config.scheme: s["step"].model.config for s in fake_clock}
    assert configs["deepnorm"].deepnorm_beta == "paper" and configs["keel"].deepnorm_beta is None


@pytest.mark.slow
def test_gpu_suite_runs_end_to_end_at_toy_size(tmp_path):
    """`keel bench --suite gpu --toy`, as CI runs it: every section, with the fused junction through triton's
    interpreter (a child process: the interpreter must be on before triton is first imported)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "keel.cli", "bench", "--suite", "gpu", "--toy", "--out",
                           str(tmp_path)], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    suite, sections = GpuSuite.toy(), result["sections"]
    assert result["status"] == dict.fromkeys(GPU_SECTIONS, "done")
    assert "skipped" in sections["tests"]["summary"] and sections["tests"]["returncode"] == 0  # no CUDA: all skip
    slowest = sections["tests"]["slowest"]  # each test's time as it ended, slowest first
    assert slowest and all(t["outcome"] == "SKIPPED" and "::" in t["test"] for t in slowest)
    assert [t["seconds"] for t in slowest] == sorted((t["seconds"] for t in slowest), reverse=True)
    kernel = sections["kernel"]
    assert [r["width"] for r in kernel["rows"]] == list(suite.kernel_widths) and kernel["copy_GBps"] > 0
    for row in kernel["rows"]:
        # float32 everywhere on a CPU: the forward reads x, f and writes y, u; the backward reads x, f, dy, du and
        # writes dx, df (4 bytes each, per element of a rows x width tensor)
        elements = suite.kernel_rows * row["width"]
        assert (row["bytes_fwd"], row["bytes_fwd_bwd"]) == (4 * 4 * elements, (4 + 6) * 4 * elements)
        for impl in ("fused", "unfused", "compiled"):
            assert row[impl]["fwd_GBps"] == pytest.approx(16 * elements / row[impl]["fwd_s"] / 1e9)
            assert row[impl]["fwd_bwd_GBps"] == pytest.approx(40 * elements / row[impl]["fwd_bwd_s"] / 1e9)
    # compile warm-up from nothing: each scheme in a process of its own, graphs counted there
    warm = sections["warmup"]
    assert warm["schemes"]["keel"]["graphs"] == 2 and warm["schemes"]["pre_ln"]["graphs"] == 1
    assert len({*warm["schemes"]["keel"]["processes"], *warm["schemes"]["pre_ln"]["processes"], os.getpid()}) == 3
    assert warm["keel_over_pre_ln"] == warm["schemes"]["keel"]["first_step_s"] / warm["schemes"]["pre_ln"][
        "first_step_s"]
    assert list(sections["compare"]) == [p["key"] for p in compare_points(suite)] == ["4", "8", "4/batch4"]
    for point in compare_points(suite):
        n, rows = point["n_sublayers"], sections["compare"][point["key"]]
        assert rows["ac_every"] == point["ac_every"] and rows["batch_size"] == point["batch_size"]
        assert [k for k in rows if k not in META] == point["variants"]
        for variant in point["variants"]:
            r = rows[variant]
            assert r["keel_over_pre_ln_step_time"] == r["keel"]["step_time_s"] / r["pre_ln"]["step_time_s"]
            # Keel v2 with n sub-layers has n - 2 junctions (sub-layer 0 has no LN_out; the last has no successor);
            # under AC the kernel fuses only the n/2 - 1 inside blocks 1.. (a checkpointed block takes one tensor),
            # the compiler every one (a block hands on its sum)
            fused = n // 2 - 1 if rows["ac_every"] and variant == "compiled+fused" else n - 2
            assert r["keel"]["fused_junctions"] == (fused if variant in ("compiled+composed", "compiled+fused") else 0)
            assert r["pre_ln"]["fused_junctions"] == 0
    # the 32k-token point's stand-in: 4 sequences a step, the batch-1 points' tokens x 2
    big = sections["compare"]["4/batch4"]["compiled"]
    assert big["keel"]["tokens_per_s"] == pytest.approx(4 * suite.seq_len / big["keel"]["step_time_s"])
    assert set(sections["depth"]["variants"]) == set(suite.depth_variants)
    for depth in sections["depth"]["variants"].values():
        assert [(r["n_sublayers"], r["scheme"]) for r in depth["rows"]] == [
            (n, s) for n in suite.depth_sublayers for s in ("keel", "pre_ln")]
        assert all(r["ms_per_sublayer"] == pytest.approx(1e3 * r["step_time_s"] / r["n_sublayers"])
                   for r in depth["rows"])
        assert set(depth["per_scheme"]["keel"]["ratio_to_first"]) == {str(n) for n in suite.depth_sublayers}
    # nothing runs out of memory on a CPU at toy size: the search doubles up to its limit
    assert sections["max_depth"]["largest"] == suite.max_depth_upto
    assert [t["n_sublayers"] for t in sections["max_depth"]["trials"]] == [4, 8, 16]
    assert (tmp_path / "bench.md").read_text() == gpu_markdown(result)


@pytest.mark.slow
def test_gpu_suite_sections_stop_at_their_time_box_and_keep_what_they_have(tmp_path):
    suite = replace(GpuSuite.toy(), boxes=dict.fromkeys(GPU_SECTIONS, 0.0))
    written = []
    result = gpu_suite(suite, torch.device("cpu"), lambda r: written.append(json.dumps(r)))
    sections = result["sections"]
    assert sections["tests"]["summary"] == "timed out"  # given the 1-second minimum
    assert sections["kernel"]["rows"] == [] and "copy_GBps" in sections["kernel"]
    assert sections["warmup"]["schemes"] == {}  # no process started past the deadline
    assert all(v == {"skipped": "time box reached"} for rows in sections["compare"].values()
               for k, v in rows.items() if k not in META)
    assert all(r["skipped"] == "time box reached" for v in sections["depth"]["variants"].values() for r in v["rows"])
    assert sections["max_depth"]["trials"] == [] and sections["max_depth"]["largest"] is None
    assert all(v == "time box reached" for v in result["status"].values())
    assert len(written) >= 2 * len(GPU_SECTIONS)  # before and after each section at least
    gpu_markdown(result)  # renders partial results


def test_gpu_suite_at_full_size_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    with pytest.raises(ConfigError, match="--toy"):
        bench("--suite", "gpu")


@pytest.mark.slow  # compiles and trains 4 models, then the flatness series
def test_cpu_suite_compares_compiled_and_eager_side_by_side(fake_clock, monkeypatch, tmp_path):
    monkeypatch.setattr(bench_cpu, "machine", lambda device: {"cpu": "x86_64", "cpu_count": 2, "torch_threads": 2,
                                                         "torch_version": "2.x"})
    monkeypatch.setattr(os, "getloadavg", lambda: (0.25, 0.5, 0.75))
    monkeypatch.setattr(bench_flatness, "gc_stats", lambda: {"objects_after_build": 1000, "full_collect_s": 0.002})
    shapes = {"bench": ({"n_blocks": 2, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "max_seq_len": 16}, 2, 16)}
    writes = []
    result = cpu_suite(2, 1, writes.append, max_load=1e9, wait_s=0, shapes=shapes, compile_backend="eager",
                       repeats=2, depths=(4, 8), science_steps=2, warmup_sublayers=4, cold_processes=False,
                       flatness=TINY_FLAT | {"sublayers": (4, 8), "steps": 1, "repeats": 1})
    shape = result["shapes"]["bench"]
    assert set(shape["results"]) == {"keel/eager", "keel/compiled", "pre_ln/eager", "pre_ln/compiled"}
    # 4 sub-layers: Keel 0.20 s, Pre-LN 0.16 s a step on the fake clock, compiled or not; 32 tokens a step
    assert shape["results"]["keel/compiled"]["tokens_per_s"] == pytest.approx(160.0)
    assert shape["keel_over_pre_ln_step_time"]["compiled"]["each"] == pytest.approx([1.25, 1.25])
    assert shape["keel_over_pre_ln_step_time"]["eager"]["median"] == pytest.approx(1.25)
    assert shape["compiled_speedup"]["keel"]["median"] == pytest.approx(1.0)
    # compiled Keel fuses its junctions (1-2 and 2-3 of its 4 sub-layers); eager and Pre-LN have none
    assert shape["fused_junctions"] == {"keel/eager": 0, "keel/compiled": 2, "pre_ln/eager": 0, "pre_ln/compiled": 0}
    # the science series: Keel at 4 and 8 sub-layers, eager and compiled
    assert [r["n_sublayers"] for r in result["science"]["rows"]] == [4, 8]
    assert result["science"]["rows"][1]["ms_per_sublayer"] == pytest.approx({"eager": 50.0, "compiled": 50.0})
    assert result["science"]["ms_per_sublayer_spread"] == pytest.approx({"eager": 0.0, "compiled": 0.0})
    assert result["idle_check"]["idle"]
    # cold warm-up: each scheme's first step alone (4 sub-layers: 0.20 s Keel, 0.16 s Pre-LN on the fake clock)
    cold = result["cold_warmup"]
    assert cold["schemes"]["keel"]["first_step_s"] == pytest.approx(0.20)
    assert cold["keel_over_pre_ln"] == pytest.approx(1.25)
    assert set(result["targets"]["met"]) == {"compiled_keel_over_pre_ln_bench", "compile_time_flat_in_depth",
                                             "ms_per_sublayer_flat_eager", "ms_per_sublayer_flat_compiled",
                                             "keel_warmup_within_1_3x_pre_ln", "ms_per_sublayer_flat_128_1024_keel",
                                             "ms_per_sublayer_flat_128_1024_pre_ln"}
    assert result["targets"]["met"]["keel_warmup_within_1_3x_pre_ln"]
    # after the shape, the warm-up, the science series, each of the 4 flatness models, and with the targets
    assert len(writes) == 8
    assert cpu_markdown(result) == (GOLDEN / "bench-cpu.md").read_text()


@pytest.mark.slow  # 12 models x 4 real steps
def test_flatness_ratios_and_medians_are_those_of_the_clock(fake_clock):
    """Per step 0.1 s of fixed cost plus the scheme's cost per sub-layer; the first timed step of every model 1 s
    slower (the median of the three drops it). Hand-computed: Keel 0.3, 0.5, 0.9 s at 4, 8, 16 sub-layers = 75,
    62.5, 56.25 ms per sub-layer, ratios 1, 5/6, 3/4; Pre-LN 0.26, 0.42, 0.74 s = 65, 52.5, 46.25 ms, ratios 1,
    21/26, 37/52."""
    fake_clock.overhead = lambda config, call: 0.1 + (1.0 if call == 2 else 0.0)  # call 1 is the warm-up
    config = ModelConfig(**TINY_FLAT["model"])
    out = flatness_series(config, RunConfig(batch_size=1, seq_len=8, device="cpu"), (4, 8, 16), steps=3,
                          warmup=1, repeats=2)
    keel, pre_ln = out["per_scheme"]["keel"], out["per_scheme"]["pre_ln"]
    assert keel["ms_per_sublayer"] == pytest.approx({"4": 75.0, "8": 62.5, "16": 56.25})
    assert keel["ratio_to_first"] == pytest.approx({"4": 1.0, "8": 5 / 6, "16": 0.75})
    assert pre_ln["ratio_to_first"] == pytest.approx({"4": 1.0, "8": 21 / 26, "16": 37 / 52})
    assert keel["max_departure"] == pytest.approx(0.25) and pre_ln["max_departure"] == pytest.approx(15 / 52)
    assert keel["flat"] is False and pre_ln["flat"] is False
    assert out["keel_over_pre_ln_step_time"] == pytest.approx({"4": 0.3 / 0.26, "8": 0.5 / 0.42, "16": 0.9 / 0.74})
    # two passes, the second deepest first; each model one warm-up and three timed steps
    assert [(r["repeat"], r["n_sublayers"], r["scheme"]) for r in out["rows"]] == [
        (0, 4, "keel"), (0, 4, "pre_ln"), (0, 8, "keel"), (0, 8, "pre_ln"), (0, 16, "keel"), (0, 16, "pre_ln"),
        (1, 16, "keel"), (1, 16, "pre_ln"), (1, 8, "keel"), (1, 8, "pre_ln"), (1, 4, "keel"), (1, 4, "pre_ln")]
    assert len(fake_clock) == 12 * 4
    assert out["rows"][0]["step_times_s"] == pytest.approx([1.3, 0.3, 0.3])
    # TrainStep keeps the collector out of its steps: none ran inside a timed one
    assert all(r["gc"]["collections_in_timed_steps"] == {} for r in out["rows"])


@pytest.mark.slow
def test_flatness_is_met_when_cost_per_sub_layer_is_constant_and_each_model_is_freed_first(fake_clock, monkeypatch):
    built = []
    real_init = core.Bench.__init__

    def init(self, *args, **kwargs):
        fake_clock.clear()  # what the clock saw holds each step's TrainStep, and so its model
        gc.collect()
        assert all(ref() is None for ref in built), "an earlier model is still alive"
        real_init(self, *args, **kwargs)
        built.append(weakref.ref(self.model))
    monkeypatch.setattr(core.Bench, "__init__", init)
    out = flatness_series(ModelConfig(**TINY_FLAT["model"]), RunConfig(batch_size=1, seq_len=8, device="cpu"),
                          (4, 8), steps=1, warmup=0)
    assert len(built) == 4
    assert all(s["max_departure"] == pytest.approx(0.0) and s["flat"] for s in out["per_scheme"].values())


@pytest.mark.slow
def test_flatness_stops_at_its_deadline_and_does_not_go_deeper_after_running_out_of_memory(fake_clock, monkeypatch):
    def measure(config, *args):
        if config.n_sublayers >= 8 and config.scheme == "keel":
            raise torch.OutOfMemoryError("out of memory")
        return {"step_time_s": 0.01 * config.n_sublayers}
    monkeypatch.setattr(bench_flatness, "measure_one", measure)
    run = RunConfig(batch_size=1, seq_len=8, device="cpu")
    out = flatness_series(ModelConfig(**TINY_FLAT["model"]), run, (4, 8, 16))
    cells = {(r["n_sublayers"], r["scheme"]): r for r in out["rows"]}
    assert cells[(8, "keel")]["failed"] == "out of memory"
    assert cells[(16, "keel")]["skipped"] == "failed at 8 sub-layers" and "step_time_s" in cells[(16, "pre_ln")]
    assert out["per_scheme"]["keel"]["flat"] is None and out["per_scheme"]["pre_ln"]["flat"] is True
    late = flatness_series(ModelConfig(**TINY_FLAT["model"]), run, (4, 8), deadline=0.0)
    assert all(r["skipped"] == "time box reached" for r in late["rows"])
    assert late["per_scheme"]["keel"]["max_departure"] is None


@pytest.mark.slow  # 12 models, bench.json rewritten after each
def test_cpu_flatness_part_writes_its_json_as_it_goes(fake_clock, monkeypatch, tmp_path):
    """`keel bench --suite cpu --sections flatness`: only that part runs, at CPU_FLATNESS's shape (a tiny one
    here), and bench.json is rewritten after every model; its ratios survive the round trip through JSON."""
    monkeypatch.setattr(bench_cpu, "CPU_FLATNESS", TINY_FLAT)
    written = []
    real = bench_cli.writer

    def writer(out, markdown):
        write = real(out, markdown)

        def recorded(result):
            write(result)
            written.append(json.loads((out / "bench.json").read_text()))
        return recorded
    monkeypatch.setattr(bench_cli, "writer", writer)
    bench("--suite", "cpu", "--sections", "flatness", "--idle-wait", "0", "--idle-load", "1e9", "--out",
          str(tmp_path))
    result = json.loads((tmp_path / "bench.json").read_text())
    assert set(result) >= {"flatness", "targets"} and "shapes" in result and not result["shapes"]
    assert "science" not in result and "cold_warmup" not in result
    flat = result["flatness"]
    # fake clock: 0.05 s (Keel) and 0.04 s (Pre-LN) per sub-layer at every depth
    assert flat["per_scheme"]["keel"]["ms_per_sublayer"] == pytest.approx({"4": 50.0, "8": 50.0, "16": 50.0})
    assert flat["per_scheme"]["pre_ln"]["ratio_to_first"] == pytest.approx({"4": 1.0, "8": 1.0, "16": 1.0})
    assert flat["keel_over_pre_ln_step_time"] == pytest.approx({"4": 1.25, "8": 1.25, "16": 1.25})
    assert result["targets"]["met"] == {"ms_per_sublayer_flat_128_1024_keel": True,
                                        "ms_per_sublayer_flat_128_1024_pre_ln": True}
    assert set(flat["load_average"]) == {"before", "after"}
    # one write after each of the 2 x 3 x 2 models, and the final one with the targets
    assert [len(w["flatness"]["rows"]) for w in written if "rows" in w["flatness"]][:12] == list(range(1, 13))
    assert len(written) == 12 + 1
    md = (tmp_path / "bench.md").read_text()
    assert "| 16 | 50.000 | 1.000 | 40.000 | 1.000 | 1.250 |" in md and "keel 0.0% (met)" in md
    assert main(["bench", "--suite", "cpu", "--sections", "flatness,nope", "--idle-wait", "0"]) == 2


def test_the_default_cpu_flatness_is_the_issues_depths_at_a_small_width():
    assert tuple(CPU_FLATNESS["sublayers"]) == (128, 256, 512, 1024)
    assert CPU_FLATNESS["model"]["d_model"] <= 64 and CPU_FLATNESS["batch_size"] == 1 and CPU_FLATNESS["repeats"] >= 3

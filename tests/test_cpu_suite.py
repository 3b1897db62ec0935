"""The project's CPU suite (benchmarks/cpu/suite.py) on the fake clock (conftest's fake_clock): Keel against Pre-LN,
compiled against eager, its ratios and targets, its table against a golden file, each part written as it goes; time
per sub-layer against depth (benchmarks/gpu/flatness.py, which the GPU campaign shares); and the suite's command
line: it reads run.threads of keel's merged config (applied once) and refuses any other field, from a file or an
override alike, in one line."""

import gc
import json
import os
import weakref
from pathlib import Path

import flatness
import pytest
import suite
import torch
from flatness import flatness_series
from suite import CPU_FLATNESS, cpu_markdown, cpu_suite

from keel import runtime
from keel.bench import core as bench_core
from keel.config import RunConfig
from keel.model import ModelConfig

GOLDEN = Path(__file__).parent / "golden"
TINY_FLAT = {"model": {"vocab_size": 64, "d_model": 16, "n_heads": 2, "n_kv_heads": 1, "max_seq_len": 8},
             "batch_size": 1, "seq_len": 8, "sublayers": (4, 8, 16), "steps": 3, "warmup": 1, "repeats": 2,
             "threads": 1}


@pytest.fixture(autouse=True)
def counted_gc(monkeypatch):
    """flatness.gc_stats times a full collection after each model is built: in a process that has imported the
    whole test suite that is about a second each, so the series here record a fixed figure. Each model is still
    freed (a full collection) after it is measured."""
    monkeypatch.setattr(flatness, "gc_stats", lambda: {"objects_after_build": 1000, "full_collect_s": 0.002})


@pytest.mark.slow  # compiles and trains 4 models, then the flatness series
def test_cpu_suite_compares_compiled_and_eager_side_by_side(fake_clock, monkeypatch, tmp_path):
    monkeypatch.setattr(suite, "machine", lambda device: {"cpu": "x86_64", "cpu_count": 2, "torch_threads": 2,
                                                         "torch_version": "2.x"})
    monkeypatch.setattr(os, "getloadavg", lambda: (0.25, 0.5, 0.75))
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
    real_init = bench_core.Bench.__init__

    def init(self, *args, **kwargs):
        fake_clock.clear()  # what the clock saw holds each step's TrainStep, and so its model
        gc.collect()
        assert all(ref() is None for ref in built), "an earlier model is still alive"
        real_init(self, *args, **kwargs)
        built.append(weakref.ref(self.model))
    monkeypatch.setattr(bench_core.Bench, "__init__", init)
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
    monkeypatch.setattr(flatness, "measure_one", measure)
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
    """`benchmarks/cpu/suite.py --sections flatness`: only that part runs, at CPU_FLATNESS's shape (a tiny one
    here), and bench.json is rewritten after every model; its ratios survive the round trip through JSON."""
    monkeypatch.setattr(suite, "CPU_FLATNESS", TINY_FLAT)
    written = []
    real = suite.writer

    def writer(out, markdown):
        write = real(out, markdown)

        def recorded(result):
            write(result)
            written.append(json.loads((out / "bench.json").read_text()))
        return recorded
    monkeypatch.setattr(suite, "writer", writer)
    assert suite.main(["--sections", "flatness", "--idle-wait", "0", "--idle-load", "1e9", "--out",
                       str(tmp_path)]) == 0
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
    assert suite.main(["--sections", "flatness,nope", "--idle-wait", "0"]) == 2


def test_the_default_cpu_flatness_is_the_issues_depths_at_a_small_width():
    assert tuple(CPU_FLATNESS["sublayers"]) == (128, 256, 512, 1024)
    assert CPU_FLATNESS["model"]["d_model"] <= 64 and CPU_FLATNESS["batch_size"] == 1 and CPU_FLATNESS["repeats"] >= 3


class Merged(Exception):
    """Raised where the suite, its config merged, would start its work: the threads it applies."""


def _outcome(argv, monkeypatch, capsys):
    """('accepted', threads applied) or ('refused', the error line)."""
    def set_threads(n=0):
        raise Merged(n)
    monkeypatch.setattr(runtime, "set_threads", set_threads)
    try:
        code = suite.main(argv)
    except Merged as merged:
        return "accepted", merged.args[0]
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, (code, err)
    return "refused", err.removeprefix(f"{suite.COMMAND}: error: ")


@pytest.mark.parametrize("key, value, refused", [
    ("run.threads", 3, None),
    ("run.batch_size", 3, "run.batch_size: not used by benchmarks/cpu/suite.py (a fixed campaign)")])
def test_the_suite_reads_run_threads_alone_from_a_file_or_an_override_alike(key, value, refused, tmp_path,
                                                                          monkeypatch, capsys):
    """A fixed campaign: of keel's merged config it reads run.threads, applied once with the merged value; any other
    field is refused in one line, from a YAML file as from an override."""
    by_override = _outcome(["--idle-wait", "0", f"{key}={value}"], monkeypatch, capsys)
    section, leaf = key.split(".")
    (tmp_path / "c.yaml").write_text(f"{section}:\n  {leaf}: {value}\n")
    by_file = _outcome(["--idle-wait", "0", "--config", str(tmp_path / "c.yaml")], monkeypatch, capsys)
    assert by_override == by_file == (("refused", refused) if refused else ("accepted", value))


def test_the_suite_refuses_a_preset_in_one_line(capsys):
    assert suite.main(["--preset", "tiny"]) == 2
    assert capsys.readouterr().err == ("benchmarks/cpu/suite.py: error: --preset: not used by "
                                       "benchmarks/cpu/suite.py (a fixed campaign)\n")

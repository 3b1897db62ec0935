"""`keel bench` on a tiny shape: both schemes timed on the same batches, and its outputs written; the cpu and gpu
suites at toy size, end to end."""

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from keel.errors import ConfigError
from keel.experiments.bench import (
    GPU_SECTIONS,
    Bench,
    GpuSuite,
    cpu_markdown,
    cpu_suite,
    gpu_markdown,
    gpu_suite,
    register,
    to_markdown,
)
from keel.model.config import ModelConfig
from keel.model.transformer import TransformerLM
from keel.runtime import resolve_device

REPO = Path(__file__).resolve().parents[1]


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
    kernel = sections["kernel"]
    assert [r["width"] for r in kernel["rows"]] == list(suite.kernel_widths) and kernel["copy_GBps"] > 0
    for row in kernel["rows"]:
        for impl in ("fused", "unfused", "compiled"):
            assert row[impl]["fwd_GBps"] == pytest.approx(row["bytes_fwd"] / row[impl]["fwd_s"] / 1e9)
    for n in suite.compare_sublayers:
        rows = sections["compare"][str(n)]
        assert rows["ac_every"] == (1 if n >= suite.ac_from else 0)
        for variant in ("eager", "compiled", "compiled+fused"):
            r = rows[variant]
            assert r["keel_over_pre_ln_step_time"] == r["keel"]["step_time_s"] / r["pre_ln"]["step_time_s"]
            # Keel v2 with n sub-layers has n - 2 junctions (sub-layer 0 has no LN_out; the last has no successor)
            assert r["keel"]["fused_junctions"] == (n - 2 if variant == "compiled+fused" else 0)
            assert r["pre_ln"]["fused_junctions"] == 0
    depth = sections["depth"]["rows"]
    assert [r["n_sublayers"] for r in depth] == list(suite.depth_sublayers)
    assert all(r["ms_per_sublayer"] == pytest.approx(1e3 * r["step_time_s"] / r["n_sublayers"]) for r in depth)
    # nothing runs out of memory on a CPU at toy size: the search doubles up to its limit
    assert sections["max_depth"]["largest"] == suite.max_depth_upto
    assert [t["n_sublayers"] for t in sections["max_depth"]["trials"]] == [4, 8, 16]
    assert (tmp_path / "bench.md").read_text() == gpu_markdown(result)


def test_gpu_suite_sections_stop_at_their_time_box_and_keep_what_they_have(tmp_path):
    suite = replace(GpuSuite.toy(), boxes=dict.fromkeys(GPU_SECTIONS, 0.0))
    written = []
    result = gpu_suite(suite, torch.device("cpu"), lambda r: written.append(json.dumps(r)))
    sections = result["sections"]
    assert sections["tests"]["summary"] == "timed out"  # given the 1-second minimum
    assert sections["kernel"]["rows"] == [] and "copy_GBps" in sections["kernel"]
    assert all(v == {"skipped": "time box reached"} for rows in sections["compare"].values()
               for k, v in rows.items() if k != "ac_every")
    assert all(r["skipped"] == "time box reached" for r in sections["depth"]["rows"])
    assert sections["max_depth"]["trials"] == [] and sections["max_depth"]["largest"] is None
    assert all(v == "time box reached" for v in result["status"].values())
    assert len(written) >= 2 * len(GPU_SECTIONS)  # before and after each section at least
    gpu_markdown(result)  # renders partial results


def test_gpu_suite_at_full_size_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["bench", "--suite", "gpu"])
    with pytest.raises(ConfigError, match="--toy"):
        args.func(args)


def test_cpu_suite_compares_compiled_and_eager_side_by_side(tmp_path):
    shapes = {"bench": ({"n_blocks": 2, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "max_seq_len": 16}, 2, 16)}
    writes = []
    result = cpu_suite(2, 1, writes.append, max_load=1e9, wait_s=0, shapes=shapes, compile_backend="eager")
    shape = result["shapes"]["bench"]
    assert set(shape["results"]) == {"keel/eager", "keel/compiled", "pre_ln/eager", "pre_ln/compiled"}
    t = {k: r["step_time_s"] for k, r in shape["results"].items()}
    assert shape["keel_over_pre_ln_step_time"]["compiled"] == t["keel/compiled"] / t["pre_ln/compiled"]
    assert shape["compiled_speedup"]["keel"] == t["keel/eager"] / t["keel/compiled"]
    assert len(shape["load_average"]["before"]) == 3 and result["idle_check"]["idle"]
    assert set(result["targets"]["met"]) == {"compiled_keel_over_pre_ln_bench"}
    assert "Keel / Pre-LN step time: eager" in cpu_markdown(result)

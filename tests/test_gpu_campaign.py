"""The GPU campaign (benchmarks/gpu/), checked on a CPU: the campaign end to end at toy size, its sections within
their time boxes, its parts each fitting a short window and the README giving each part's command, the performance
model's prediction beside each cell, the command line's reads of keel's merged config; its plan fits each part in
its time box by the calibrated model (plan.py), the profiler's kernel categories and counts (kernel_profile.py, on
recorded CUDA kernel names and on CPU operators), the window driver at toy size, and PhaseClock against known
delays."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import campaign
import pytest
import torch
from campaign import GPU_PARTS, GPU_SECTIONS, META, GpuSuite, compare_points, gpu_markdown, gpu_suite, predicted

from keel import runtime
from keel.bench import perf_model as pm

REPO = Path(__file__).resolve().parents[1]


def test_the_gpu_campaign_compares_at_32k_tokens_per_step_with_checkpointing():
    points = compare_points(GpuSuite())
    big = [p for p in points if p["batch_size"] * GpuSuite().seq_len >= 32768]
    assert big and all(p["ac_every"] == 1 and "compiled" in p["variants"] for p in big)
    assert any(p["batch_size"] == 1 and p["n_sublayers"] == 64 for p in points)  # the batch 1 x 4096 point stays
    suite = GpuSuite()
    assert suite.depth_d_model == 512 and suite.depth_sublayers == (128, 256, 512, 1024)
    assert suite.depth_variants == ("eager", "compiled")


@pytest.mark.slow
def test_every_gpu_part_fits_its_boxes_by_the_calibrated_model_and_the_readme_says_so():
    pytest.importorskip("scipy")
    from plan import plan, plan_markdown

    p = plan()
    assert all(s["predicted_s"] <= s["box_s"] for s in p["sections"].values())
    assert all(part["predicted_s"] <= part["box_s"] <= 480 for part in p["parts"].values())
    assert sum(part["box_s"] for part in p["parts"].values()) <= 1800
    assert plan_markdown(p) in (REPO / "benchmarks" / "gpu" / "README.md").read_text()


def test_profile_categories_name_real_cuda_kernels():
    """kernel_profile sorts kernels by name: names as torch.profiler records them on Hopper GPUs (cuBLAS, flash
    and cuDNN attention, Inductor's Triton kernels, also those fused into attention's inputs, the fused AdamW,
    copies) land in their category."""
    from kernel_profile import category

    expect = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
        "__5x_cublas": "matmul",
        "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN": "matmul",
        "triton_tem_fused_mm_0": "matmul",
        "aten::mm": "matmul",
        "aten::linear": "other",  # a wrapper: its aten::mm is the matmul
        "pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128>>":
            "attention",
        "cudnn::fusion::compute_dot_do_o_specialized": "attention",
        "triton_red_fused__to_copy_add_mul_pow_rsqrt_sum_3": "reduction (compiled)",
        "triton_per_fused_add_mul_rsqrt_5": "reduction (compiled)",
        "triton_poi_fused__to_copy_mul_silu_7": "pointwise (compiled)",
        "triton_poi_fused__scaled_dot_product_efficient_attention__to_copy__unsafe_view_add_cat_cos_2":
            "pointwise (compiled)",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>":
            "optimizer",
        "Memcpy HtoD (Pageable -> Device)": "copy",
        "void at::native::elementwise_kernel<128, 2, direct_copy_kernel_cuda>": "copy",
        "aten::add": "other",
    }
    assert {name: category(name) for name in expect} == expect


def test_profile_counts_device_kernels_once_on_cuda():
    """On CUDA only device kernels count: not host operators, nor the annotation the optimizer's step leaves on the
    device's timeline (it spans kernels already counted: torch.profiler lists it with device type CUDA)."""
    from types import SimpleNamespace

    from kernel_profile import kernel_times

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(key, device_type, us, annotation=False):
        return SimpleNamespace(key=key, device_type=device_type, is_user_annotation=annotation, count=2,
                               self_device_time_total=us if device_type == cuda else 0, self_cpu_time_total=us)
    events = [event("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN", cuda, 3000),
              event("multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", cuda, 500),
              event("Optimizer.step#AdamW.step", cuda, 510, annotation=True),
              event("aten::mm", cpu, 40), event("aten::_fused_adam_", cpu, 30)]
    times = kernel_times(SimpleNamespace(key_averages=lambda: events), cuda=True)
    assert times["matmul"] == {"ms": 3.0, "count": 2} and times["optimizer"] == {"ms": 0.5, "count": 2}
    assert sum(t["ms"] for t in times.values()) == 3.5
    host = kernel_times(SimpleNamespace(key_averages=lambda: events), cuda=False)
    assert host["matmul"] == {"ms": 0.04, "count": 2} and host["optimizer"]["ms"] == 0.03
    events += [event("triton_red_fused_add_mul_rsqrt_sum_3", cuda, 200), event("triton_red_fused_add_mul_rsqrt_sum_17",
                                                                                 cuda, 100),
               event("graph_1_cpp_fused_add_mean_mul_pow_rsqrt_3", cuda, 50),
               event("graph_0_cpp_fused_add_mean_mul_pow_rsqrt", cuda, 50)]
    by_name = kernel_times(SimpleNamespace(key_averages=lambda: events), cuda=True, by="name")
    assert by_name["triton_red_fused_add_mul_rsqrt_sum"] == {"ms": pytest.approx(0.3), "count": 4}  # numbers go
    assert set(by_name) == {"nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN",
                            "multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>",
                            "triton_red_fused_add_mul_rsqrt_sum", "cpp_fused_add_mean_mul_pow_rsqrt"}
    assert by_name["cpp_fused_add_mean_mul_pow_rsqrt"] == {"ms": pytest.approx(0.1), "count": 4}  # graphs merged too


@pytest.mark.slow
def test_profile_counts_the_matmuls_a_dispatch_counter_counts_and_keels_extra_norm():
    """Profiled on CPU (eager, host operators), a step's matrix products are as many as a dispatch-level counter
    (tests/op_count.py) sees in the same step, the same for Keel and Pre-LN; Keel runs more norm operators
    (its LN_out); the table has a row per category."""
    from kernel_profile import NAMES, profile_markdown, profile_schemes

    from keel.bench.core import Bench
    from op_count import OpCounter

    suite = GpuSuite.toy()
    bench = Bench(suite.model(4), suite.run(), device=torch.device("cpu"))
    bench.step()
    with OpCounter() as counter:
        bench.step()
    matmuls = sum(counter.ops[name] for name in ("mm", "addmm", "bmm", "baddbmm"))
    r = profile_schemes(suite.model(4), suite.run(), ["keel", "pre_ln"], torch.device("cpu"), steps=1, warmup=1)
    keel, pre = r["schemes"]["keel"]["categories"], r["schemes"]["pre_ln"]["categories"]
    assert keel["matmul"]["count"] == pre["matmul"]["count"] == matmuls > 0
    assert keel["norm (eager)"]["count"] > pre["norm (eager)"]["count"]
    for s in ("keel", "pre_ln"):  # the same time and kernels, sorted by name instead of by category
        by_name, total = r["schemes"][s]["by_name"], r["schemes"][s]["total_ms"]
        assert sum(t["ms"] for t in by_name.values()) == pytest.approx(total, rel=1e-9)
        kinds = r["schemes"][s]["categories"].values()
        assert sum(t["count"] for t in by_name.values()) == sum(t["count"] for t in kinds)
    table = profile_markdown(r)
    assert all(f"| {c} |" in table for c in NAMES) and "Keel - Pre-LN" in table and "differs most" in table


@pytest.mark.slow
def test_the_gpu_window_driver_runs_its_parts_at_toy_size(tmp_path):
    """benchmarks/gpu/window.py (one short device call) at CPU-test size: every part asked for ends "done" and
    its table is written, so a window on a lent GPU is not lost to a bug in the driver (one was, 2026-11-26)."""
    out = tmp_path / "window"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "window.py"), str(out), "--toy",
                          "--parts", "profile,bf16,presets,compare64,tokens512", "--seconds", "400"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((out / "window.json").read_text())
    assert result["status"] == {"profile": "done", "bf16": "done", "presets": "2 done", "compare64": "done",
                                "tokens512": "done"}
    assert [(r["preset"], r["weights"]) for r in result["presets"]] == [
        ("paper-2048", "bfloat16"), ("paper-1024", "float32"), ("paper-2048", "float32")]
    assert set(result["profile"]["schemes"]) == {"keel", "pre_ln"}
    table = (out / "window.md").read_text()
    assert "## profile" in table and "Keel - Pre-LN ms" in table and "| paper-1024 |" in table


def test_phase_clock_puts_a_known_delay_in_the_phase_it_happens_in(monkeypatch):
    """kernel_profile.PhaseClock against delays of known length on a clock only they move: 300 ms inside the
    model's forward (a block's forward hook) land in "forward", 500 ms inside its backward (the block's backward hook)
    in "backward", none in "rest"; afterwards the step has no clock hooks left and its own `after_backward` back."""
    import types

    import kernel_profile as profile

    from keel.bench.core import Bench

    now = [100.0]  # seconds; the model's own work takes no time on this clock
    monkeypatch.setattr(profile, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    suite = GpuSuite.toy()
    bench = Bench(suite.model(4), replace(suite.run(), compile=False), device=torch.device("cpu"))
    block = bench.model.blocks[0]
    block.register_forward_hook(lambda *_: now.__setitem__(0, now[0] + 0.3))
    block.register_full_backward_hook(lambda *_: now.__setitem__(0, now[0] + 0.5))

    def mine(model):
        return None

    bench.train_step.after_backward = mine
    got = profile.PhaseClock(bench).run(2)
    assert got == {"forward": pytest.approx(300.0), "backward": pytest.approx(500.0), "rest": 0.0}
    assert not bench.model._forward_hooks and not bench.model._forward_pre_hooks
    assert bench.train_step.after_backward is mine


@pytest.mark.slow
def test_gpu_suite_runs_end_to_end_at_toy_size(tmp_path):
    """`python benchmarks/gpu/campaign.py --toy`, as CI runs it: every section, with the fused junction through
    triton's interpreter (a child process: the interpreter must be on before triton is first imported)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu" / "campaign.py"), "--toy", "--out",
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


def test_gpu_suite_at_full_size_needs_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    assert campaign.main([]) == 2
    assert "--toy" in capsys.readouterr().err


def test_gpu_campaign_prediction_column():
    suite = GpuSuite.toy()  # predicts with the H100 spec so CI exercises the column
    p = predicted(suite, torch.device("cpu"), 4, "compiled", 0)
    expected = pm.predict_pair(suite.model(4), suite.batch_size, suite.seq_len, pm.DEVICES["H100"], "compiled",
                               False, 0, pm.Code(sum_handoff=False))
    assert p["device"] == "H100" and p["keel"]["step_time_s"] == expected["keel"]["step_time_s"]
    assert p["keel_over_pre_ln_step_time"] == expected["keel_over_pre_ln_step_time"]
    assert predicted(GpuSuite(), torch.device("cpu"), 4, "eager", 0) is None  # no spec for a CPU by name
    # a point at more tokens per step (the campaign's 8 x 4096 with checkpointing) is predicted at its batch
    # ("compiled" is the junction inside each block: under AC a Keel block then ends with LN_out, no SumHandoff)
    big = predicted(suite, torch.device("cpu"), 4, "compiled", 1, batch_size=8)
    expected = pm.predict_pair(suite.model(4), 8, suite.seq_len, pm.DEVICES["H100"], "compiled", False, 1,
                               pm.Code(sum_handoff=False))
    assert big["keel"]["tokens_per_s"] == expected["keel"]["tokens_per_s"]
    handoff = predicted(suite, torch.device("cpu"), 4, "compiled+composed", 1, batch_size=8)
    assert handoff["keel"]["step_time_s"] < big["keel"]["step_time_s"]  # one matmul a block fewer recomputed
    assert handoff["pre_ln"]["step_time_s"] == big["pre_ln"]["step_time_s"]


def test_the_gpu_campaign_parts_cover_every_section_once_and_each_fits_an_8_minute_window():
    boxes = GpuSuite().boxes
    assert sorted(s for part in GPU_PARTS.values() for s in part) == sorted(GPU_SECTIONS)
    assert all(sum(boxes[s] for s in part) <= 480 for part in GPU_PARTS.values())
    assert sum(boxes.values()) <= 1800
    readme = (REPO / "benchmarks" / "gpu" / "README.md").read_text()
    for part in GPU_PARTS.values():  # the README gives each part's command as the code defines the part
        assert f"python benchmarks/gpu/campaign.py --sections {','.join(part)} --out" in readme


class Merged(Exception):
    """Raised where the campaign, its config merged, would start its work: the threads it applies."""


@pytest.mark.parametrize("key, value, refused", [
    ("run.device", "cpu", None),
    ("model.d_model", 64, "model.d_model: not used by benchmarks/gpu/campaign.py (a fixed campaign; it takes "
                          "run.device)")])
def test_the_campaign_reads_run_device_and_threads_alone_from_a_file_or_an_override_alike(key, value, refused,
                                                                                        tmp_path, monkeypatch,
                                                                                        capsys):
    def set_threads(n=0):
        raise Merged(n)
    monkeypatch.setattr(runtime, "set_threads", set_threads)

    def outcome(argv):
        try:
            code = campaign.main(argv)
        except Merged:
            return "accepted"
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, (code, err)
        return err.removeprefix(f"{campaign.COMMAND}: error: ")
    section, leaf = key.split(".")
    (tmp_path / "c.yaml").write_text(f"{section}:\n  {leaf}: {value}\n")
    assert outcome([f"{key}={value}"]) == outcome(["--config", str(tmp_path / "c.yaml")]) == (refused or "accepted")

"""The GPU campaign, checked on a CPU: its plan fits each part in its time box by the calibrated model
(keel.bench.gpu_plan), the profiler's kernel categories and counts (keel.bench.profile, on recorded CUDA kernel
names and on CPU operators), the window driver at toy size, and PhaseClock against known delays."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from keel.bench.gpu import GpuSuite, compare_points

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
    from keel.bench.gpu_plan import plan, plan_markdown

    p = plan()
    assert all(s["predicted_s"] <= s["box_s"] for s in p["sections"].values())
    assert all(part["predicted_s"] <= part["box_s"] <= 480 for part in p["parts"].values())
    assert sum(part["box_s"] for part in p["parts"].values()) <= 1800
    assert plan_markdown(p) in (REPO / "benchmarks" / "gpu" / "README.md").read_text()


def test_profile_categories_name_real_cuda_kernels():
    """keel.bench.profile sorts kernels by name: names as torch.profiler records them on Hopper GPUs (cuBLAS, flash
    and cuDNN attention, Inductor's Triton kernels, also those fused into attention's inputs, the fused AdamW,
    copies) land in their category."""
    from keel.bench.profile import category

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

    from keel.bench.profile import kernel_times

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
    (keel.bench.core.OpCounter) sees in the same step, the same for Keel and Pre-LN; Keel runs more norm operators
    (its LN_out); the table has a row per category."""
    from keel.bench.core import Bench, OpCounter
    from keel.bench.gpu import GpuSuite
    from keel.bench.profile import NAMES, profile_markdown, profile_schemes

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
    """keel.bench.profile.PhaseClock against delays of known length on a clock only they move: 300 ms inside the
    model's forward (a block's forward hook) land in "forward", 500 ms inside its backward (the block's backward hook)
    in "backward", none in "rest"; afterwards the step has no clock hooks left and its own `after_backward` back."""
    import types

    import keel.bench.profile as profile
    from keel.bench.core import Bench
    from keel.bench.gpu import GpuSuite

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

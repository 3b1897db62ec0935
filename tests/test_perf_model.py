"""The performance model (keel.bench.perf_model) against independent counts: matmul FLOPs by hand and by torch's
FlopCounterMode, the parameters its weight casts imply against a built model, and every byte an eager step moves
counted op by op by a dispatch mode (float32 and bf16 autocast); the roofline's bound switching; fused < compiled <
eager bytes; the committed predicted.md equal to what the code generates; the CLI (the GPU campaign's column:
test_gpu_campaign.py; the fit to measured GPU figures: test_gpu_calibration.py)."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import validate_model
from campaign import gpu_spec
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from keel.bench import perf_model as pm
from keel.cli import main
from keel.config import load_config
from keel.model import ModelConfig, TransformerLM, flops_per_token
from keel.model.layers import RMSNorm
from keel.runtime import PEAK_BF16

REPO = Path(__file__).resolve().parents[1]
TINY = {"vocab_size": 64, "d_model": 64, "n_blocks": 4, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 32}
# ops that move no data (views, metadata) or that the model books as matmul / attention, not as memory traffic
NO_DATA = {"view", "_unsafe_view", "t", "transpose", "expand", "slice", "detach", "alias", "reshape", "unsqueeze",
           "squeeze", "permute", "as_strided", "select", "promote_types", "empty", "empty_like", "lift_fresh"}
COMPUTE = {"mm", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"}


class ByteCount(TorchDispatchMode):
    """Bytes every aten op reads and writes: each tensor argument and output once, a broadcast (stride-0) tensor
    at the size of its storage."""

    def __init__(self):
        super().__init__()
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[1]
        if name not in NO_DATA:
            moved = sum(min(t.nbytes, t.untyped_storage().nbytes())
                        for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
            self.by_op[name] = self.by_op.get(name, 0) + moved
        return out


def test_attention_sublayer_matmul_flops_by_hand():
    cfg = ModelConfig(**TINY)  # M = 2 x 8 tokens, d 64, q 64 (4 heads of 16), kv 32 (2 heads)
    ops = pm._branch(cfg, "attn", 16, 2, 8, 4, False, "eager")
    by_hand = 3 * 2 * 16 * (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64)  # wq, wk, wv, wo; forward, dX, dW
    assert sum(o.flops for o in ops if o.kind == "matmul") == by_hand
    causal_scores = 4 * 2 * 8 * 8 * 64 / 2  # QK^T and AV over half the (8 x 8) score matrix, all 4 heads
    assert sum(o.flops for o in ops if o.kind == "attention") == causal_scores * 3.5


def test_matmul_flops_equal_torch_flop_counter():
    cfg = ModelConfig(**TINY)
    model, idx = TransformerLM(cfg), torch.randint(0, 64, (4, 32))
    with FlopCounterMode(display=False) as counter:
        _, loss = model(idx, targets=idx)
        loss.backward()
    ops = pm.step_ops(cfg, 4, 32, False, "eager")
    mm = counter.get_flop_counts()["Global"][torch.ops.aten.mm]
    assert sum(o.flops for o in ops if o.kind == "matmul") == mm


def test_a_step_on_a_flops_only_device_is_its_counted_flops_over_the_peaks():
    """predict's step time, on a device with endless bandwidth and free launches, is torch's counted matmul FLOPs
    over the matmul peak plus the attention FLOPs counted by hand over the attention peak, at the precision asked."""
    cfg = ModelConfig(**TINY)
    model, idx = TransformerLM(cfg), torch.randint(0, 64, (4, 32))
    with FlopCounterMode(display=False) as counter:
        _, loss = model(idx, targets=idx)
        loss.backward()
    mm = counter.get_flop_counts()["Global"][torch.ops.aten.mm]
    attention = cfg.n_blocks * 4 * 4 * 32 * 32 * 64 / 2 * 3.5  # as test_attention_sublayer_matmul_flops_by_hand
    dev = pm.DeviceSpec("flops-only", 4e12, 1e12, 1e30, 1.0, "test", matmul_eff=0.5, attention_eff=0.25,
                        memory_eff=1.0, launch_s={"eager": 0.0, "compiled": 0.0})
    for bf16, peak in ((True, 4e12), (False, 1e12)):
        step = pm.predict(cfg, 4, 32, dev, "eager", bf16=bf16)["step_time_s"]
        assert step == pytest.approx(mm / (0.5 * peak) + attention / (0.25 * peak), rel=1e-9), bf16


def test_weight_casts_imply_the_built_models_linear_parameters():
    cfg = ModelConfig(**TINY)
    M = 4 * 32
    casts = sum(o.bytes for o in pm.step_ops(cfg, 4, 32, True, "eager") if o.group == "casts" and o.phase == "fwd")
    implied = (casts - 6 * M * cfg.d_model) / 6  # 6 bytes per weight (fp32 read, bf16 written); less the head input
    built = sum(p.numel() for p in TransformerLM(cfg).blocks.parameters() if p.dim() == 2)
    assert implied == built


def test_eager_rmsnorm_bytes_written_out():
    M, d = 64, 256
    x, g = torch.randn(M, d, requires_grad=True), torch.randn(M, d)
    with ByteCount() as fwd:
        y = RMSNorm(d)(x)
    with ByteCount() as bwd:
        y.backward(g)
    fb, _, bb, _ = pm.EAGER_NORM["rmsnorm"]
    # per-row scalars (mean, rsqrt, their gradients) add a few bytes per row; d=256 keeps them under 1%
    assert sum(fwd.by_op.values()) / (M * d) == pytest.approx(fb, rel=0.01)
    assert sum(bwd.by_op.values()) / (M * d) == pytest.approx(bb, rel=0.01)


@pytest.mark.parametrize("scheme", ["keel", "pre_ln"])
@pytest.mark.parametrize("bf16", [False, True])
def test_eager_step_bytes_equal_a_count_of_every_op(scheme, bf16):
    """Forward and backward of a real model, every aten op's bytes counted, against the model's memory bytes
    (and the matmuls' exactly); the optimizer is left out of both."""
    cfg = ModelConfig(**TINY, scheme=scheme)
    model, idx = TransformerLM(cfg), torch.randint(0, 64, (4, 32))
    with ByteCount() as count:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(idx, targets=idx)
        loss.backward()
    ops = pm.step_ops(cfg, 4, 32, bf16, "eager")
    memory = sum(o.bytes for o in ops if o.kind == "memory" and o.group != "optimizer")
    assert memory == pytest.approx(sum(v for k, v in count.by_op.items() if k not in COMPUTE), rel=0.005)
    assert sum(o.bytes for o in ops if o.kind == "matmul") == count.by_op["mm"]


def test_checkpointed_recompute_skips_the_last_matmul_where_the_partitioner_does():
    """Under AC a compiled block recomputes only what its backward reads (tests/test_gpu_path.py counts the matmuls
    in the partitioned graphs): not the FFN's down projection, 2*M*f*d FLOPs, when the block's output is not a norm's
    output (Pre-LN; Keel handing on its sum); an eager checkpoint replays its whole forward."""
    config = ModelConfig(vocab_size=256, d_model=64, n_blocks=4, n_heads=4, n_kv_heads=2, max_seq_len=32)
    M, f, d = 2 * 32, config.ffn_dim, config.d_model

    def recompute(scheme, impl, **code):
        ops = pm.step_ops(replace(config, scheme=scheme), 2, 32, False, impl, 1, pm.Code(**code))
        return sum(o.flops for o in ops if o.phase == "recompute" and o.kind == "matmul")
    full = recompute("pre_ln", "eager")
    assert recompute("keel", "eager") == full
    assert recompute("pre_ln", "compiled") == full - 4 * 2 * M * f * d  # 4 blocks, each one down projection
    assert recompute("keel", "compiled") == recompute("pre_ln", "compiled")
    assert recompute("keel", "compiled", sum_handoff=False) == full  # a block that ends with LN_out
    assert recompute("keel", "compiled+fused") == full  # the kernel's junctions stay inside blocks under AC
    assert recompute("post_ln", "compiled") == full  # its backward reads norm_out's input
    assert recompute("peri_ln", "compiled") == full  # and Peri-LN's the branch norm's


def test_the_junctions_second_norm_backward_is_a_kernel_of_its_own_unless_the_pair_is_one_op():
    """The H100 profile (benchmarks/gpu/h100-2026-11-26-c.md) counted 126 RMSNorm-backward kernels a step for Keel
    against Pre-LN's 64 at 64 sub-layers, compiled default: 62 more, one per junction. The model charges each
    of them: a kernel that reads its norm's float32 input and the gradient the kernel before it wrote, and writes
    its own (3 x 4 bytes per element); with keel.kernels.norm_pair's one-pass backward, none (PREDICTED)."""
    def norms(scheme, one_pass):
        cfg = pm.paper_config(1024, 64, scheme)
        ops = pm.step_ops(cfg, 8, 4096, True, "compiled", 1, pm.Code(one_pass_norms=one_pass))
        bwd = [o for o in ops if o.group == "norm+junction" and o.phase == "bwd"]
        return sum(o.launches for o in bwd), sum(o.bytes for o in bwd)
    root = pm.EAGER_NORM["rmsnorm"]  # Pre-LN's final norm runs eager at the root, Keel's last sum is normed there
    (keel_k, _), (pre_k, _) = norms("keel", False), norms("pre_ln", False)
    assert keel_k - (pre_k - root[3]) == 62  # Keel's first sub-layer has no norm_out: 62 junctions with two
    one_k, _ = norms("keel", True)
    assert one_k == pre_k - root[3]
    keel, pre = (pm.paper_config(1024, 64, s) for s in ("keel", "pre_ln"))
    specs = {s: [pm.build_scheme(c).spec(i, k) for i, k in enumerate(["attn", "ffn"] * 2)] for s, c in
             (("keel", keel), ("pre_ln", pre))}

    def junction(s, mode, one_pass):  # between the first block's FFN and the second's attention, bf16
        return pm._boundary(keel, specs[s][1], specs[s][2], 3, 2, True, mode, pm.Code(one_pass_norms=one_pass))
    assert junction("keel", "handoff", False)[2] - junction("pre_ln", "split", False)[2] == 3 * 4 * 1024
    assert junction("keel", "handoff", True)[2:] == junction("pre_ln", "split", True)[2:]  # Pre-LN's cost


def test_the_gpu_is_its_exact_part_not_a_fragment_of_its_name():
    assert gpu_spec("NVIDIA H100 80GB HBM3").name == "H100"
    pcie = gpu_spec("NVIDIA H100 PCIe")
    assert pcie.name == "H100 PCIe" and pcie.bf16_flops == 756e12 and pcie.bandwidth == 2.0e12
    assert gpu_spec("NVIDIA H100 NVL").bf16_flops == 835e12
    assert gpu_spec("NVIDIA H200").bf16_flops == 989e12 and gpu_spec("NVIDIA H200 NVL").bf16_flops == 835e12
    assert gpu_spec("NVIDIA A100-SXM4-80GB").name == "A100"
    assert gpu_spec("H100") is None and gpu_spec("NVIDIA H100 SOMETHING") is None


def test_the_optimizer_is_fused_adamw_on_cuda_a_pass_over_each_state_once():
    cfg = pm.paper_config(1024, 64)
    n = pm.count_params(cfg)
    fused = next(o for o in pm.step_ops(cfg, 1, 4096, True, "compiled") if o.group == "optimizer")
    foreach = next(o for o in pm.step_ops(cfg, 1, 4096, True, "compiled", 0, pm.Code(fused_adamw=False))
                   if o.group == "optimizer")
    assert fused.bytes == (7 * 4 + 12) * n  # p, g, m, v read, p, m, v written; clipping's 12
    assert foreach.bytes == (84 + 12) * n


@pytest.mark.parametrize("d,n", [(1024, 64), (2048, 512)])
def test_fused_junction_moves_fewer_bytes_than_compiled_than_eager(d, n):
    def moved(scheme, impl):
        cfg = pm.paper_config(d, n, scheme)
        return sum(o.bytes for o in pm.step_ops(cfg, 1, 4096, True, impl) if o.group == "norm+junction")
    assert moved("keel", "compiled+fused") < moved("keel", "compiled") < moved("keel", "eager")
    assert moved("pre_ln", "compiled+fused") == moved("pre_ln", "compiled")  # no junction to fuse


def test_mfu_is_bench_convention_and_peaks_are_runtimes():
    cfg = pm.paper_config(1024, 64)
    p = pm.predict(cfg, 1, 4096, pm.DEVICES["H100"], "compiled")
    assert p["mfu"] == pytest.approx(p["tokens_per_s"] * flops_per_token(cfg, 4096) / PEAK_BF16["H100"])
    assert p["tokens_per_s"] == pytest.approx(4096 / p["step_time_s"])
    assert p["step_time_s"] == pytest.approx(sum(g["time_s"] for g in p["groups"].values()))
    assert all(pm.DEVICES[g].bf16_flops == PEAK_BF16[g] for g in pm.DEVICES)
    assert gpu_spec("Tesla T4") is None


@pytest.mark.slow
def test_committed_predictions_are_what_the_code_generates():
    from predicted import paper_markdown  # benchmarks/gpu/predicted.py (on the path: tests/conftest.py)

    assert (REPO / "benchmarks" / "gpu" / "predicted.md").read_text() == paper_markdown()


def test_cli_prints_the_prediction_table(capsys):
    overrides = ["model.d_model=64", "run.seq_len=32"]
    assert main(["bench", "--preset", "tiny", "--model-gpu", "H100", *overrides]) == 0
    text = capsys.readouterr().out
    assert "PREDICTED" in text and "H100" in text and "d=64" in text
    config = load_config(overrides, None, "tiny")
    spec = pm.calibrated("H100")  # fitted to the newest measured run (test_gpu_calibration.py)
    pair = pm.predict_pair(config.model, config.run.batch_size, 32, spec, "eager")
    assert f"calibrated on the measured run {spec.calibrated}" in text and spec.calibrated.startswith("H100 ")
    assert f"| eager | {1e3 * pair['keel']['step_time_s']:.1f} | {1e3 * pair['pre_ln']['step_time_s']:.1f} |" in text
    assert f"{pair['keel_over_pre_ln_step_time']:.3f}" in text
    assert main(["bench", "--model-gpu", "H100", "run.steps=3"]) == 2  # not read: refused
    assert "run.steps: not used by keel bench" in capsys.readouterr().err


@pytest.mark.slow  # a 6.5B-parameter plan through the CLI
def test_the_prediction_and_the_dry_run_give_one_memory_verdict(capsys):
    # paper-1024 fits one H100 only with its memory options (8-bit moments, checkpointing): the prediction reads
    # the run's own plan, not float32 weights and moments (which do not fit)
    assert main(["bench", "--preset", "paper-1024", "--model-gpu", "H100"]) == 0
    text = capsys.readouterr().out
    from keel.reporting.plan import memory_plan
    from keel.scale.memory import estimate_memory

    config = load_config([], None, "paper-1024")
    planned = memory_plan(config, device=torch.device("cuda"))["total"]
    # one usable figure for an 80 GB H100: 78.4 GiB (CUDA's 79.18 GiB less the 0.74 GiB the context kept)
    assert f"{planned / 2**30:.1f} GiB: fits in 78.4 GiB" in text
    plain = estimate_memory(config.model, 1, 4096, config.run.ac_every, bf16_autocast=True)["total"]
    assert plain > pm.DEVICES["H100"].memory >= planned


def test_validation_reports_predicted_against_measured(monkeypatch):
    measured = {"keel": 0.010, "pre_ln": 0.008}

    def fake_compare(config, run, schemes, steps, warmup):
        return {s: {"step_time_s": measured[s]} for s in schemes} | {"keel_over_pre_ln_step_time": 1.25}
    monkeypatch.setattr("keel.bench.core.compare", fake_compare)
    result = validate_model.validate(steps=1, warmup=0, shapes=((32, 2, 2, 16),))
    row = result["rows"][0]
    for s in ("keel", "pre_ln"):
        assert row[s]["error"] == pytest.approx(row[s]["predicted_s"] / measured[s] - 1)
    assert result["max_abs_error"] == max(abs(row[s]["error"]) for s in ("keel", "pre_ln"))
    assert row["device"]["bandwidth_GBps"] > 0 and "Largest |error|" in validate_model.validation_markdown(result)


def test_the_mfu_peak_is_the_exact_devices_not_a_name_fragments():
    """MFU divides by keel.runtime.peak_of(CUDA name), matched whole: an H100 PCIe card is 756 TFLOP/s dense bf16
    (its datasheet), not the SXM part's 989 that the fragment "H100" matched; an unknown name has no peak; every
    part the performance model knows has the same peak there."""
    from keel.runtime import CUDA_NAMES, peak_of

    datasheet = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
                 "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12, "NVIDIA A100-SXM4-80GB": 312e12,
                 "NVIDIA A100 80GB PCIe": 312e12}
    assert {name: peak_of(name) for name in datasheet} == datasheet
    assert peak_of("NVIDIA H100 SOMETHING NEW") is None and peak_of("Tesla T4") is None
    for name in CUDA_NAMES:
        spec = gpu_spec(name)
        assert spec is None or spec.bf16_flops == peak_of(name), name

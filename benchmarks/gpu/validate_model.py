"""The performance model's CPU twin (keel.bench.perf_model): this machine's rates measured with torch, fed to the
same model, its predicted eager float32 steps against steps `keel bench` measures at three fixed shapes (was `keel
bench --validate-model`, which wrote this folder's validation.md and validation.json).

    python benchmarks/gpu/validate_model.py [--steps 10] [--warmup 3] [--threads N] [--out benchmarks/gpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from keel.bench.perf_model import EAGER_NORM, GB, DeviceSpec, S, predict_pair
from keel.model import ModelConfig


def time_call(fn, device, calls: int = 10, repeats: int = 5) -> float:
    """Median over `repeats` of the mean seconds per call over `calls` back-to-back calls, after one warm-up."""
    import torch  # noqa: PLC0415

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    means = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        means.append((time.perf_counter() - start) / calls)
    return statistics.median(means)


def measure_cpu(config: ModelConfig, batch: int, seq: int, repeats: int = 5) -> DeviceSpec:
    """A DeviceSpec of this CPU at `config`'s shape: bandwidth of an add over stream-sized float32 tensors (the
    size the step's elementwise ops touch), float32 GEMM FLOP/s over the step's own matmuls (each in its forward,
    input-gradient and weight-gradient layout), SDPA forward+backward FLOP/s at the shape, and the host time per
    launch of a tiny eager RMSNorm forward+backward. Rates are used as measured (efficiency 1); launches add to
    the work (no overlap on a CPU); a foreach op is one dispatch (its loop over the tensors runs in C++)."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    from keel.model.layers import RMSNorm  # noqa: PLC0415

    cpu, M, d = torch.device("cpu"), batch * seq, config.d_model
    q, kv, f = config.n_heads * config.head_dim, config.kv_heads * config.head_dim, config.ffn_dim
    a, b, out = torch.randn(M * d), torch.randn(M * d), torch.empty(M * d)
    bandwidth = 3 * S * M * d / time_call(lambda: torch.add(a, b, out=out), cpu, repeats=repeats)
    gemms = [(M, d, q), (M, d, kv), (M, d, kv), (M, q, d), (M, d, f), (M, f, d), (M, d, config.vocab_size)]
    if config.ffn == "swiglu":
        gemms.append((M, d, f))
    flops = seconds = 0.0
    for m, k, n in gemms:  # each as the step runs it: forward, input gradient, weight gradient
        x, w, dy = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)  # nn.Linear keeps W as (out, in)
        for a, b in ((x, w.t()), (dy, w), (dy.t(), x)):
            seconds += time_call(lambda a=a, b=b: a @ b, cpu, repeats=repeats)
            flops += 2 * m * k * n
    qt, kt, vt = (torch.randn(batch, h, seq, config.head_dim, requires_grad=True)
                  for h in (config.n_heads, config.kv_heads, config.kv_heads))

    def attention():
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=config.kv_heads != config.n_heads)
        o.backward(torch.ones_like(o))
    attention_rate = 3.5 * 4 * batch * seq * seq * q / 2 / time_call(attention, cpu, repeats=repeats)

    # host time per launch: an eager RMSNorm forward+backward (the op mix that dominates eager launches: broadcasts,
    # reductions, autograd nodes saving tensors) on 4 x 8 elements, where moving data costs nothing
    norm, x, g = RMSNorm(8), torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    _, fwd_launches, _, bwd_launches = EAGER_NORM["rmsnorm"]
    launch = time_call(lambda: norm(x).backward(g), cpu, calls=20, repeats=repeats) / (fwd_launches + bwd_launches)
    gemm_rate = flops / seconds
    return DeviceSpec(f"cpu (measured, {torch.get_num_threads()} threads)", gemm_rate, gemm_rate, bandwidth,
                      float("inf"), "measured by benchmarks/gpu/validate_model.py", matmul_eff=1.0,
                      attention_eff=attention_rate / gemm_rate, memory_eff=1.0,
                      launch_s={"eager": launch, "compiled": launch}, overlap=False, foreach_batch=1 << 30)


# (d_model, sub-layers, batch, seq): three CPU shapes of the validation
VALIDATION_SHAPES = ((64, 16, 8, 64), (128, 32, 16, 128), (256, 8, 4, 256))


def validation_config(d: int, n_sublayers: int, seq: int) -> ModelConfig:
    return ModelConfig(d_model=d, n_blocks=n_sublayers // 2, n_heads=max(2, d // 32), n_kv_heads=max(1, d // 64),
                       max_seq_len=seq)


def validate(steps: int = 10, warmup: int = 3, shapes=VALIDATION_SHAPES) -> dict:
    """Predicted (from `measure_cpu`) against measured (keel.bench.core.compare) eager float32 step times."""
    from keel.bench.core import compare  # noqa: PLC0415
    from keel.config import RunConfig  # noqa: PLC0415
    from keel.runtime import machine  # noqa: PLC0415

    rows = []
    for d, n, batch, seq in shapes:
        config = validation_config(d, n, seq)
        device = measure_cpu(config, batch, seq)
        predicted = predict_pair(config, batch, seq, device, "eager", bf16=False)
        run = RunConfig(batch_size=batch, seq_len=seq, device="cpu", dtype="float32", fused_junction="off")
        measured = compare(config, run, ["keel", "pre_ln"], steps, warmup)
        rows.append({"d_model": d, "n_sublayers": n, "batch": batch, "seq": seq, "device": {
            "bandwidth_GBps": device.bandwidth / GB, "gemm_GFLOPs": device.fp32_flops / 1e9,
            "attention_GFLOPs": device.fp32_flops * device.attention_eff / 1e9,
            "launch_us": 1e6 * device.launch_s["eager"]}, **{s: {
                "predicted_s": predicted[s]["step_time_s"], "measured_s": measured[s]["step_time_s"],
                "error": predicted[s]["step_time_s"] / measured[s]["step_time_s"] - 1} for s in ("keel", "pre_ln")},
            "ratio": {"predicted": predicted["keel_over_pre_ln_step_time"],
                      "measured": measured["keel_over_pre_ln_step_time"]}})
    return {"machine": machine("cpu"), "steps": steps, "warmup": warmup, "rows": rows,
            "max_abs_error": max(abs(r[s]["error"]) for r in rows for s in ("keel", "pre_ln"))}


def validation_markdown(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Performance model, CPU twin: predicted vs measured eager float32 step ({m['cpu']}, "
             f"{m['torch_threads']} threads, torch {m['torch_version']})", "",
             f"Measured: `keel bench` step timing, {result['steps']} steps after {result['warmup']} warm-up, median. "
             "Predicted: keel.bench.perf_model with this machine's rates measured at each shape.", "",
             "| d | sub-layers | batch x seq | GB/s | GEMM GFLOP/s | SDPA GFLOP/s | us/op | scheme | predicted (ms) "
             "| measured (ms) | error |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        dev = r["device"]
        for s in ("keel", "pre_ln"):
            lines.append(f"| {r['d_model']} | {r['n_sublayers']} | {r['batch']} x {r['seq']} | "
                         f"{dev['bandwidth_GBps']:.1f} | {dev['gemm_GFLOPs']:.1f} | {dev['attention_GFLOPs']:.1f} | "
                         f"{dev['launch_us']:.1f} | {s} | {1e3 * r[s]['predicted_s']:.2f} | "
                         f"{1e3 * r[s]['measured_s']:.2f} | {r[s]['error']:+.1%} |")
    lines += ["", "Keel/Pre-LN: " + ", ".join(f"d={r['d_model']}: predicted {r['ratio']['predicted']:.3f}, measured "
                                              f"{r['ratio']['measured']:.3f}" for r in result["rows"]),
              "", f"Largest |error|: **{result['max_abs_error']:.1%}** (target: within 25%)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per scheme")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per scheme first")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: keel's default)")
    p.add_argument("--out", help="directory for validation.md and validation.json (default: print only)")
    args = p.parse_args(argv)
    from keel import runtime  # noqa: PLC0415

    runtime.set_threads(args.threads)
    result = validate(args.steps, args.warmup)
    text = validation_markdown(result)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "validation.md").write_text(text)
        (out / "validation.json").write_text(json.dumps(result, indent=1))
        print(f"written: {out / 'validation.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

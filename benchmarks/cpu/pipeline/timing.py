"""The pipeline benchmark: the step time of a model pipelined over the ranks (keel.scale.pipeline), for each
schedule, against one process on the same cores.

`torchrun --nproc_per_node=2 --standalone -m benchmarks.cpu.pipeline.timing --out DIR`, from the repository root,
writes bench.json and bench.md (this folder's are its committed run).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from keel.config import OptimConfig, RunConfig
from keel.model import ModelConfig, TransformerLM, cpu_demo
from keel.runtime import machine
from keel.train.optim import build_optimizer
from keel.train.pipeline_step import PipelineStep
from keel.train.step import Batch, TrainStep, build_model


def _seconds_per_step(step: TrainStep, batch: Batch, steps: int, warmup: int) -> float:
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        step(lambda: batch, 1e-4)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _bench_batch(config: ModelConfig, batch_size: int, seq_len: int) -> Batch:
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1], ids[:, 1:]


def bench_one_process(config: ModelConfig, batch_size: int, seq_len: int, threads: int, steps: int = 5,
                      warmup: int = 2) -> float:
    """Seconds per training step (forward, backward, clip, AdamW; the median of `steps` after `warmup`) of
    `config` in this process alone, on `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = TransformerLM(config)
        step = TrainStep(model, build_optimizer(model, OptimConfig(lr=1e-4, warmup_steps=0)))
        return _seconds_per_step(step, _bench_batch(config, batch_size, seq_len), steps, warmup)
    finally:
        torch.set_num_threads(before)


def bench_pipeline(config: ModelConfig, batch_size: int, seq_len: int, schedule: str = "1f1b", microbatches: int = 4,
                   steps: int = 5, warmup: int = 2) -> dict:
    """The same step as `bench_one_process`, pipelined over every rank of the running process group with
    `schedule`, on the same batch. Call on every rank (under torchrun); every rank returns the record."""
    pp = dist.get_world_size()
    run = RunConfig(batch_size=batch_size, seq_len=seq_len, pp=pp, pp_schedule=schedule, pp_microbatches=microbatches,
                    fused_junction="off")
    torch.manual_seed(0)
    model = build_model(config, run, torch.device("cpu"))
    step = PipelineStep(model, build_optimizer(model, OptimConfig(lr=1e-4, warmup_steps=0)))
    seconds = torch.tensor(_seconds_per_step(step, _bench_batch(config, batch_size, seq_len), steps, warmup))
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest stage's clock
    return {"stages": pp, "schedule": schedule, "microbatches": microbatches, "batch_size": batch_size,
            "seq_len": seq_len, "threads_per_stage": torch.get_num_threads(),
            "split": [[r.start, r.stop] for r in model.spans],
            "pipeline_s": seconds.item(), "pipeline_tokens_per_s": batch_size * seq_len / seconds.item()}


def write_bench(out: Path, records: list[dict], config: ModelConfig, load: tuple[float, float]) -> None:
    """bench.json (records, model, machine, load averages) and bench.md (one row per schedule) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    result = {"records": records, "model": config.__dict__, "machine": machine("cpu"),
              "load_average_before": load[0], "load_average_after": load[1]}
    (out / "bench.json").write_text(json.dumps(result, indent=1) + "\n")
    r0 = records[0]
    lines = [f"# Pipeline-parallel step time on CPU: {r0['stages']} stages vs 1 process", "",
             f"d_model={config.d_model}, {config.n_sublayers} sub-layers, batch {r0['batch_size']} x {r0['seq_len']} "
             f"tokens, {r0['microbatches']} micro-batches; each stage {r0['threads_per_stage']} thread(s), the single "
             f"process {r0['one_process_threads']}; load average {load[0]:.2f} before, {load[1]:.2f} after.", "",
             f"| schedule | blocks per stage | 1 process, {r0['one_process_threads']} threads (s/step) | 1 process, "
             "1 thread (s/step) | pipeline (s/step) | pipeline / 1 process | pipeline / 1 thread |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        split = ", ".join(str(b - a) for a, b in r["split"])
        lines.append(f"| {r['schedule']} | {split} | {r['one_process_s']:.3f} | {r['one_thread_s']:.3f} | "
                     f"{r['pipeline_s']:.3f} | {r['pipeline_over_one']:.2f} | {r['pipeline_over_one_thread']:.2f} |")
    (out / "bench.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> None:
    """`torchrun --nproc_per_node=2 -m benchmarks.cpu.pipeline.timing --out DIR`: the step time of the cpu-demo model
    (or `--n-blocks`/`--d-model`) pipelined over the ranks, for each schedule, against one process."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--out", default="benchmarks/cpu/pipeline")
    p.add_argument("--schedules", default="1f1b,gpipe,interleaved_1f1b,zbv")
    p.add_argument("--n-blocks", type=int, default=16)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    try:
        config = cpu_demo(n_blocks=args.n_blocks, d_model=args.d_model, max_seq_len=args.seq_len)
        before = os.getloadavg()[0]
        records = [bench_pipeline(config, args.batch_size, args.seq_len, name, args.microbatches, args.steps)
                   for name in args.schedules.split(",")]
        dist.barrier()
        if dist.get_rank() == 0:  # the other ranks wait: the single process gets the cores the stages had
            threads = torch.get_num_threads() * dist.get_world_size()
            one = bench_one_process(config, args.batch_size, args.seq_len, threads, args.steps)
            # also on one thread: under contention a multi-threaded process can be slower than a single thread
            single = bench_one_process(config, args.batch_size, args.seq_len, 1, args.steps)
            for r in records:
                r |= {"one_process_threads": threads, "one_process_s": one, "pipeline_over_one": r["pipeline_s"] / one,
                      "one_process_tokens_per_s": args.batch_size * args.seq_len / one,
                      "one_thread_s": single, "pipeline_over_one_thread": r["pipeline_s"] / single}
            write_bench(Path(args.out), records, config, (before, os.getloadavg()[0]))
            print((Path(args.out) / "bench.md").read_text())
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

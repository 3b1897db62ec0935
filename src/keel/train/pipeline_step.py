"""The training step under pipeline parallelism (keel.scale.pipeline), and its step-time benchmark.

`PipelineStep` is `TrainStep` with the forward/backward replaced by one pipeline schedule step: clipping, the
divergence guard and the optimiser step are TrainStep's own, so they mean the same thing in both. Two things
make TrainStep's clipping and guard right across stages (and, with dp replicas, across shards):
  - every rank gets its replica's loss (the last stage broadcasts it), and TrainStep's mean over all ranks
    (`world`) is the global batch's loss, so the guard decides alike everywhere;
  - the gradient norm is the norm over every stage's parameters and every shard (see `_AllStages`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from keel.model import ModelConfig, TransformerLM, cpu_demo
from keel.runtime import machine
from keel.scale.pipeline import PipelineModel, build_pipeline, split_blocks
from keel.train.config import OptimConfig, RunConfig
from keel.train.guard import DivergenceGuard
from keel.train.optim import build_optimizer
from keel.train.step import Batch, StepResult, TrainStep


class _AllStages:
    """What TrainStep clips: this rank's gradients, plus one stand-in tensor whose gradient is the rest of the
    global norm, sqrt(total^2 - mine^2), with total^2 summed over every rank (all stages and, under FSDP2, all
    shards). `clip_grad_norm_` over them returns the norm over the whole model's gradients, the same on every
    rank, and clips by it, as in one process.

    Under FSDP2 (dp > 1) a parameter and its gradient are DTensors, which `clip_grad_norm_` cannot mix with the
    stand-in; it gets plain tensors holding the local shards instead, each with its gradient's local shard
    (a view: clipping it scales the DTensor's gradient in place)."""

    def __init__(self, model: PipelineModel):
        self.model = model
        self.rest = torch.zeros(1, device=next(model.parameters()).device)
        self.local: list[torch.Tensor] = []

    def parameters(self) -> list[torch.Tensor]:
        return [*self.local, self.rest]

    def gather_norm(self) -> None:
        self.local = []
        for p in self.model.parameters():
            if p.grad is None:
                continue
            if isinstance(p, DTensor):
                shard = p.to_local().detach()
                shard.grad = p.grad.to_local()
                p = shard
            self.local.append(p)
        grads = [p.grad.detach().float() for p in self.local]
        mine = torch.stack([g.pow(2).sum() for g in grads]).sum() if grads else self.rest.new_zeros(())
        total = mine.clone()
        dist.all_reduce(total)  # every rank: each holds a disjoint part of the model's gradients
        self.rest.grad = (total - mine).clamp_min(0).sqrt().reshape(1)  # non-finite stays non-finite


def _keep_hyperparameters(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Optimizer load pre-hook. DCP stores the optimiser's param_groups (names and hyper-parameters) once, from
    one rank; a stage whose parameter names are not in that copy gets groups without hyper-parameters. They are
    the run's configuration either way: take them from the optimiser as built."""
    for saved, group in zip(state_dict["param_groups"], optimizer.param_groups):
        for key, value in group.items():
            if key != "params":
                saved.setdefault(key, value)
    return state_dict


class PipelineStep(TrainStep):
    """`TrainStep` for a `PipelineModel`: the `grad_accum` batches are joined and run as one schedule step of
    `run.pp_microbatches x grad_accum` micro-batches (equal-sized, so the mean loss and gradients are those
    TrainStep would accumulate). Same call: `step(next_batch, lr) -> StepResult`. `after_backward` sees the
    PipelineModel."""

    def __init__(self, model: PipelineModel, optimizer: torch.optim.Optimizer, *, grad_accum: int = 1,
                 grad_clip: float = 1.0, autocast=contextlib.nullcontext, guard: DivergenceGuard | None = None,
                 world=None, after_backward: Callable[[torch.nn.Module], None] | None = None):
        self.pipeline = model
        super().__init__(_AllStages(model), optimizer, grad_accum=grad_accum, grad_clip=grad_clip, autocast=autocast,
                         guard=guard, world=world, after_backward=after_backward)
        optimizer.register_load_state_dict_pre_hook(_keep_hyperparameters)

    @property
    def after_backward(self) -> Callable[[torch.nn.Module], None] | None:
        return self._after_backward

    @after_backward.setter
    def after_backward(self, hook: Callable[[torch.nn.Module], None] | None) -> None:
        # TrainStep passes its `model` (here the clipping view): hand the hook the PipelineModel instead
        self._after_backward = None if hook is None else (lambda _: hook(self.pipeline))

    def forward_backward(self, next_batch: Callable[[], Batch]) -> torch.Tensor:
        batches = [next_batch() for _ in range(self.grad_accum)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])  # (grad_accum * B, T)
        with self.autocast():
            loss = self.pipeline.forward_backward(x, y)
        self.model.gather_norm()
        return loss


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
    run = RunConfig(batch_size=batch_size, seq_len=seq_len, pp=pp, pp_schedule=schedule, pp_microbatches=microbatches)
    torch.manual_seed(0)
    model = build_pipeline(config, run, torch.device("cpu"))
    step = PipelineStep(model, build_optimizer(model, OptimConfig(lr=1e-4, warmup_steps=0)))
    seconds = torch.tensor(_seconds_per_step(step, _bench_batch(config, batch_size, seq_len), steps, warmup))
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest stage's clock
    return {"stages": pp, "schedule": schedule, "microbatches": microbatches, "batch_size": batch_size,
            "seq_len": seq_len, "threads_per_stage": torch.get_num_threads(),
            "split": [[r.start, r.stop] for r in split_blocks(config, len(model.spans))],
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
    """`torchrun --nproc_per_node=2 -m keel.train.pipeline_step --out DIR`: the step time of the cpu-demo model
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


__all__ = ["PipelineStep", "StepResult", "bench_one_process", "bench_pipeline", "main", "write_bench"]


if __name__ == "__main__":
    main()

"""The training loop: one run directory (keel.runs.run_dir), resumable, with divergence handling; under torchrun
every rank runs it on its share of each global batch, rank 0 alone writing (docs/internals.md#keeltraintrainer)."""

from __future__ import annotations

import contextlib
import gc
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from keel import evals, runtime
from keel.config import TrainConfig
from keel.data import WindowSampler, prepare
from keel.data.tokenizer import planned_vocab_size
from keel.errors import ConfigError, DataError, KeelError
from keel.model import count_params, flops_per_token
from keel.reporting import tracking
from keel.reporting.plan import check_fits, memory_line
from keel.reporting.tables import flat_scores
from keel.reporting.tracking import Trackers
from keel.runs import checkpoint, resume
from keel.runs.run_dir import RunDir
from keel.runtime import autocast_for, busy_note, peak_flops, provenance, resolve_device
from keel.scale import distributed
from keel.train.evaluate import bytes_per_token, evaluate
from keel.train.guard import Diverged, DivergenceGuard, handle_divergence
from keel.train.optim import build_optimizer, lr_at
from keel.train.step import TrainStep, build_model, on_device
from keel.train.stop import DeferredStop
from keel.train.task_eval import score_tasks
from keel.train.telemetry import Telemetry

PROGRESS_EVERY_S = 30.0  # seconds between progress lines when output is not a terminal


class Trainer:
    """Trains `config` into a run directory: `run_dir` if given (a path or RunDir), the run being resumed
    (`config.resume`), or a new one under run.out_dir. `callbacks` are called as `cb(trainer, step)` before
    each step (tests use them to inject faults)."""

    def __init__(self, config: TrainConfig, run_dir=None, callbacks=()):
        self.config, self.callbacks = config, list(callbacks)
        c = config
        self.device = resolve_device(c.run.device)
        if run_dir is None and not c.resume:
            RunDir.check_new(c)  # on every rank, so all of them fail alike before the rendezvous
        # joining the group is a rendezvous: no rank writes anything before every rank got this far
        self.world = distributed.init(self.device.type)
        if self.device.type == "cuda" and self.world.distributed:
            self.device = torch.device("cuda", self.world.local_rank)
        self.run_dir = self._run_dir(run_dir)
        new_run = not c.resume
        if self.world.main:
            self.run_dir.lock()  # one trainer per run directory; held until run() ends or the process does
        try:
            self._build()
        except BaseException:
            if self.world.main and new_run:  # a failed start leaves nothing that blocks a retry
                self.run_dir.discard_if_unused()
            raise

    def _build(self) -> None:
        c = self.config
        # the `keel` command applied it already (the same value: no change); a library user's Trainer applies it here
        self.threads = runtime.set_threads(c.run.threads)
        pp = c.run.pp > 1  # pipeline stages (keel.scale.pipeline); FSDP2 then only within a stage's dp group
        self.fsdp = self.world.distributed and not pp
        # under FSDP2, bf16 comes from its mixed-precision policy (bf16 weights) instead of autocast
        self.autocast = contextlib.nullcontext if self.fsdp else autocast_for(self.device, c.run.dtype)
        if c.run.deterministic:
            torch.use_deterministic_algorithms(True)
        torch.manual_seed(c.run.seed)

        planned = planned_vocab_size(c.data.tokenizer)  # before minutes of tokenizer training, not after
        if planned is not None and planned > c.model.vocab_size:
            raise ConfigError(f"model.vocab_size: {c.model.vocab_size} is smaller than the {planned} tokens of "
                              f"data.tokenizer={c.data.tokenizer}; set model.vocab_size={planned}")
        if not self.world.main:  # rank 0 tokenises into the cache first; the others then read it
            distributed.barrier(self.world)
        self.data = prepare(c.data)
        # the probes' items too (cut from the validation split), so a corpus too small for one fails now
        self.eval_tasks = evals.resolve(c.run.eval_tasks)
        evals.prepare(self.eval_tasks, c.data, self.data.tokenizer)
        if self.world.main:
            distributed.barrier(self.world)
        check_fits(c, self.data, self.world.size, self.device)  # before anything is allocated or written
        self.model = build_model(c.model, c.run, self.device, fsdp=self.fsdp)
        self.optimizer = build_optimizer(self.model, c.optim)
        # data-parallel replicas: every rank, or under pp the mesh's dp coordinate (a replica's stages read one batch)
        self.replicas, self.replica = (self.model.dp_size, self.model.dp_rank) if pp else (self.world.size,
                                                                                          self.world.rank)
        # each batch's ids are checked; `source` (the shard set, or a .bin) names it in the message
        self.sampler = WindowSampler(self.data.train, c.run.seq_len, c.run.batch_size, seed=c.run.seed,
                                     rank=self.replica, world_size=self.replicas, vocab_size=c.model.vocab_size,
                                     source=getattr(self.data.train, "filename", None) or self.data.cache_path)
        self.guard = DivergenceGuard(c.guard, c.model.vocab_size)
        if pp:  # torch.distributed.pipelining takes seconds to import: only a pipelined run pays for it
            from keel.train.pipeline_step import PipelineStep
        self.train_step = (PipelineStep if pp else TrainStep)(
            self.model, self.optimizer, grad_accum=c.run.grad_accum, grad_clip=c.optim.grad_clip,
            autocast=self.autocast, guard=self.guard, world=self.world)
        # sub-layer hooks would make compiled blocks recompile: then only gradient norms are recorded
        self.telemetry = Telemetry(self.model, self.world, activations=not c.run.compile) \
            if c.run.telemetry_every and not pp else None
        if self.world.main:
            tracking.check(c.run.log_to)
        self.trackers = None
        self.token_bytes = bytes_per_token(self.data.tokenizer)
        self.flops_per_token = flops_per_token(c.model, c.run.seq_len)
        peak = peak_flops(self.device)
        self.peak_flops = peak * self.world.size if peak else None  # of all ranks' devices together
        # state that checkpoints carry besides weights and optimiser
        self.step, self.draws, self.lr_scale, self.rollbacks = 0, 0, 1.0, 0
        # wall time of earlier segments (from the checkpoint resumed) plus this one's, since the run started
        self.wall_before, self.wall_loaded, self.segment_start = 0.0, 0.0, time.time()
        self.skip_draws: set[int] = set()
        self.global_batch = c.run.batch_size * self.replicas  # sequences per micro-batch, all ranks
        self.tokens_per_step = self.global_batch * c.run.grad_accum * c.run.seq_len

    def _run_dir(self, run_dir) -> RunDir:
        """Rank 0 makes or opens the directory; every rank then uses rank 0's path (an unnamed run is named
        by the clock, which may differ between ranks)."""
        path, made = None, ()
        if self.world.main:
            if run_dir is not None:
                try:  # before any work, so an unwritable place fails at once
                    Path(run_dir).mkdir(parents=True, exist_ok=True)
                except OSError as err:
                    raise ConfigError(f"run.out_dir: cannot create run directory {run_dir}: {err.strerror}") from None
                path = Path(run_dir)
            elif self.config.resume:
                path = RunDir.open(self.config.resume).path
            else:
                created = RunDir.create(self.config)
                path, made = created.path, created.made
        return RunDir(distributed.broadcast_object(str(path) if path else None, self.world), made)

    # ---- state ------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        state = {"optimizer": self.optimizer.state_dict(), "sampler": self.sampler.state_dict(),
                 "torch_rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        meta = {"draws": self.draws, "lr_scale": self.lr_scale, "rollbacks": self.rollbacks,
                "skip_draws": sorted(self.skip_draws), "guard": self.guard.state_dict(),
                "world_size": self.world.size, "global_batch": self.global_batch,
                "wall_seconds": self.wall_before + time.time() - self.segment_start}
        keep = self.config.run.keep_checkpoints
        if self.world.distributed:
            del state["optimizer"]  # DCP writes it, sharded, with the weights
            return checkpoint.save_sharded(self.run_dir, self.step, self.model, self.optimizer, state, meta, keep,
                                           main=self.world.main)
        return checkpoint.save(self.run_dir, self.step, self.model, state, meta, keep)

    def load_checkpoint(self, path: Path) -> None:
        if checkpoint.is_sharded(path):
            state, meta = checkpoint.load_sharded(path, self.model, self.optimizer)
            resume.check_resumable(path, state, meta, sharded=True)
        elif self.world.distributed:
            raise ConfigError(f"resume: {path} was written by a single process; resume it in one process "
                              "(a torchrun checkpoint resumes on any number of processes, not the reverse)")
        else:
            state, meta = checkpoint.load(path, self.model)
            resume.check_resumable(path, state, meta)  # weights only (keel import-hf), or a field missing
            self.optimizer.load_state_dict(state["optimizer"])
        saved_batch = meta.get("global_batch", self.global_batch)
        if saved_batch != self.global_batch:
            raise ConfigError(f"resume: run.batch_size x processes = {self.global_batch} sequences, but the checkpoint "
                              f"was written with {saved_batch} ({meta.get('world_size')} processes); keep the global "
                              "batch when changing the number of processes")
        self.sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(state["torch_rng"])
        if "cuda_rng" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        self.step, self.draws = meta["step"], meta["draws"]
        wall = meta.get("wall_seconds")  # the run's earlier segments (0 from checkpoints older than the field)
        self.wall_loaded = float(wall) if type(wall) in (int, float) and 0 <= wall < 1e12 else 0.0
        self.lr_scale, self.rollbacks = meta["lr_scale"], meta["rollbacks"]
        self.skip_draws = set(meta["skip_draws"])
        self.guard.load_state_dict(meta["guard"])

    # ---- logging ----------------------------------------------------------------------------
    def log(self, record: dict) -> None:
        if self.world.main:
            self.run_dir.log(record)
            if self.trackers is not None:
                self.trackers.log(record)

    # ---- the loop ---------------------------------------------------------------------------
    def next_batch(self):
        while self.draws in self.skip_draws:  # batches a rollback decided to skip
            self.sampler.next_batch()
            self.draws += 1
        batch = self.sampler.next_batch()
        self.draws += 1
        return on_device(batch, self.device)

    def run(self, resume_from: Path | None = None) -> dict:
        # everything built so far (the model, its optimiser, torch's and keel's own objects) lives until the run
        # ends: frozen, Python's collector no longer walks it at every full collection between steps (about
        # 300,000 objects before any model, plus about 110,000 for 1024 sub-layers at d=32:
        # benchmarks/cpu/flatness), and it is thawed on the way out
        # (only where nothing was frozen before: a caller's own freeze is left as it is)
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.collect()
            gc.freeze()
        try:
            return self._run(resume_from)
        finally:  # however the run ends, the next process may take the directory
            if freeze:
                gc.unfreeze()
            if self.world.main:
                self.run_dir.unlock()

    def _run(self, resume_from: Path | None) -> dict:
        """Start (or resume), train until run.steps, an interruption or a divergence, then write the summary."""
        if self.world.main:  # temporary checkpoint directories a killed process left behind
            checkpoint.clean_stale_tmp(self.run_dir)
        if resume_from is not None:
            resume_from = resume.load_newest(resume_from, self.load_checkpoint, lambda m: self.say(m, sys.stderr))
            if self.step >= self.config.run.steps:
                self.say(f"keel: {self.run_dir} already finished {self.step} steps; extend it with run.steps=N")
                self._leave_group()
                return self.run_dir.summary() or {"diverged": False, "interrupted": False}
            self._record_resume(resume_from)
        elif self.world.main:
            self._record_start()
        self._start_tracking(first=resume_from is None)
        self.wall_before, self.segment_start = self.wall_loaded, time.time()
        start_step = self.step
        outcome = self._loop()
        return self._finish(outcome, time.time() - self.segment_start, start_step)

    def _record_resume(self, resume_from: Path) -> None:
        if self.world.main:  # a changed run.steps must survive the next interruption
            self.run_dir.truncate_log(self.step)
            self.run_dir.write_config(self.config)
        self.say(f"keel: resuming {self.run_dir} from step {self.step} ({resume_from.name})")

    def _record_start(self) -> None:
        """Rank 0: what runs (config, provenance, tokenizer) into the new run directory."""
        info = provenance(self.config.run.seed, self.device) | {
            "data": self.data.corpus_info, "tokenizer": self.data.tokenizer.name, "world_size": self.world.size,
            "fsdp": self.fsdp}
        try:
            self.run_dir.write_config(self.config)
            self.run_dir.write_provenance(info)
            self.run_dir.save_tokenizer(self.data.tokenizer)
        except (OSError, KeelError) as err:  # a full disk at start: leave nothing that blocks a retry
            self.run_dir.discard_untrained()
            if isinstance(err, KeelError):
                raise
            raise DataError(f"{self.run_dir}: cannot write the run's files ({err.strerror or err})") from None

    def _start_tracking(self, first: bool) -> None:
        """Trackers, the rollback policy's first checkpoint, and the run's one-line description."""
        c = self.config
        if self.world.main and c.run.log_to:
            self.trackers = Trackers(c.run.log_to, self.run_dir, c)
        if first and c.guard.policy == "rollback":
            self.save_checkpoint()  # something to roll back to before the first periodic checkpoint
        on = f"{self.world.size} x {self.device.type} (FSDP2)" if self.fsdp else str(self.device)
        if self.device.type == "cpu":
            on += f", {self.threads} thread{'s' if self.threads > 1 else ''} (run.threads)"
        n_params = count_params(c.model)
        self.say(f"keel: {c.model.scheme} model, {c.model.n_blocks} blocks = {c.model.n_sublayers} sub-layers, "
                 f"{n_params:,} parameters, {c.run.steps} steps of {self.tokens_per_step:,} tokens on {on}")
        self.say(f"keel: memory per process: {self.memory_line()}")
        if self.device.type == "cpu" and busy_note(self.threads):  # stdout, with the header: not an error
            self.say(busy_note(self.threads))
        if self.eval_tasks:
            when = f"every {c.run.eval_tasks_every} steps and at the end" if c.run.eval_tasks_every else "at the end"
            self.say(f"keel: tasks {', '.join(t.name for t in self.eval_tasks)}: up to {c.run.eval_tasks_items} "
                     f"items each, {when}")

    def _boundary(self) -> tuple:
        """What a step draws from (sampler, draws, RNG): restored when an interruption tears a step."""
        return self.sampler.state_dict(), self.draws, torch.get_rng_state()

    def _loop(self) -> dict:
        """Steps until run.steps; returns the outcome (diverged, interrupted, the last losses)."""
        c = self.config
        outcome = {"diverged": False, "divergence_reason": None, "interrupted": False, "train_loss": float("nan"),
                   "val": {}, "tasks": {}}
        shown = c.run.progress and self.world.main
        # a terminal gets tqdm's bar; a file or pipe gets a plain line at least every PROGRESS_EVERY_S instead
        bar = tqdm(total=c.run.steps, initial=self.step, disable=not (shown and sys.stdout.isatty()),
                   dynamic_ncols=True, desc="train", file=sys.stdout)
        self.lines = {"on": shown and not sys.stdout.isatty(), "t": time.time(), "step": self.step}
        stop = DeferredStop().install()
        boundary = self._boundary()
        try:
            self.t_last, self.step_last = time.time(), self.step
            while self.step < c.run.steps:
                boundary = self._boundary()
                if stop.requested(self.world, self.device):  # only here, between steps: nothing is ever torn
                    raise KeyboardInterrupt
                for callback in self.callbacks:
                    callback(self, self.step)
                first_draw = self.draws
                result = self._step()
                outcome["train_loss"] = result.loss
                if result.diverged is not None:
                    handle_divergence(self, result.diverged, result.loss, result.grad_norm, result.lr, first_draw)
                    continue
                self.step += 1
                boundary = self._boundary()
                bar.update(1)
                self._after_step(result, bar, outcome)
            if stop.signum is not None:  # a signal during the last step or its checkpoint: nothing left to stop
                self.say(f"keel: interrupted during the last step; the run completed its {self.step} steps and is "
                         "saved", file=sys.stderr)
        except Diverged as err:
            outcome |= {"diverged": True, "divergence_reason": str(err)}
        except KeyboardInterrupt:
            outcome["interrupted"] = True
            self._save_interrupted(boundary)
        finally:
            stop.restore()
            bar.close()
        return outcome

    def _step(self):
        """One TrainStep, with the sub-layer probes attached on telemetry steps."""
        c = self.config
        probe = self.telemetry is not None and (self.step + 1) % c.run.telemetry_every == 0
        if probe:
            self.telemetry.start()
            self.train_step.after_backward = self.telemetry.after_backward
        try:
            result = self.train_step(self.next_batch, lr_at(self.step, c.run.steps, c.optim) * self.lr_scale)
        finally:
            if probe:
                self.train_step.after_backward = None
                record = self.telemetry.finish(self.step + 1)
        if probe and result.diverged is None and self.world.main:
            self.run_dir.log(record, "telemetry.jsonl")
        return result

    def _after_step(self, result, bar, outcome: dict) -> None:
        """The metrics record, validation and the checkpoint a finished step is due."""
        c = self.config
        if self.step % c.run.log_every == 0 or self.step == c.run.steps:
            now = time.time()
            tps = (self.step - self.step_last) * self.tokens_per_step / max(now - self.t_last, 1e-9)
            self.t_last, self.step_last = now, self.step
            record = {"step": self.step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                      "tokens": self.step * self.tokens_per_step, "tokens_per_s": tps}
            postfix = {"loss": f"{result.loss:.4f}", "lr": f"{result.lr:.2e}", "tok/s": f"{tps:,.0f}"}
            if self.peak_flops:
                record["mfu"] = tps * self.flops_per_token / self.peak_flops
                postfix["mfu"] = f"{record['mfu']:.1%}"
            self.log(record)
            bar.set_postfix(postfix)
        last = self.step == c.run.steps
        self._progress_line(result)
        if c.run.eval_every and (self.step % c.run.eval_every == 0 or last):
            outcome["val"] = self.evaluate()
            self.log({"step": self.step, **outcome["val"]})
            if self.world.main:
                bar.write(f"step {self.step}: val_loss {outcome['val']['val_loss']:.4f}")
        every = c.run.eval_tasks_every
        if self.eval_tasks and (last or (every and self.step % every == 0)):
            outcome["tasks"], seconds = score_tasks(self, bar)  # keel.train.task_eval
            self.t_last += seconds  # not counted against the next record's tokens_per_s
        if last or (c.run.ckpt_every and self.step % c.run.ckpt_every == 0):
            self.save_checkpoint()

    def _progress_line(self, result) -> None:
        """Output that is not a terminal (a log file, a pipe, a batch job) shows no bar: one line instead whenever
        PROGRESS_EVERY_S have passed since the last, so a log never goes quiet between validations."""
        lines, now = self.lines, time.time()
        if not lines["on"] or now - lines["t"] < PROGRESS_EVERY_S:
            return
        tps = (self.step - lines["step"]) * self.tokens_per_step / max(now - lines["t"], 1e-9)
        self.say(f"step {self.step}/{self.config.run.steps}: loss {result.loss:.4f}, lr {result.lr:.2e}, "
                 f"{tps:,.0f} tok/s")
        lines |= {"t": now, "step": self.step}

    def _save_interrupted(self, boundary: tuple) -> None:
        # rewind what a half-done step drew, so the checkpoint sits exactly on a step boundary
        sampler_state, self.draws, rng = boundary
        self.sampler.load_state_dict(sampler_state)
        torch.set_rng_state(rng)
        self.optimizer.zero_grad(set_to_none=True)
        # the one line Ctrl-C prints (on stderr, as a stop is not a result), said before the seconds the checkpoint
        # and curves take; an error while saving them follows it
        self.say(f"keel: interrupted at step {self.step}; saving its checkpoint; continue with: keel train "
                 f"resume={self.run_dir}", file=sys.stderr)
        self.save_checkpoint()

    def _finish(self, outcome: dict, wall: float, start_step: int) -> dict:
        """summary.json, the trackers closed, curves drawn, the process group left; returns the summary."""
        c, val = self.config, outcome["val"]
        summary = {
            "diverged": outcome["diverged"], "divergence_reason": outcome["divergence_reason"],
            "interrupted": outcome["interrupted"],
            "run_dir": str(self.run_dir), "steps": self.step, "tokens": self.step * self.tokens_per_step,
            "final_train_loss": outcome["train_loss"], "final_val_loss": val.get("val_loss"),
            "final_val_bits_per_byte": val.get("val_bits_per_byte"), **flat_scores(outcome["tasks"]),
            "tokens_per_second": (self.step - start_step) * self.tokens_per_step / max(wall, 1e-9),
            "n_params": count_params(c.model), "n_sublayers": c.model.n_sublayers, "n_blocks": c.model.n_blocks,
            "scheme": c.model.scheme, "rollbacks": self.rollbacks,
            "wall_seconds": self.wall_before + wall,  # all segments of a resumed run; tokens/s is this one's
            "world_size": self.world.size,
        }
        self._leave_group()  # before rank 0's files: nothing below needs the group, and no rank waits on them
        if self.world.main:
            self.run_dir.write_summary(summary)
            if self.trackers is not None:
                self.trackers.close()
            if c.run.curves:
                self.draw_curves(quiet=outcome["interrupted"])  # after Ctrl-C, its one line has been said
        return summary

    def _leave_group(self) -> None:
        """Every rank leaves the process group together: a rank that tore its gloo group down and exited while rank 0
        still wrote the summary and curves was once killed by SIGABRT at exit (a fresh-clone CI run, 2026-11-26)."""
        distributed.barrier(self.world)
        distributed.close(self.world)

    def draw_curves(self, quiet: bool = False) -> None:
        """curves.png next to the run (what `keel plot RUN` draws), when matplotlib is installed; `quiet`: no
        line naming it (an error is still said)."""
        try:
            from keel.reporting.plot import plot_runs
        except ImportError:
            return
        try:
            path = plot_runs([self.run_dir], self.run_dir / "curves.png")
            if not quiet:
                self.say(f"keel: curves: {path}")
        except Exception as err:  # a plot must never turn a finished run into a failed one
            self.say(f"keel: could not draw curves ({type(err).__name__}: {err})", file=sys.stderr)

    def say(self, message: str, file=None) -> None:
        """Print once (rank 0), without breaking the progress bar."""
        if self.world.main:
            tqdm.write(message, file=file or sys.stdout)

    def memory_line(self) -> str:
        return memory_line(self.config, self.world.size, self.device)

    def evaluate(self) -> dict:
        c = self.config
        return evaluate(self.model, self.data.val, c.run.seq_len, self.global_batch, c.run.eval_batches,
                        self.device, self.autocast, self.token_bytes, self.world, self.replica, self.replicas)

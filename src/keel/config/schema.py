"""The dataclasses for optimiser / guard / run (model and data have theirs beside their code), the checks of
their values, and the range of every number a run reads (`LIMITS`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from keel.data.corpus import DataConfig
from keel.errors import ConfigError
from keel.model.architecture import ModelConfig
from keel.model.sizes import cpu_demo
from keel.runtime import DTYPES, check_device
from keel.scale import FUSED_JUNCTION, FUSED_JUNCTION_DEFAULT, PP_SCHEDULES, check_pipeline

SCHEDULES = ("cosine", "wsd", "constant")
WEIGHTS = ("float32", "bfloat16")  # run.weights
GUARD_POLICIES = ("stop", "rollback")
TRACKERS = ("tensorboard", "wandb")


@dataclass
class OptimConfig:
    """AdamW with the paper's recipe: (0.9, 0.95), weight decay 0.01, clip 1.0, warm-up then cosine."""

    lr: float = 3e-3  # peak learning rate
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.01
    decay_norms_and_embeddings: bool = False  # the default decays only weight matrices
    grad_clip: float = 1.0  # 0 disables clipping
    schedule: str = "cosine"  # cosine | wsd (warm-up, stable, decay) | constant (after warm-up)
    warmup_steps: int = 2500
    min_lr: float = 1e-7  # the floor the decay ends at
    decay_fraction: float = 0.2  # wsd: the share of steps spent in the final linear decay
    # torch's AdamW kernel: auto (fused on CUDA, foreach elsewhere) | fused | foreach (keel.train.optim)
    implementation: str = "auto"
    # AdamW's moments: float32 | 8bit (torchao's block-wise 8-bit AdamW, the `depth` extra): 8 -> 2 bytes a parameter
    state: str = "float32"


@dataclass
class GuardConfig:
    """Divergence detection, checked every step before the optimiser step is taken."""

    policy: str = "stop"  # stop | rollback
    spike_factor: float = 3.0  # a spike is a loss above spike_factor x the running median ...
    spike_window: int = 50  # ... of the last spike_window losses ...
    spike_min_history: int = 20  # ... once at least this many are known; 0 disables spike checks ...
    spike_min_rise: float = 0.5  # ... and at least this many nats above it (a near-zero loss tripling is no spike)
    # from the first step on: a loss above loss_ceiling x ln(vocab_size) (the loss of a uniform guess) is a
    # blow-up, before any history exists; 0 disables
    loss_ceiling: float = 3.0
    max_rollbacks: int = 3  # rollback: at most this many, then stop
    rollback_lr_factor: float = 1.0  # rollback: multiply the learning rate by this each time


@dataclass
class RunConfig:
    steps: int = 1000
    batch_size: int = 16  # sequences per micro-batch (per process)
    grad_accum: int = 1  # micro-batches per optimiser step
    seq_len: int = 256
    seed: int = 0
    device: str = "auto"  # auto: cuda if available, else cpu
    dtype: str = "auto"  # auto: bf16 on cuda (autocast; under torchrun FSDP2 bf16 weights), float32 on cpu
    # the parameters' own dtype: float32 (autocast computes in bf16 from float32 weights) | bfloat16 (no float32
    # copy: weights and gradients 2 bytes a parameter each; bf16 compute; each AdamW update stochastically rounded
    # to bf16 by torchao, the `depth` extra: keel.train.optim). One process only (FSDP2 has its own bf16 policy)
    weights: str = "float32"
    compile: bool = False  # torch.compile each block (regional; keel.scale.parallel)
    fused_junction: str = FUSED_JUNCTION_DEFAULT  # auto (where measured faster) | on (Triton) | composed | off
    ac_every: int = 0  # activation checkpointing: 0 none, 1 every block, k every k-th block
    fsdp_group: int = 1  # under torchrun: blocks per FSDP2 unit (one all-gather each)
    pp: int = 1  # under torchrun: pipeline stages, one rank each (keel.scale.pipeline); 1 = no pipeline
    pp_schedule: str = "1f1b"  # 1f1b | gpipe | interleaved_1f1b | interleaved_zb | zbv (torch.distributed.pipelining)
    pp_microbatches: int = 4  # micro-batches each run.batch_size batch is split into through the pipeline
    out_dir: str = "runs"
    name: str = ""  # empty: <scheme>-<n_sublayers>L-<timestamp>
    log_every: int = 10
    telemetry_every: int = 50  # per-sub-layer gradient norm, stream RMS, |F|/|alpha x| (telemetry.jsonl); 0 off
    log_to: list[str] = field(default_factory=list)  # also send metrics to: tensorboard, wandb (optional extras)
    eval_every: int = 100  # 0 disables periodic validation
    eval_batches: int = 20
    # downstream tasks scored during training (keel.evals: brackets, indent, identifiers, next_line, lm_eval:<task>)
    eval_tasks: list[str] = field(default_factory=list)
    eval_tasks_every: int = 0  # 0: only at the end; N: every N steps and at the end
    eval_tasks_items: int = 200  # items per task and evaluation: bounds its cost
    ckpt_every: int = 200  # 0: only at the end
    keep_checkpoints: int = 3
    progress: bool = True
    curves: bool = True  # curves.png at the end (what `keel plot RUN` draws)
    deterministic: bool = False  # torch.use_deterministic_algorithms
    # CPU threads (torch's intra-op pool); 0: OMP_NUM_THREADS if set, else one per physical core this process may
    # use (keel.runtime.default_threads). On a machine other jobs share, fewer is faster: see the README
    threads: int = 0


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=cpu_demo)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    run: RunConfig = field(default_factory=RunConfig)
    resume: str = ""  # a run directory to continue


def optimizer_implementation(cfg: OptimConfig, device) -> str:
    """torch's AdamW kernel, "fused" or "foreach"; optim.implementation=auto takes the fused one on CUDA and foreach
    on a CPU (docs/internals.md#keelconfigschemaoptimizer_implementation)."""
    if cfg.implementation == "auto":
        return "fused" if device.type == "cuda" else "foreach"
    return cfg.implementation


def _fail(name: str, got, allowed: str):
    raise ConfigError(f"{name}: got {got!r}; allowed: {allowed}")


def _one_of(name: str, value, choices, note: str = "") -> None:
    if value not in choices:
        _fail(name, value, ", ".join(choices) + note)


def validate_runtime(run) -> None:
    """Where and how a model trains: the run fields an experiment point also uses."""
    check_device(run.device, "run.device")
    _one_of("run.dtype", run.dtype, DTYPES)
    _one_of("run.fused_junction", run.fused_junction, FUSED_JUNCTION, " (YAML reads an unquoted on or off as a "
            "boolean: write 'off')" if run.fused_junction in ("True", "False") else "")
    for name in ("grad_accum", "ac_every", "threads"):
        LIMITS[f"run.{name}"].check(f"run.{name}", getattr(run, name))
    _one_of("run.weights", run.weights, WEIGHTS)
    if run.weights == "bfloat16" and run.dtype == "float32":
        raise ConfigError("run.weights=bfloat16 computes in bf16: set run.dtype=auto (bf16 on CUDA) or bfloat16, "
                          "or keep run.weights=float32")
    if run.weights == "bfloat16" and getattr(run, "pp", 1) > 1:
        raise ConfigError("run.weights=bfloat16 is for one process; a pipeline (run.pp > 1) keeps float32 weights "
                          "(set run.weights=float32)")


def validate(c: TrainConfig) -> None:
    check_limits(c)  # every number in its range first: the checks below compare in-range values
    _one_of("run.pp_schedule", c.run.pp_schedule, PP_SCHEDULES)
    check_pipeline(c.model, c.run)  # whether this PyTorch has the schedule: checked when the pipeline is built
    for tracker in c.run.log_to:
        _one_of("run.log_to", tracker, TRACKERS)
    if c.run.eval_tasks:  # names only: a bad one fails here, before any data or model work
        from keel.evals import resolve  # noqa: PLC0415

        resolve(c.run.eval_tasks, "run.eval_tasks")
        if c.run.pp > 1:
            _fail("run.eval_tasks", c.run.eval_tasks, "[] under run.pp > 1 (a pipeline stage holds no whole model)")
    if c.run.seq_len > c.model.max_seq_len:
        _fail("run.seq_len", c.run.seq_len, f"<= model.max_seq_len ({c.model.max_seq_len})")
    if c.run.name and (c.run.name in (".", "..") or any(ch in c.run.name for ch in "/\\")
                       or not c.run.name.isprintable() or len(c.run.name.encode()) > 255):
        _fail("run.name", c.run.name[:60] + ("..." if len(c.run.name) > 60 else ""),
              "a plain directory name: printable characters, no '/', not '.' or '..', at most 255 bytes")
    validate_runtime(c.run)
    _one_of("optim.schedule", c.optim.schedule, SCHEDULES)
    _one_of("optim.implementation", c.optim.implementation, ("auto", "fused", "foreach"))
    _one_of("optim.state", c.optim.state, ("float32", "8bit"))
    _one_of("guard.policy", c.guard.policy, GUARD_POLICIES)
    if c.optim.min_lr > c.optim.lr:
        _fail("optim.min_lr", c.optim.min_lr, f"a number in [0, optim.lr] (optim.lr is {c.optim.lr:g})")
    if c.guard.spike_min_history > c.guard.spike_window:
        _fail("guard.spike_min_history", c.guard.spike_min_history,
              f"an integer in [0, guard.spike_window] (guard.spike_window is {c.guard.spike_window}; 0 disables)")


@dataclass(frozen=True)
class Limit:
    """The values a number may take: from `low` to `high`, each end included unless `open_low`/`open_high`;
    NaN and infinities never. `note` says what a special value means (0 disables)."""

    low: float
    high: float
    integer: bool = False
    open_low: bool = False
    open_high: bool = False
    note: str = ""
    or_zero: str = ""  # 0 is allowed too, and means this (a temperature of 0: greedy)

    def holds(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        if self.or_zero and value == 0:
            return True
        above = value > self.low if self.open_low else value >= self.low  # NaN compares False both ways
        below = value < self.high if self.open_high else value <= self.high
        return above and below

    def allowed(self) -> str:
        kind = "an integer" if self.integer else "a number"
        text = (f"{kind} in {'(' if self.open_low else '['}{_number(self.low)}, {_number(self.high)}"
                f"{')' if self.open_high else ']'}")
        text = f"0 ({self.or_zero}) or {text}" if self.or_zero else text
        return f"{text} ({self.note})" if self.note else text

    def check(self, name: str, value) -> None:
        """One ConfigError naming `name` unless `value` is allowed."""
        if not self.holds(value):
            raise ConfigError(f"{name}: got {value!r}; allowed: {self.allowed()}")


def _number(value: float) -> str:
    if isinstance(value, int) and value >= 2**20 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"  # 2**40, not 1,099,511,627,776
    if isinstance(value, int) and value > 2**20 and (value + 1) & value == 0:
        return f"2**{value.bit_length()} - 1"
    return f"{value:,}" if isinstance(value, int) else re.sub(r"e\+?(-?)0*", r"e\1", f"{value:g}")  # 1e6, 1e-6


def count(low: int, high: int, note: str = "") -> Limit:
    return Limit(low, high, integer=True, note=note)


# Every number a run reads, in its range; checked after the merge, before any data, model or torch work. Counts stop
# far past any real run but short of overflow, and of loops (gradient accumulation, a spike window, evaluation
# batches) that would not end; floats stop where a value means nothing (a learning rate of 100, a clip of 1e9).
# ModelConfig's own sizes and floats are model.SIZE_LIMITS and FLOAT_LIMITS.
# docs/training.md#allowed-values lists them all.
LIMITS = {
    "run.steps": count(1, 2**40), "run.batch_size": count(1, 2**20), "run.grad_accum": count(1, 2**16),
    "run.seq_len": count(1, 2**24, "and at most model.max_seq_len"), "run.seed": count(0, 2**63 - 1),
    "run.ac_every": count(0, 2**16, "0: none, k: every k-th block"), "run.fsdp_group": count(1, 2**20),
    "run.pp": count(1, 2**12), "run.pp_microbatches": count(1, 2**16), "run.log_every": count(1, 2**40),
    "run.telemetry_every": count(0, 2**40, "0 disables"), "run.eval_every": count(0, 2**40, "0 disables"),
    "run.eval_batches": count(1, 2**24), "run.eval_tasks_every": count(0, 2**40, "0: only at the end"),
    "run.eval_tasks_items": count(1, 2**24), "run.ckpt_every": count(0, 2**40, "0: only at the end"),
    "run.keep_checkpoints": count(1, 2**20), "run.threads": count(0, 4096, "0: one per physical core"),
    "optim.lr": Limit(0, 10, open_low=True), "optim.beta1": Limit(0, 1, open_high=True),
    "optim.beta2": Limit(0, 1, open_high=True), "optim.eps": Limit(0, 1, open_low=True),
    "optim.weight_decay": Limit(0, 100), "optim.min_lr": Limit(0, 10, note="and at most optim.lr"),
    "optim.warmup_steps": count(0, 2**40), "optim.decay_fraction": Limit(0, 1),
    "optim.grad_clip": Limit(0, 1e6, note="0 disables"),
    "guard.spike_factor": Limit(1, 1e6, open_low=True), "guard.spike_window": count(1, 2**20),
    "guard.spike_min_history": count(0, 2**20, "and at most guard.spike_window; 0 disables spike checks"),
    "guard.spike_min_rise": Limit(0, 1e6, note="nats"), "guard.loss_ceiling": Limit(0, 1e6, note="0 disables"),
    "guard.max_rollbacks": count(0, 2**20), "guard.rollback_lr_factor": Limit(0, 1, open_low=True),
    "data.val_fraction": Limit(0, 1, open_high=True),
}


def check_limits(c) -> None:
    """Every field of LIMITS that `c` (a TrainConfig, or an experiment's config with some of its sections) has, in
    its range: one ConfigError naming the first that is not."""
    for name, limit in LIMITS.items():
        section, field_name = name.split(".")
        part = getattr(c, section, None)
        if part is not None and hasattr(part, field_name):
            limit.check(name, getattr(part, field_name))


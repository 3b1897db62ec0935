"""The dataclasses for model / data / optimiser / guard / run, and the one merge every command uses."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from keel.config.reads import TRAIN, Reads
from keel.data.corpus import DataConfig
from keel.errors import ConfigError
from keel.model.architecture import ModelConfig
from keel.model.sizes import PRESETS as MODEL_PRESETS
from keel.model.sizes import cpu_demo
from keel.runtime import DEVICES, DTYPES
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


def merge(base, config_file: str | None = None, overrides=(), reads: Reads | None = None):
    """The one config merge, for every command: `base` (a dataclass instance: a preset, an experiment's
    defaults, a run's own config) < a YAML file < dotted `key=value` overrides. OmegaConf checks every key and
    type against the dataclasses; a wrong key, type or value is one ConfigError naming the field. A field set
    that the command does not read (`reads`; default: the merged config's own `reads()`, else every field) is
    refused the same way, whether the file or an override set it."""
    declared = reads or (base.reads() if hasattr(base, "reads") else TRAIN)
    layers = [OmegaConf.structured(base)]
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file {path}: not found")
        try:
            loaded = OmegaConf.load(path)
        except Exception as err:
            raise ConfigError(f"config file {path}: not valid YAML ({str(err).splitlines()[0]})") from None
        if not OmegaConf.is_dict(loaded):
            raise ConfigError(f"config file {path}: expected a mapping of sections at the top level")
        try:  # an interpolation (${...}) to a key that is not there, or one that loops
            OmegaConf.to_container(loaded, resolve=True)
        except OmegaConfBaseException as err:
            raise ConfigError(f"config file {path}: {str(err).splitlines()[0]}") from None
        for key in loaded:
            section = getattr(base, str(key), None)
            if is_dataclass(section) and not OmegaConf.is_dict(loaded[key]):
                raise ConfigError(f"config file {path}: {key}: expected a mapping of {type(section).__name__} "
                                  f"fields, got {loaded[key]!r}")
        layers.append(loaded)
    given = list(_leaves(loaded, "")) if config_file else []
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r}: expected key=value, e.g. {_example(base)}")
        if not item.isprintable():
            raise ConfigError(f"{item.split('=', 1)[0]}: the value holds control characters; allowed: printable text")
    short = getattr(base, declared.shorthand, None)  # a bare field of that section: `scheme=pre_ln`
    if is_dataclass(short):
        bare = {f.name for f in fields(short)} - {f.name for f in fields(base)}
        overrides = [f"{declared.shorthand}.{o}" if o.split("=", 1)[0] in bare else o for o in overrides]
    overrides = [_as_list(base, _sublayers(base, o)) for o in overrides]
    try:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
    except Exception as err:  # OmegaConf's own errors, and YAML's for values it cannot read
        raise ConfigError(f"overrides: {str(err).splitlines()[0]}") from None
    given += [o.split("=", 1)[0] for o in overrides]
    config = to_config(layers, type(base))
    reads = reads or (config.reads() if hasattr(config, "reads") else TRAIN)
    for key in dict.fromkeys(given):
        refused = reads.refusal(key, base, config)
        if refused:
            raise ConfigError(refused)
    return config


def _sublayers(base, item: str) -> str:
    """`model.n_sublayers=32` (or bare `n_sublayers=32`), depth in the unit every command counts it in, is
    `model.n_blocks=16`: the named field that holds it."""
    key, value = item.split("=", 1)
    if key not in ("n_sublayers", "model.n_sublayers") or not is_dataclass(getattr(base, "model", None)):
        return item
    try:
        n = int(value.strip())
    except ValueError:
        n = None
    if n is None or n < 2 or n % 2:
        raise ConfigError(f"model.n_sublayers: got {value!r}; allowed: an even number >= 2 (one attention and one "
                          "FFN sub-layer a block; model.n_blocks = n_sublayers / 2)")
    return f"model.n_blocks={n // 2}"


def _leaves(node, prefix: str):
    """The dotted keys a YAML file sets: `run: {steps: 5}` sets run.steps."""
    for key, value in node.items():
        if OmegaConf.is_dict(value):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


# words YAML 1.1 (what OmegaConf parses an override's value with) reads as a boolean or null
YAML_WORDS = {"on", "off", "yes", "no", "y", "n", "true", "false", "null", "~"}


def _as_list(base, item: str) -> str:
    """`run.log_to=tensorboard` for a list field means `run.log_to=[tensorboard]` (and `a,b` means `[a,b]`):
    the brackets are easy to forget, and unquoted they are a glob to zsh. For a text field, a word YAML would
    read as a boolean or null is kept as the text typed: `run.fused_junction=off` is "off", not False."""
    key, value = item.split("=", 1)
    node, parts = base, key.split(".")
    for part in parts[:-1]:
        node = getattr(node, part, None)
    if not is_dataclass(node) or value.lstrip().startswith("["):
        return item
    kind = str({f.name: f.type for f in fields(node)}.get(parts[-1], ""))  # "list[str]", or the type itself
    if kind.removeprefix("typing.").lower().startswith("list[") and value.strip():
        return f"{key}=[{value}]"
    if kind in ("str", "<class 'str'>") and value.strip().lower() in YAML_WORDS:
        return f"{key}='{value.strip()}'"
    return item


def _example(base) -> str:
    return "model.n_blocks=8" if isinstance(base, TrainConfig) else "run.steps=100"


def _suggest(key: str, schema) -> str:
    """' (did you mean run.steps?)': for a section-less key, the sections that have such a field; for any
    other unknown key, the closest field names of its section."""
    default = schema()
    if "." not in key:
        hits = [f"{f.name}.{key}" for f in fields(default)
                if is_dataclass(getattr(default, f.name)) and key in {g.name for g in fields(getattr(default, f.name))}]
        if not hits:  # a typo: the closest top-level or section field
            nested = {g.name: f"{f.name}.{g.name}" for f in fields(default) if is_dataclass(getattr(default, f.name))
                      for g in fields(getattr(default, f.name))}
            top = [f.name for f in fields(default)]
            hits = [nested.get(m, m) for m in difflib.get_close_matches(key, [*top, *nested], n=2)]
    else:
        section, leaf = key.rsplit(".", 1)
        node = default
        for part in section.split("."):
            node = getattr(node, part, None)
        names = [f.name for f in fields(node)] if is_dataclass(node) else []
        hits = [f"{section}.{n}" for n in difflib.get_close_matches(leaf, names, n=2)]
    return f" (did you mean {' or '.join(hits)}?)" if hits else ""


def _short(text: str, limit: int = 60) -> str:
    """A key as an error message shows it: a file that is not a config (YAML reads `/etc/passwd` as one long
    key) is not echoed back whole."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def to_config(layers, schema=None):
    schema = schema or TrainConfig
    try:
        config = OmegaConf.to_object(OmegaConf.merge(*layers))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        first = str(err).splitlines()[0]
        unknown = re.match(r"Key '(.+)' not in '(\w+)'", first)
        if unknown:  # the wording keel uses everywhere, plus the section a bare key probably belongs to
            first = f"{unknown[2]} has no field {_short(unknown[1])!r}{_suggest(key, schema)}"
        raise ConfigError(f"{_short(key)}: {first}" if key else _short(first, 300)) from None
    except ValueError as err:  # ModelConfig's own validation, which names its field ("ModelConfig.alpha: ...")
        raise ConfigError(str(err)) from None
    if isinstance(config, TrainConfig):
        validate(config)
    elif isinstance(getattr(config, "run", None), RunConfig):  # an experiment: its points validate the rest
        check_limits(config)
        validate_runtime(config.run)
    return config


def add_config_arguments(p) -> None:
    """--preset, --config and key=value overrides: the same three layers, with the same meaning, everywhere."""
    p.add_argument("--preset", choices=list(MODEL_PRESETS),  # keel.config.presets: one for each
                   help="cpu-demo (default: the README's main job), tiny (tests), or a paper-sized model "
                        "(paper-64 .. paper-2048) with the paper's recipe (paper-1024/2048: sized for one GPU)")
    p.add_argument("--config", help="a YAML file with any of model/data/optim/guard/run")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="dotted overrides, e.g. model.n_blocks=8 run.steps=500 (a bare model field such as "
                        "scheme=pre_ln means model.scheme)")


def optimizer_implementation(cfg: OptimConfig, device) -> str:
    """torch's AdamW kernel: "fused" (one kernel over all parameters, no temporaries: 16 bytes a parameter at
    the step) or "foreach" (a few multi-tensor ops, with one float32 temporary per parameter: 20 bytes a
    parameter, keel.scale.memory). optim.implementation=auto takes the fused one on CUDA and keeps foreach on a
    CPU, where every committed result was trained with it (the two agree to float32 rounding, not bit for bit)."""
    if cfg.implementation == "auto":
        return "fused" if device.type == "cuda" else "foreach"
    return cfg.implementation


def validate_runtime(run) -> None:
    """Where and how a model trains: the run fields an experiment point also uses."""
    if run.device.split(":")[0] not in DEVICES:
        raise ConfigError(f"run.device: got {run.device!r}; allowed: {', '.join(DEVICES)} (or cuda:<index>)")
    if run.dtype not in DTYPES:
        raise ConfigError(f"run.dtype: got {run.dtype!r}; allowed: {', '.join(DTYPES)}")
    if run.fused_junction not in FUSED_JUNCTION:
        yaml = " (YAML reads an unquoted on or off as a boolean: write 'off')" if run.fused_junction in (
            "True", "False") else ""
        raise ConfigError(f"run.fused_junction: got {run.fused_junction!r}; allowed: {', '.join(FUSED_JUNCTION)}"
                          + yaml)
    for name in ("grad_accum", "ac_every", "threads"):
        LIMITS[f"run.{name}"].check(f"run.{name}", getattr(run, name))
    if run.weights not in WEIGHTS:
        raise ConfigError(f"run.weights: got {run.weights!r}; allowed: {', '.join(WEIGHTS)}")
    if run.weights == "bfloat16" and run.dtype == "float32":
        raise ConfigError("run.weights=bfloat16 computes in bf16: set run.dtype=auto (bf16 on CUDA) or bfloat16, "
                          "or keep run.weights=float32")
    if run.weights == "bfloat16" and getattr(run, "pp", 1) > 1:
        raise ConfigError("run.weights=bfloat16 is for one process; a pipeline (run.pp > 1) keeps float32 weights "
                          "(set run.weights=float32)")


def validate(c: TrainConfig) -> None:
    def fail(name, got, allowed):
        raise ConfigError(f"{name}: got {got!r}; allowed: {allowed}")

    check_limits(c)  # every number in its range first: the checks below compare in-range values
    if c.run.pp_schedule not in PP_SCHEDULES:
        fail("run.pp_schedule", c.run.pp_schedule, ", ".join(PP_SCHEDULES))
    check_pipeline(c.model, c.run)  # whether this PyTorch has the schedule: checked when the pipeline is built
    for tracker in c.run.log_to:
        if tracker not in TRACKERS:
            fail("run.log_to", tracker, ", ".join(TRACKERS))
    if c.run.eval_tasks:  # names only: a bad one fails here, before any data or model work
        from keel.evals import resolve  # noqa: PLC0415

        resolve(c.run.eval_tasks, "run.eval_tasks")
        if c.run.pp > 1:
            fail("run.eval_tasks", c.run.eval_tasks, "[] under run.pp > 1 (a pipeline stage holds no whole model)")
    if c.run.seq_len > c.model.max_seq_len:
        fail("run.seq_len", c.run.seq_len, f"<= model.max_seq_len ({c.model.max_seq_len})")
    if c.run.name and (c.run.name in (".", "..") or any(ch in c.run.name for ch in "/\\")
                       or not c.run.name.isprintable() or len(c.run.name.encode()) > 255):
        fail("run.name", c.run.name[:60] + ("..." if len(c.run.name) > 60 else ""),
             "a plain directory name: printable characters, no '/', not '.' or '..', at most 255 bytes")
    validate_runtime(c.run)
    if c.optim.schedule not in SCHEDULES:
        fail("optim.schedule", c.optim.schedule, ", ".join(SCHEDULES))
    if c.optim.implementation not in ("auto", "fused", "foreach"):
        fail("optim.implementation", c.optim.implementation, "auto, fused, foreach")
    if c.optim.state not in ("float32", "8bit"):
        fail("optim.state", c.optim.state, "float32, 8bit")
    if c.guard.policy not in GUARD_POLICIES:
        fail("guard.policy", c.guard.policy, ", ".join(GUARD_POLICIES))
    if c.optim.min_lr > c.optim.lr:
        fail("optim.min_lr", c.optim.min_lr, f"a number in [0, optim.lr] (optim.lr is {c.optim.lr:g})")
    if c.guard.spike_min_history > c.guard.spike_window:
        fail("guard.spike_min_history", c.guard.spike_min_history,
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
# ModelConfig's own sizes and floats are model.SIZE_LIMITS and FLOAT_LIMITS (listed by `limits()`).
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
# The largest value of each count a run reads (LIMITS' integer rows), for those who only need the bound
INT_LIMITS = {name: limit.high for name, limit in LIMITS.items() if limit.integer}


def check_limits(c) -> None:
    """Every field of LIMITS that `c` (a TrainConfig, or an experiment's config with some of its sections) has, in
    its range: one ConfigError naming the first that is not."""
    for name, limit in LIMITS.items():
        section, field_name = name.split(".")
        part = getattr(c, section, None)
        if part is not None and hasattr(part, field_name):
            limit.check(name, getattr(part, field_name))


def limits() -> dict[str, str]:
    """{field: its allowed values, as an error states them} for every number a config holds: ModelConfig's sizes
    and floats, then LIMITS. What docs/training.md#allowed-values lists."""
    from keel.model.architecture import FLOAT_LIMITS, SIZE_LIMITS  # noqa: PLC0415
    from keel.model.schemes import SCHEMES  # noqa: PLC0415

    model = {f"model.{k}": count(1, v).allowed() for k, v in SIZE_LIMITS.items()}
    model |= {f"model.{k}": Limit(0, v, open_low=True).allowed() for k, v in FLOAT_LIMITS.items()}
    model |= {"model.dropout": Limit(0, 1, open_high=True).allowed(), "model.loop_blocks": "a divisor of n_blocks",
              "model.alpha": f'"L", "sqrtL", or {Limit(0, SCHEMES["keel"].max_alpha, open_low=True).allowed()}',
              "model.mix_ln_fraction": Limit(0, 1).allowed()}
    return model | {name: limit.allowed() for name, limit in LIMITS.items()}


def to_yaml(config: TrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def load_run_config(run_dir: Path) -> TrainConfig:
    """A run's config.yaml; a damaged one is blamed on the file, not on whatever field it broke."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: not a Keel run directory (no config.yaml)")
    try:
        loaded = OmegaConf.load(path)
        if not OmegaConf.is_dict(loaded):
            raise ConfigError("expected a mapping of sections at the top level")
        return to_config([OmegaConf.structured(TrainConfig()), loaded])
    except Exception as err:  # YAML syntax, bytes that are not UTF-8, fields: all mean a damaged file
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"{path}: damaged run config ({reason})") from None

"""What the studies still written as code share: their config (`ExperimentConfig`: `keel train`'s sections, holding
the study's defaults, plus its own fields, checked by keel's one merge), its `--quick` size, and two report helpers.
The declared engine (keel.experiments.declared) needs none of it: a study file's points are TrainConfigs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

from keel.config import GuardConfig, OptimConfig, RunConfig
from keel.config.reads import Reads
from keel.data import DataConfig
from keel.errors import ConfigError
from keel.experiments.common import (
    corpus,
    experiment_guard,
    experiment_run,
    fixed_batches,
    splits,
    unigram_loss,
)
from keel.model import ModelConfig
from keel.model.architecture import with_scheme
from keel.model.schemes import SCHEME_OPTIONS, SCHEMES
from keel.model.sizes import science

# run.* fields a sweep point has no use for (it writes no run directory, checkpoint or log of its own)
_NO_RUN_DIR = ("run.out_dir", "run.name", "run.log_every", "run.eval_every", "run.ckpt_every", "run.keep_checkpoints",
               "run.progress", "run.telemetry_every", "run.log_to", "run.fsdp_group", "run.pp", "run.pp_schedule",
               "run.pp_microbatches", "run.eval_tasks", "run.eval_tasks_every", "run.eval_tasks_items")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_FIELD_KINDS = {
    "depth": (lambda v: _int(v) and 2 <= v <= 1 << 20 and v % 2 == 0,
              "a depth in sub-layers (an even integer >= 2: one attention and one FFN per block)"),
    "seed": (lambda v: _int(v) and 0 <= v < 2**32, "a seed (an integer in [0, 2**32))"),
    "scheme": (lambda v: v in SCHEMES, f"a scheme ({', '.join(SCHEMES)})"),
    "lr": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf"),
           "a learning rate (a finite number > 0)"),
}
# a study's list fields by name: (kind, must it hold a value)
_LIST_FIELDS = {"depths": ("depth", True), "seeds": ("seed", True), "schemes": ("scheme", True), "lrs": ("lr", True)}
_LIST_SUFFIXES = (("_depths", ("depth", False)), ("_seeds", ("seed", False)), ("_schemes", ("scheme", False)),
                  ("_lrs", ("lr", False)))


@dataclass
class ExperimentConfig:
    """A code study's config: `keel train`'s sections (same fields, spelling and meaning) holding its defaults, plus
    its own fields at the top level (`schemes`, `depths`, `lrs`, `seeds`, ...). `model` is the base model every point
    starts from, each point setting its scheme and depth. `reads()` is what the config merge enforces: a file or
    override setting a field a point sets itself (`fixed_fields()`), or a scheme option no arm reads, is refused."""

    model: ModelConfig = field(default_factory=science)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(warmup_steps=40))
    guard: GuardConfig = field(default_factory=experiment_guard)
    run: RunConfig = field(default_factory=experiment_run)

    # dotted field -> the experiment field that sets it per point (subclasses add theirs)
    PER_POINT: ClassVar[dict[str, str]] = {"model.scheme": "schemes", "model.n_blocks": "depths",
                                           "model.max_seq_len": "run.seq_len", "optim.lr": "lrs"}

    def fixed_fields(self) -> dict[str, str]:
        """{dotted field: why it cannot be set} for this experiment."""
        out = {k: f"set per point from {v}" for k, v in self.PER_POINT.items()}
        out |= {k: "a sweep point writes no run directory of its own" for k in _NO_RUN_DIR}
        out["run.seed"] = "set per point from seeds"
        return out

    def arm_schemes(self) -> set[str] | None:
        """The schemes its arms train, from its `schemes`, `scheme` or `arms` field (None: none of them)."""
        named = [getattr(self, "schemes", None), getattr(self, "scheme", None), getattr(self, "arms", None)]
        named = [n for n in named if isinstance(n, (list, tuple, str, dict))]
        if not named:
            return None
        return {s for n in named for s in ([n] if isinstance(n, str) else n.values() if isinstance(n, dict) else n)}

    def reads(self) -> Reads:
        """What the config merge lets a YAML file or an override set: every field but `fixed_fields()`, and a
        scheme option (model.alpha, ...) only when one of the arms' schemes reads it."""
        refuse = self.fixed_fields()
        arms = self.arm_schemes()
        for name in SCHEME_OPTIONS if arms is not None else ():
            users = [s for s, cls in SCHEMES.items() if name in cls.options]
            if not arms & set(users):
                refuse.setdefault(f"model.{name}", f"an option of {' and '.join(users)}; the arms here are "
                                                   f"{', '.join(sorted(arms))}")
        return Reads(refuse=refuse)

    def check_fields(self) -> None:
        """The study's own lists before any point trains (depths even >= 2, seeds distinct >= 0, schemes known, LRs
        positive, a list the study needs not empty): one ConfigError naming the field."""
        for name, value in vars(self).items():
            if not isinstance(value, list):
                continue
            what = _LIST_FIELDS.get(name) or next((w for end, w in _LIST_SUFFIXES if name.endswith(end)), None)
            if what is None:
                continue
            kind, needed = what
            if needed and not value:
                raise ConfigError(f"{name}: empty; give at least one value")
            bad = [v for v in value if not _FIELD_KINDS[kind][0](v)]
            if bad:
                raise ConfigError(f"{name}: {bad[0]!r} is not {_FIELD_KINDS[kind][1]}")
            if kind == "seed" and len(set(value)) < len(value):
                raise ConfigError(f"{name}: {value} repeats a seed")

    def point_model(self, scheme: str, n_sublayers: int, **fields) -> ModelConfig:
        """The base model at `n_sublayers` as `scheme` (with the options it reads: architecture.with_scheme)."""
        return replace(with_scheme(self.model, scheme), n_blocks=n_sublayers // 2, max_seq_len=self.run.seq_len,
                       **fields)

    def tokens_per_step(self) -> int:
        return self.run.batch_size * self.run.seq_len


def tokens(cfg) -> int:
    """The tokens one point of `cfg` trains on: run.steps x run.batch_size x run.seq_len."""
    return cfg.run.steps * cfg.run.batch_size * cfg.run.seq_len


def tiny_quick(cls, steps: int, optim: dict | None = None, **fields):
    """An experiment's --quick config: its defaults at d=32 (2 heads), 4 x 32 tokens per step, `steps` steps,
    warm-up 2 (or `optim`'s fields), one evaluation batch, eager (compiling would take longer than the run)."""
    base = cls()
    return cls(model=replace(base.model, d_model=32, n_heads=2, n_kv_heads=1, max_seq_len=32),
               optim=replace(base.optim, **({"warmup_steps": 2} | (optim or {}))),
               run=replace(base.run, steps=steps, batch_size=4, seq_len=32, eval_batches=1, compile=False), **fields)


def unigram_level(cfg: ExperimentConfig) -> float:
    """The unigram loss on the report-half batches a point is reported on (`run.eval_batches`)."""
    run = cfg.run
    batches = fixed_batches(splits(cfg.data)["report"], run.seq_len, run.batch_size, run.eval_batches)
    return unigram_loss(corpus(cfg.data).train, batches)


def grown_note(grow: int, grown: list[tuple[str, dict]]) -> str:
    """A report's sentence on grids grown past an edge: `grown` (arm, Grid.describe()) for the arms that grew."""
    each = "; ".join(f"{arm} added {', '.join(f'{v:g}' for v in g['added'])}"
                     + (f" (still at the {g['bound']} edge: a bound)" if g["bound"] else "") for arm, g in grown)
    return (f"Grids grown past an edge choice (by the same factor, every seed, until interior or {grow} "
            f"values added on that side): {each or 'none needed'}.")

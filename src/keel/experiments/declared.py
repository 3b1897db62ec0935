"""A study declared as data: `keel sweep STUDY.yaml` where the file names `arms:` instead of a study kind. Its keys
(`KEYS`; a tune step's `STEP`, `MAX_LR`) are documented in docs/experiments.md#your-own-study.

The measurement: `loss` (keel.experiments.budget; each `tune` step chooses its field per arm and cell by the mean
select-half loss over the choosing seeds, the grid grown past an edge choice: keel.experiments.grid; optionally the
bf16-stream measurement, keel.experiments.stream), `max_lr` (keel.experiments.maxlr, nothing chosen) or `redundancy`
(keel.experiments.redundancy, one cell, nothing chosen; its pairs name ARM.MODE.PART). Each pair is a paired
two-sided t-test per cell, Holm over every test of the study; a marginal one gets `marginal_seeds` on both
arms and every test runs again on all seeds. The whole study is checked before any point trains (every arm, axis and
grid value through keel's one merge: one line naming the field); points are kept by keel.experiments.sweep."""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from keel.config import OptimConfig, RunConfig, TrainConfig, merge, validate
from keel.config.reads import Reads
from keel.data.corpus import DataConfig
from keel.errors import ConfigError
from keel.experiments import common, maxlr, redundancy, stats, stream
from keel.experiments.budget import BudgetConfig, budget_point
from keel.experiments.detect import FailureRules
from keel.experiments.grid import Grid, LadderGrid, _finite, grid_note, run_searches, search_grid
from keel.experiments.sweep import Sweep

KEYS = ("question", "answer", "rule", "base", "arms", "axes", "tune", "seeds", "marginal_seeds", "compare", "measure",
        "curve_every", "curve_batches", "select_seeds", "best_of", "untested", "probe", "max_lr", "crossing", "stream")
STEP = {"arms": "some of the arms, the ones this step tunes", "below": "values falling from below the grid's lowest, "
        "grown through in order", "above": "values rising from above the grid's highest, grown through in order",
        "ties": "low or high: which of equal scores wins"}  # a tune step's optional keys
MEASURES = ("loss", "max_lr", "redundancy")  # the budget measurement (final loss on the select and report halves)
LOSS_ONLY = ("tune", "best_of", "untested", "select_seeds", "marginal_seeds", "probe", "curve_every", "curve_batches",
             "crossing", "stream")
MAX_LR = {"eval_every": "select-half evaluations every this many steps (an integer >= 1; default 2)", "rules":
          f"{', '.join(vars(FailureRules()))} (keel.experiments.detect.FailureRules) -> positive numbers, integers for "
          "counts", "scale": "lr or log: what the compare pairs' t-tests compare (default lr)", "published": "arm/arm "
          "-> a published ratio of their max LRs (a positive number)"}
PER_POINT = {"run.seed": "set per point from seeds", "run.out_dir": "a study point writes no run directory",
             "run.name": "a study point writes no run directory"}
MARGINAL_BELOW = 0.20
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.]*")


@dataclass
class DeclaredStudy:
    """A declared study, as read and checked (`read`); recorded in points/config.json, so a study file changed in
    anything but its seeds is refused on the points of the old one."""

    base: dict = field(default_factory=dict)
    arms: dict = field(default_factory=dict)
    axes: dict = field(default_factory=dict)
    tune: list = field(default_factory=list)
    seeds: list = field(default_factory=lambda: [0])
    marginal_seeds: list = field(default_factory=list)
    compare: list = field(default_factory=list)
    measure: str = "loss"
    curve_every: int = 0
    curve_batches: int = 2
    select_seeds: list = field(default_factory=list)  # empty: every seed chooses
    best_of: dict = field(default_factory=dict)  # name -> arms (`read`)
    untested: list = field(default_factory=list)
    probe: bool = False
    max_lr: dict = field(default_factory=dict)  # the max-LR measurement's settings (MAX_LR)
    crossing: float = 0.0  # 0: the curves are not compared
    stream: dict = field(default_factory=dict)  # empty: every stream in float32, no arithmetic measured
    smoke: dict = field(default_factory=dict)  # fields set on every point last (`smoke`); empty for a real study

    @property
    def run(self) -> RunConfig:  # how points are computed (Sweep.execution records it)
        return self.config({}).run

    def config(self, fields: dict) -> TrainConfig:
        """The base with `fields` ({dotted field: value}) set, through keel's one merge."""
        base = TrainConfig(model=common.experiment_model(), data=DataConfig(), optim=OptimConfig(warmup_steps=40),
                           guard=common.experiment_guard(), run=common.experiment_run())
        refuse = PER_POINT | ({f: "the max-LR ramp sets it (0 -> optim.lr over run.steps)" for f in maxlr.RAMP_FIELDS}
                              if self.measure == "max_lr" else {})
        smoke = {k: v for k, v in self.smoke.items() if k not in self.tuned() and k not in refuse}
        overrides = [f"{k}={json.dumps(v)}" for k, v in {**dotted(self.base), **fields, **smoke}.items()]
        config = merge(base, None, overrides, Reads(refuse=refuse))
        config = replace(config, model=replace(config.model, max_seq_len=config.run.seq_len))
        config = maxlr.ramp(config) if self.measure == "max_lr" else config
        validate(config)
        return config

    def tuned(self) -> list[str]:
        return list(dict.fromkeys(step["field"] for step in self.tune))

    def cells(self) -> list[dict]:
        return [dict(zip(self.axes, values)) for values in itertools.product(*self.axes.values())]

    def choosers(self) -> list[int]:
        return self.select_seeds or self.seeds


SMOKE = {"model.d_model": 32, "model.n_heads": 2, "model.n_kv_heads": 1, "model.n_blocks": 2, "run.steps": 6,
         "run.batch_size": 4, "run.seq_len": 32, "run.eval_batches": 1, "run.compile": False, "optim.warmup_steps": 2}


def smoke(study: DeclaredStudy) -> DeclaredStudy:
    """The study at a smoke-test size (`keel experiment NAME --quick`): every point `SMOKE` (a field it tunes
    excepted), its first two seeds, no marginal seeds, a stream study's init at SMOKE's depth; seconds on a CPU."""
    seeds, init = study.seeds[:2], study.stream.get("init_blocks")
    return replace(study, smoke=SMOKE, seeds=seeds, select_seeds=[s for s in study.select_seeds if s in seeds],
                   marginal_seeds=[], curve_every=min(study.curve_every, 2), curve_batches=1,
                   stream=study.stream | ({"init_blocks": [SMOKE["model.n_blocks"]]} if init else {}))


def dotted(fields: dict, prefix: str = "") -> dict:
    """{"run": {"steps": 2}} as {"run.steps": 2}."""
    out = {}
    for k, v in fields.items():
        if isinstance(v, dict):
            out |= dotted(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def read(doc: dict, where: str) -> DeclaredStudy:
    """The study in `doc` (a study file's mapping), checked whole: every arm, axis value and grid value merged
    into the base; one ConfigError naming `where` and the field."""
    bad = lambda what: ConfigError(f"{where}: {what}")
    unknown = sorted(set(map(str, doc)) - set(KEYS))
    if unknown:
        raise bad(f"unknown key {unknown[0]!r} (allowed: {', '.join(KEYS)})")
    for key in ("base", "arms", "axes"):
        if not isinstance(doc.get(key) or {}, dict):
            raise bad(f"{key}: a mapping")
    arms = {str(k): dotted(v or {}) if isinstance(v, dict) else v for k, v in (doc.get("arms") or {}).items()}
    if len(arms) < 2:
        raise bad("arms: at least two arms to compare (name -> the fields it sets)")
    for name, fields in arms.items():
        if not _NAME.fullmatch(name) or not isinstance(fields, dict):
            raise bad(f"arms.{name}: an arm is a name (letters, digits, _ and .) -> a mapping of fields")
    axes = {str(k): v for k, v in (doc.get("axes") or {}).items()}
    for name, values in axes.items():
        if not isinstance(values, list) or not values or len({json.dumps(v) for v in values}) < len(values):
            raise bad(f"axes.{name}: a list of distinct values")
    tune = doc.get("tune") or []
    if not isinstance(tune, list):
        raise bad("tune: a list of {field, grid, grow}")
    for i, step in enumerate(tune):
        if not isinstance(step, dict) or set(step) - {"field", "grid", "grow", *STEP} or "field" not in step:
            raise bad(f"tune[{i}]: a mapping with field, grid and grow, and optionally {', '.join(STEP)} "
                      f"(got {step!r})")
        grid, grow = step.get("grid"), step.get("grow", 2)
        if not isinstance(grid, list) or len(grid) < 2 or not all(_positive(v) for v in grid) \
                or len(set(grid)) < len(grid):
            raise bad(f"tune[{i}].grid: at least two distinct positive numbers (got {grid!r})")
        if not isinstance(grow, int) or isinstance(grow, bool) or not 0 <= grow <= 8:
            raise bad(f"tune[{i}].grow: values added past an edge, an integer in [0, 8] (got {grow!r})")
        oks = {"arms": lambda v: isinstance(v, list) and v and set(map(str, v)) <= set(arms), "ties": ("low", "high")
               .__contains__, "below": lambda v, g=grid: _ladder(v, min(g), -1), "above": lambda v, g=grid: _ladder(
                   v, max(g), 1)}
        for name in STEP.keys() & step.keys():
            if not oks[name](step[name]):
                raise bad(f"tune[{i}].{name}: {STEP[name]} (got {step[name]!r})")
    seeds, marginal, select = doc.get("seeds", [0, 1, 2]), doc.get("marginal_seeds") or [], doc.get("select_seeds")
    for key, value in (("seeds", seeds), ("marginal_seeds", marginal), ("select_seeds", select or [])):
        if not isinstance(value, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in value) or len(set(value)) < len(value):
            raise bad(f"{key}: distinct integers >= 0 (got {value!r})")
    if not seeds:
        raise bad("seeds: empty; give at least one seed (two for a test)")
    if set(seeds) & set(marginal):
        raise bad("marginal_seeds: must be new seeds, not in seeds")
    if select is not None and (not select or not set(select) <= set(seeds)):
        raise bad(f"select_seeds: some of seeds {seeds}, the ones that choose (got {select!r})")
    best_of, cells = doc.get("best_of") or {}, [_cell_name(dict(zip(axes, v))) for v in itertools.product(
        *axes.values())] if axes else []
    pinned = {f"{a}@{c}" for a in arms for c in cells}  # an arm at one cell
    for name, among in best_of.items() if isinstance(best_of, dict) else [("", None)]:
        if not _NAME.fullmatch(str(name)) or name in arms or not isinstance(among, list) or len(among) < 2 \
                or len(set(map(str, among))) < len(among) or not (set(map(str, among)) <= set(arms)
                                                                  or set(map(str, among)) <= pinned):
            raise bad(f"best_of: a mapping of new names -> lists of two or more distinct arms, or of arm@cell "
                      f"(got {best_of!r})")
    names, measure = [*arms, *best_of], doc.get("measure", "loss")
    if measure not in MEASURES:
        raise bad(f"measure: {measure!r}; allowed: {', '.join(MEASURES)}")
    removal = {f"{a}.{m}.{p}" for a in arms for m in redundancy.MODES for p in redundancy.PARTS}
    if measure == "redundancy" and (given := [k for k in (*LOSS_ONLY, "axes", "untested") if doc.get(k)]):
        raise bad(f"{given[0]}: not used by measure redundancy (one cell, nothing chosen, no curve)")
    compare = doc.get("compare") or ([] if measure == "redundancy" else [[names[0], o] for o in list(arms)[1:]])
    def pair(p, nested: bool = True) -> bool:  # two different arms; a side may be a pair itself (its difference)
        return isinstance(p, list) and len(p) == 2 and p[0] != p[1] and all(
            x in {*names, *pinned} if isinstance(x, str) else nested and pair(x, False) for x in p)
    if measure == "redundancy" and not (isinstance(compare, list) and all(isinstance(p, list) and len(p) == 2 and p[
            0] != p[1] and all(isinstance(x, str) and x in removal for x in p) for p in compare)):
        raise bad(f"compare: pairs of two different ARM.MODE.PART (an arm; {' or '.join(redundancy.MODES)}; "
                  f"{', '.join(redundancy.PARTS)}) (got {compare!r})")
    arm_pairs = [] if measure == "redundancy" else compare
    for key_, pairs in (("compare", arm_pairs), ("untested", doc.get("untested") or [])):
        if not isinstance(pairs, list) or not all(pair(p) and len({_pinned(best_of, a) for a in _leaves(p)}) == 1
                                                  for p in pairs):
            raise bad(f"{key_}: pairs of two different arms out of {', '.join(names)} (or of two such pairs), or of "
                      f"arm@cell on both sides (a cell of {', '.join(cells) or 'none: no axes'}) (got {pairs!r})")
    if measure == "max_lr":
        _check_max_lr(doc, arms, bad)
    elif "max_lr" in doc:
        raise bad("max_lr: the max-LR measurement's settings; set measure: max_lr")
    got = doc.get("stream") or {}
    bf16, init = (got.get("bf16"), got.get("init_blocks", [])) if isinstance(got, dict) else (None, None)
    if got and (set(got) - {"bf16", "init_blocks"} or axes or not (isinstance(bf16, list) and bf16 and set(map(
            str, bf16)) < set(arms)) or not (isinstance(init, list) and all(_positive(n) and type(n) is int for n in
                                                                               init) and len(set(init)) == len(init))):
        raise bad(f"stream: keel.experiments.stream's bf16 (some of the arms) and init_blocks (distinct positive "
                  f"integers), in a study without axes (got {got!r})")
    if not isinstance(doc.get("probe", False), bool):
        raise bad(f"probe: true or false (got {doc['probe']!r})")
    curve_every, curve_batches = doc.get("curve_every", 0), doc.get("curve_batches", 2)
    for key, value, least in (("curve_every", curve_every, 0), ("curve_batches", curve_batches, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise bad(f"{key}: an integer >= {least} (got {value!r})")
    crossing = doc.get("crossing", 0)
    if crossing and not (_positive(crossing) and crossing < 1 and curve_every and all(
            isinstance(x, str) and x in arms for p in compare for x in p)):
        raise bad(f"crossing: a fraction of the run, in (0, 1), with curve_every and compare pairs of two arms "
                  f"(got {crossing!r})")
    study = DeclaredStudy(base=doc.get("base") or {}, arms=arms, axes=axes, tune=[
        {"field": s["field"], "grid": sorted(s["grid"]), "grow": s.get("grow", 2), **{k: s[k] for k in STEP if k in s}}
        for s in tune], seeds=seeds, marginal_seeds=marginal, compare=compare, measure=measure, curve_every=curve_every,
        curve_batches=curve_batches, select_seeds=select or [], best_of=best_of, untested=doc.get("untested") or [],
        probe=doc.get("probe", False), max_lr=doc.get("max_lr") or {}, crossing=crossing, stream=got)
    _check_configs(study, bad)
    return study


def _check_max_lr(doc: dict, arms: dict, bad) -> None:
    """The max-LR measurement's keys: none of the loss measurement's, and its own `max_lr` mapping (MAX_LR)."""
    if given := [k for k in LOSS_ONLY if doc.get(k)]:
        raise bad(f"{given[0]}: the loss measurement's; measure max_lr chooses nothing and keeps no loss curve")
    got = doc.get("max_lr") or {}
    if not isinstance(got, dict) or set(map(str, got)) - set(MAX_LR):
        raise bad(f"max_lr: a mapping of {', '.join(MAX_LR)} (got {got!r})")
    every, rules, published, counts = got.get("eval_every", 2), got.get("rules", {}), got.get("published", {}), {
        k for k, v in vars(FailureRules()).items() if isinstance(v, int)}
    ok = {"eval_every": isinstance(every, int) and not isinstance(every, bool) and every >= 1, "rules": isinstance(
        rules, dict) and all(k in vars(FailureRules()) and _positive(v) and (k not in counts or isinstance(v, int))
                             for k, v in rules.items()), "scale": got.get("scale", "lr") in ("lr", "log"),
          "published": isinstance(published, dict) and all(len(p := str(k).split("/")) == 2 and set(p) <= set(arms)
                                                           and _positive(v) for k, v in published.items())}
    if wrong := next((k for k, fine in ok.items() if not fine), None):
        raise bad(f"max_lr.{wrong}: {MAX_LR[wrong]} (got {got[wrong]!r})")


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _ladder(values, edge: float, sign: int) -> bool:
    """Written-out values past a grid's edge: positive, moving away from it (sign -1: falling below it)."""
    steps = [edge, *values] if isinstance(values, list) else []
    return bool(values) and all(map(_positive, values)) and all(sign * (b - a) > 0 for a, b in zip(steps, steps[1:]))


def _check_configs(study: DeclaredStudy, bad) -> None:
    """Every arm, axis value and grid value through the merge, alone and then together, before any point trains."""
    def check(where: str, fields: dict) -> TrainConfig:
        try:
            return study.config(fields)
        except ConfigError as err:
            raise bad(f"{where}: {err}") from None
    for name in study.tuned():
        owners = [f"axes.{name}"] * (name in study.axes) + [f"arms.{a}" for a, f in study.arms.items() if name in f]
        if owners:
            raise bad(f"tune: {name} is chosen per arm and cell, so {owners[0]} may not set it")
    check("base", {})
    for arm, fields in study.arms.items():
        check(f"arms.{arm}", fields)
    for name, values in study.axes.items():
        for value in values:
            check(f"axes.{name}", {name: value})
    for i, step in enumerate(study.tune):
        for value in [*step["grid"], *step.get("below", []), *step.get("above", [])]:
            if isinstance(_get(check(f"tune[{i}]", {step["field"]: value}), step["field"]), bool | str):
                raise bad(f"tune[{i}]: {step['field']} is not a number")
    for arm, fields in study.arms.items():
        for cell in study.cells():
            for step in study.tune or [{"field": None, "grid": [None]}]:
                for value in step["grid"]:
                    check(f"arms.{arm} at {_cell_name(cell) or 'the base'}",
                          {**fields, **cell, **({} if step["field"] is None else {step["field"]: value})})


def _get(config, key: str):
    for part in key.split("."):
        config = getattr(config, part)
    return config


def _leaves(side) -> list:
    """The arms a side of a pair names (a side may be a pair: its difference)."""
    return [a for x in side for a in _leaves(x)] if isinstance(side, list) else [side]


def _label(side) -> str:
    return f"({_label(side[0])} - {_label(side[1])})" if isinstance(side, list) else side


def _pinned(best_of: dict, name: str) -> bool:
    """Whether `name` (an arm, arm@cell or a best_of) is at one cell whatever the cell a test is in."""
    return "@" in name or "@" in best_of.get(name, [""])[0]


def _at(side: str, cell_name: str) -> tuple[str, str]:
    """(arm, cell name) of a side of a pair: "arm@cell" is at that cell, a plain arm at the test's."""
    arm, at, cell = side.partition("@")
    return arm, cell if at else cell_name


def _cell(study: DeclaredStudy, name: str) -> dict:
    return next(c for c in study.cells() if _cell_name(c) == name)


def _cell_name(cell: dict) -> str:
    return "-".join(f"{k.rsplit('.', 1)[-1]}{v}" for k, v in cell.items())


def key(arm: str, cell: dict, hp: dict, seed: int) -> str:
    parts = [arm, _cell_name(cell), *(f"{k.rsplit('.', 1)[-1]}{v:g}" for k, v in hp.items()), f"seed{seed}"]
    return re.sub(r"[^A-Za-z0-9._-]", "_", "-".join(p for p in parts if p))


class _Grid(Grid):
    """A grid of an integer field grows by whole numbers; a value the rounding repeats is a bound."""

    def beyond(self, edge: str, grown: int) -> float | None:
        value = super().beyond(edge, grown)
        value = None if value is None else int(round(value))
        return value if value and value not in self.values else None


def point(study: DeclaredStudy, arm: str, cell: dict, hp: dict, seed: int) -> dict:
    """One point: the study's measurement at this arm, cell and tuned values."""
    c = study.config({**study.arms[arm], **cell, **hp})
    if study.measure == "redundancy":
        return redundancy.point(common.point_config(c, c.model, seed))
    if study.measure == "max_lr":
        return maxlr.point(common.point_config(c, c.model, seed), *maxlr.settings(study.max_lr)) | {"arm": arm,
                                                                                                    "cell": cell}
    cfg = BudgetConfig(model=c.model, data=c.data, optim=c.optim, guard=c.guard, run=c.run,
                       curve_every=study.curve_every, curve_batches=study.curve_batches, probe=study.probe)
    extra = {"prepare": stream.round_stream if arm in study.stream["bf16"] else None, "extra": lambda model, report: {
        "survival": stream.survival_profile(model, report[0][0])}} if study.stream else {}  # on one report batch
    return budget_point(cfg, c.model, c.optim.lr, seed, **extra) | {"arm": arm, "cell": cell, "tuned": hp}


def _init_job(study: DeclaredStudy, arm: str, n_blocks: int, seed: int):
    c = study.config({**study.arms[arm], "model.n_blocks": n_blocks})
    return lambda: stream.init_point(common.point_config(c, c.model, seed))


def run(study: DeclaredStudy, out: Path, command: str, name: str = "study", question: str = "", rule: str = "") -> dict:
    """Every cell whole, one after the other (a partial sweep answers whole cells); then the tests and the report."""
    sweep, points, choices = Sweep(out, study), {}, {}
    base = study.config({})
    for cell in study.cells():
        desc = f"{name} {_cell_name(cell) or 'points'}"
        choices[_cell_name(cell)] = _tune_cell(study, sweep, cell, points, base, desc)
    if study.stream:  # each float32 arm's model at init, at every init_blocks
        points |= sweep.run({f"init-{key(a, {'model.n_blocks': n}, {}, s)}": _init_job(study, a, n, s)
                             for a in study.arms if a not in study.stream["bf16"]
                             for n in study.stream.get("init_blocks", []) for s in study.seeds}, f"{name} (init)")
    if study.measure == "max_lr":
        return _max_lr(study, out, command, name, points, choices, _asks(question, rule))
    if study.measure == "redundancy":
        return _redundancy(study, out, command, name, points, _asks(question, rule))
    picks = {c: {pick: _best_of(study, points, choices, c, among) for pick, among in study.best_of.items()
                 if not _pinned(study.best_of, pick)} for c in choices}
    if across := {pick: _best_of(study, points, choices, "", among) for pick, among in study.best_of.items()
                  if _pinned(study.best_of, pick)}:
        picks[""] = across  # a pick across cells (a study without axes has the one cell "", and no such pick)
    tests = _tests(study, points, choices, picks, study.seeds, study.compare)
    seeds = study.seeds
    if study.marginal_seeds and any(_marginal(t) for t in tests):
        seeds = [*study.seeds, *study.marginal_seeds]
        jobs = {}
        for t in tests:
            if _marginal(t):
                for arm, c in (_at(side, t["cell"]) for side in _leaves(t["arms"])):
                    hp, cell = choices[c][arm]["hp"], _cell(study, c)
                    jobs |= {key(arm, cell, hp, s): _job(study, arm, cell, hp, s) for s in study.marginal_seeds}
        points |= sweep.run(jobs, f"{name} (marginal seeds)")
        tests = _tests(study, points, choices, picks, seeds, study.compare)
    losses = {c: {arm: _losses(study, points, c, choice, arm, seeds) for arm in study.arms} for c, choice in
              choices.items()}  # per cell and arm, over `seeds`: what the tests compare
    results = {"points": points, "choices": choices, "tests": tests, "seeds": seeds, "report_losses": losses}
    if study.crossing:
        results["crossings"] = []
        for (c, choice), pair in itertools.product(choices.items(), study.compare):
            (steps, a), (_, b) = (_curves(study, points, c, choice, arm, seeds) for arm in pair)
            results["crossings"].append({"cell": c, "pair": pair, **stats.crossing(a, b, steps, study.crossing)})
    results |= ({"picks": picks} if study.best_of else {}) | ({"untested": _tests(
        study, points, choices, picks, seeds, study.untested, tested=False)} if study.untested else {})
    _report(study, out, command, name, results, question, rule)
    return results


def _job(study, arm, cell, hp, seed):
    return lambda: point(study, arm, cell, hp, seed)


def _tune_cell(study: DeclaredStudy, sweep: Sweep, cell: dict, points: dict, base: TrainConfig, desc: str) -> dict:
    fields = study.tuned()
    hp_of = lambda values: dict(zip(fields, values))

    def score(arm: str, *values) -> float:
        runs = [points[key(arm, cell, hp_of(values), s)] for s in study.choosers()]
        return float(np.mean([_finite(r.get("select_loss")) for r in runs]))

    def search(arm: str):
        start = study.config({**study.arms[arm], **cell})
        now = {f: _get(start, f) for f in fields}
        steps = []
        for step in (s for s in study.tune if arm in s.get("arms", study.arms)):
            f, ties = step["field"], step.get("ties", "low")
            number = int if isinstance(_get(base, f), int) else float
            values = [number(v) for v in step["grid"]]
            grid = LadderGrid(values, step["grow"], ties=ties, below=step.get("below", []), above=step.get(
                "above", [])) if {"below", "above"} & set(step) else (_Grid if number is int else Grid)(
                values, step["grow"], ties=ties)
            now[f] = yield from search_grid(grid, lambda v, f=f: tuple({**now, f: v}[g] for g in fields),
                                            lambda *v, arm=arm: score(arm, *v))
            steps.append({"field": f, **grid.describe()})
        if not steps:  # nothing tuned for this arm: its point at the values it has
            yield [tuple(now[g] for g in fields)]
        return {"hp": dict(now), "grids": steps}

    def run_round(asked: dict) -> set:
        jobs = {a: {key(a, cell, hp_of(v), s): _job(study, a, cell, hp_of(v), s) for v in hps
                    for s in study.choosers()} for a, hps in asked.items()}
        complete = lambda done: {a for a, arm in jobs.items() if arm.keys() <= done.keys()}
        got = sweep.run({k: j for arm in jobs.values() for k, j in arm.items()}, desc,
                        enough=lambda done: bool(complete(done)))
        points.update(got)
        return complete(got)
    chosen = run_searches({arm: search(arm) for arm in study.arms}, run_round)
    rest = [s for s in study.seeds if s not in study.choosers()]
    points |= sweep.run({key(a, cell, c["hp"], s): _job(study, a, cell, c["hp"], s) for a, c in chosen.items()
                         for s in rest}, f"{desc} (seeds at the choices)") if rest else {}
    return {arm: {"hp": c["hp"], "grids": c["grids"]} for arm, c in chosen.items()}


def _best_of(study: DeclaredStudy, points: dict, choices: dict, cell_name: str, among: list) -> dict:
    """The arm of `among` with the lowest mean select-half loss over the choosing seeds at its choices (ties: the
    first listed), and each one's mean."""
    select = {}
    for side in among:
        arm, c = _at(side, cell_name)
        select[side] = float(np.mean([_finite(points[key(arm, _cell(study, c), choices[c][arm]["hp"], s)].get(
            "select_loss")) for s in study.choosers()]))
    return {"arm": min(among, key=select.get), "select": select}


def _losses(study, points, cell_name, choice, arm, seeds, value: str = "report_loss") -> list:
    cell = _cell(study, cell_name)
    return [points[k][value] if (k := key(arm, cell, choice[arm]["hp"], s)) in points else None for s in seeds]


def _tests(study: DeclaredStudy, points: dict, choices: dict, picks: dict, seeds: list, pairs: list,
           tested: bool = True, value: str = "report_loss", better: str = "lower") -> list[dict]:
    """Each pair per cell (one pinned to cells once, last; a best_of as its pick; a side that is a pair as its
    difference): paired t-tests of `value`, Holm over all (`tested`; else mean and SD only), verdicts by `better`."""
    def side(a, cell_name: str):  # (the arms it names, as they resolve in the cell; its report losses per seed)
        if isinstance(a, list):
            (ra, la), (rb, lb) = side(a[0], cell_name), side(a[1], cell_name)
            return [ra, rb], [x - y if x is not None and y is not None else None for x, y in zip(la, lb)]
        arm, c = _at((picks.get(cell_name, {}).get(a) or picks.get("", {}).get(a) or {"arm": a})["arm"], cell_name)
        return arm if c == cell_name else f"{arm}@{c}", _losses(study, points, c, choices[c], arm, seeds, value)
    tests, across = [], [p for p in pairs if _pinned(study.best_of, _leaves(p)[0])]
    for cell_name, group in [*((c, [p for p in pairs if p not in across]) for c in choices), ("", across)]:
        for pair in group:
            (ra, la), (rb, lb) = side(pair[0], cell_name), side(pair[1], cell_name)
            arms = [ra, rb]
            t = stats.paired(la, lb)
            tests.append({"cell": cell_name, "pair": pair, "arms": arms, "seeds": [s for s, x, y in zip(seeds, la, lb)
                                                                                   if x is not None and y is not None],
                          **(t if tested else {k: t[k] for k in ("n", "mean", "sd")})})
    if not tested:
        return tests
    for t, adjusted in zip(tests, stats.holm([t["p"] for t in tests])):
        t["p_holm"] = adjusted
        t["verdict"] = "inconclusive" if adjusted is None or adjusted >= stats.ALPHA else (
            f"{_label(t['pair'][(t['mean'] < 0) != (better == 'lower')])} {better}")
    return tests


def _curves(study, points, cell_name, choice, arm, seeds) -> tuple[list[int], np.ndarray]:  # seeds not diverged
    runs = [points[key(arm, _cell(study, cell_name), choice[arm]["hp"], s)] for s in seeds]
    runs = [r for r in runs if not r["diverged"]]
    return runs[0]["evals"]["step"], np.array([r["evals"]["loss"] for r in runs])


def _marginal(t: dict) -> bool:
    p, ph = t["p"], t["p_holm"]
    return p is not None and ph is not None and ph >= stats.ALPHA and (p < stats.ALPHA or ph < MARGINAL_BELOW)


def _report(study: DeclaredStudy, out: Path, command: str, name: str, results: dict, question: str,
            rule: str = "") -> None:
    points, choices, seeds = results["points"], results["choices"], results["seeds"]
    rows = []
    for cell_name, choice in choices.items():
        for arm in study.arms:
            losses, cell = _losses(study, points, cell_name, choice, arm, seeds), _cell(study, cell_name)
            runs = [points.get(key(arm, cell, choice[arm]["hp"], s), {}) for s in seeds]
            diverged, size = sum(bool(r.get("diverged")) for r in runs), next((r["n_params"] for r in runs
                                                                               if r.get("n_params")), None)
            notes = "; ".join(f"{g['field']} from {', '.join(f'{v:g}' for v in g['values'])}{grid_note(g)}"
                              for g in choice[arm]["grids"])
            rows.append([cell_name or "-", arm, "-" if size is None else f"{size:,}",
                         ", ".join(f"{k}={v:g}" for k, v in choice[arm]["hp"].items()) or "-",
                         common.pm([x for x in losses if x is not None]) + (f", {diverged} diverged" if diverged
                                                                            else ""), notes or "-"])
    arms_table = common.markdown_table(["cell", "arm", "parameters", "chosen on the select half", "report-half loss",
                                        "grids"], rows)
    picked = [f"**{name}**{f' at {c}' if c else ''}: {p['arm']} (mean select-half loss at the choices: "
              + ", ".join(f"{a} {v:.3f}" for a, v in p["select"].items()) + ")"
              for c, cell_picks in results.get("picks", {}).items() for name, p in cell_picks.items()]
    tests_table = _tests_table(results, 4 if study.stream else 3)  # a bf16 stream's effect: thousandths
    if study.probe:
        tests_table += "\n\n" + _probe_table(study, results)
    if study.crossing:
        tests_table += "\n\n" + _crossing_table(results["crossings"])
    if study.stream:
        results["arithmetic"], table = stream.report(_profiles(study, results))
        tests_table += ("\n\nBf16 sums (keel.experiments.stream) on one report-half batch; 'init' is the paper's "
                        "N(0, 0.02^2) init.\n\n" + table)
    runs = [study.config(cell).run for cell in study.cells()]  # an axis may set the steps
    steps = ", ".join(dict.fromkeys(f"{r.steps:,}" for r in runs))
    tokens = ", ".join(dict.fromkeys(f"{r.steps * r.batch_size * r.seq_len:,}" for r in runs))
    rest = [s for s in study.seeds if s not in study.choosers()]
    notes = (f"Each point: the budget measurement (keel.experiments.budget) at {steps} steps of "
             f"{runs[0].batch_size}x{runs[0].seq_len} tokens ({tokens} tokens); "
             + (f"choices by the mean select-half loss over seeds {study.choosers()}" if study.tune or study.best_of
                else "no field tuned (each arm at the fields it sets)")
             + (f", seeds {rest} run at the choices" if rest else "")
             + f"; report-half losses on seeds {seeds}; paired two-sided t-tests, Holm over the study's "
             f"{len(results['tests'])} tests" + (f" ({len(results['untested'])} differences reported, not tested)"
                                                  if results.get("untested") else "") + ".")
    body = "\n\n".join([arms_table, *(["\n".join(f"- {p}" for p in picked)] if picked else []), tests_table])
    common.write_outputs(out, name, study, command, results, _asks(question, rule) + body, [_plot(study, out, results)],
                         notes)


def _asks(question: str, rule: str) -> str:
    """A report's opening: the question and the rule's links."""
    links = ", ".join(f"[{r.rsplit('#', 1)[-1]}]({r})" if "#" in r or r.endswith(".md") else r
                      for r in (x.strip() for x in rule.split(",")) if r)
    return (f"**Question:** {question}\n\n" if question else "") + (f"**Rule:** {links}\n\n" if links else "")


def _tests_table(results: dict, d: int = 3) -> str:  # d: digits
    rows = [[t["cell"] or "-", " - ".join(_label(a) if a == r else f"{_label(a)} ({_label(r)})"
                                          for a, r in zip(t["pair"], t["arms"])),
             f"{t['mean']:+.{d}f} ± {t['sd']:.{d}f} (n={t['n']})" if t["sd"] is not None else
             stats.describe(t, d) if "p" in t else f"{t['mean']:+.{d}f} (n={t['n']})",
             "-" if t.get("ci95") is None else f"[{t['ci95'][0]:+.{d}f}, {t['ci95'][1]:+.{d}f}]",
             "-" if "p" not in t else "n/a" if t["p"] is None else f"{t['p']:.2g}",
             "-" if t.get("p_holm") is None else f"{t['p_holm']:.2g}", t.get("verdict", "reported, not tested")]
            for t in [*results["tests"], *results.get("untested", [])]]
    return common.markdown_table(["cell", "difference", "mean ± SD of the paired differences", "95% CI", "p", "Holm p",
                           "verdict"], rows)


def _max_lr(study: DeclaredStudy, out: Path, command: str, name: str, points: dict, choices: dict, asks: str) -> dict:
    """The max-LR verdicts (a cell and seed judged whole: stagnation compares its arms), the compare pairs' tests on
    the max LRs (or their logs), the report."""
    every, rules = maxlr.settings(study.max_lr)
    verdicts = {}
    for cell in study.cells():
        configs = {arm: study.config({**fields, **cell}) for arm, fields in study.arms.items()}
        refs, peaks = maxlr.references(configs), {arm: c.optim.lr for arm, c in configs.items()}
        for s in study.seeds:
            judged = maxlr.judge({arm: points[key(arm, cell, {}, s)] for arm in study.arms}, refs, rules, peaks)
            verdicts |= {key(arm, cell, {}, s): v for arm, v in judged.items()}
    log = study.max_lr.get("scale") == "log"
    scored = {k: {"max_lr": (math.log(v["max_lr"]) if v["max_lr"] > 0 else None) if log else v["max_lr"]}
              for k, v in verdicts.items()}
    tests = _tests(study, scored, choices, {}, study.seeds, study.compare, value="max_lr", better="higher")
    cells = {_cell_name(c): {arm: [(points[k], verdicts[k]) for k in (key(arm, c, {}, s) for s in study.seeds)]
                             for arm in study.arms} for c in study.cells()}
    found, text, plots, notes = maxlr.report(cells, study.seeds, study.config({}), every, rules, _leaves(
        study.compare[0])[-1], study.max_lr.get("published", {}), out, name)
    results = {"points": points, "verdicts": verdicts, **found, "tests": tests, "seeds": study.seeds}
    notes += (f" Tests: paired two-sided t-tests on the {'log ' if log else ''}max LR, Holm over the study's "
              f"{len(tests)} tests.")
    common.write_outputs(out, name, study, command, results, asks + text + "\n\n" + _tests_table(results, 4), plots,
                         notes)
    return results


def _redundancy(study: DeclaredStudy, out: Path, command: str, name: str, points: dict, asks: str) -> dict:
    """Each arm's deltas summarised over its seeds; the compare pairs' paired tests of ARM.MODE.PART; the report."""
    arms = {arm: [points[key(arm, {}, {}, s)] for s in study.seeds] for arm in study.arms}
    summary, table = redundancy.report(arms)
    sides = {side: [p[side.rsplit(".", 1)[1]] for p in summary["-".join(side.rsplit(".", 2)[:2])]]
             for side in {s for p in study.compare for s in p}}
    scored = {key(side, {}, {}, s): {"delta": d} for side, ds in sides.items() for s, d in zip(study.seeds, ds)}
    tests = _tests(study, scored, {"": {side: {"hp": {}} for side in sides}}, {}, study.seeds, study.compare,
                   value="delta", better="higher")
    results = {"points": points, "summary": summary, "tests": tests, "seeds": study.seeds}
    notes = redundancy.notes([study.config(fields) for fields in study.arms.values()], study.seeds) + (
        f" Tests: paired two-sided t-tests over seeds, Holm over the study's {len(tests)} tests." if tests else "")
    text = asks + table + ("\n\n" + _tests_table(results, 4) if tests else "")
    common.write_outputs(out, name, study, command, results, text, [redundancy.plot(arms, out)], notes)
    return results


def _probe_table(study: DeclaredStudy, results: dict) -> str:
    """The effective-depth probe per cell and arm at its choices, over the seeds: the loss added when only
    sub-layers 0-1, or the lower half, keep their branches, and the mean rms(F)/rms(alpha x) of sub-layers 2..L-1."""
    rows = []
    for cell_name, choice in results["choices"].items():
        for arm in study.arms:
            runs = [results["points"].get(key(arm, _cell(study, cell_name), choice[arm]["hp"], s), {})
                    for s in results["seeds"]]
            if not (runs := [r for r in runs if r.get("probe")]):
                continue
            n, off = runs[0]["n_sublayers"], [r["probe"]["loss_branches_above_k_off"] for r in runs]
            rows.append([cell_name or "-", arm, n, common.pm([o["2"] - o[str(n)] for o in off]),
                         common.pm([o[str(n // 2)] - o[str(n)] for o in off]),
                         common.pm([sum(r["probe"]["f_over_ax"][2:]) / max(1, n - 2) for r in runs], 4)])
    return ("Effective-depth probe (report half, at the choices, every seed): the loss added when every branch above "
            "sub-layer k is switched off (norms and alpha kept), and the mean rms(F)/rms(alpha x) of sub-layers "
            "2..L-1.\n\n" + common.markdown_table(["cell", "arm", "sub-layers", "delta loss, only sub-layers 0-1 on",
                                             "delta loss, lower half on", "mean rms(F)/rms(alpha x)"], rows))


def _profiles(study: DeclaredStudy, results: dict) -> dict:
    """stream.report's input: per arm its stream, sub-layers, init profiles (float32 arms) and trained profiles."""
    points, seeds, out = results["points"], results["seeds"], {}
    for arm in study.arms:
        bf16 = arm in study.stream["bf16"]
        runs = [points[key(arm, {}, results["choices"][""][arm]["hp"], s)] for s in seeds]
        out[arm] = {"stream": "bfloat16" if bf16 else "float32", "sublayers": runs[0]["n_sublayers"],
                    "trained": [r["survival"] for r in runs if "survival" in r],
                    "init": {2 * n: [points[f"init-{key(arm, {'model.n_blocks': n}, {}, s)}"] for s in seeds]
                             for n in ([] if bf16 else study.stream.get("init_blocks", []))}}
    return out


def _crossing_table(crossings: list[dict]) -> str:
    rows = [[c["cell"] or "-", f"{c['pair'][0]} vs {c['pair'][1]}", c["early_step"] + 1,
             f"{c['early_diff']:+.3f} (tol {c['early_tol']:.3f})", c["starts_slower"],
             "never" if c["cross_step"] is None else c["cross_step"] + 1,
             f"{c['final_diff']:+.3f} (tol {c['final_tol']:.3f})"] for c in crossings]
    return ("The curves (report half, seed means; tol: the larger seed SD of the two): the first arm against the "
            "second at the first evaluation past the study's crossing fraction, the step from which it stays below, "
            "and at the end.\n\n" + common.markdown_table(["cell", "comparison", "early step", "difference, early",
                                                     "starts slower", "crosses for good at step", "difference, final"],
                                                    rows))


def _plot(study: DeclaredStudy, out: Path, results: dict) -> str:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    cells = list(results["choices"])
    for arm in study.arms:
        losses = [_losses(study, results["points"], c, results["choices"][c], arm, results["seeds"]) for c in cells]
        means = [float(np.mean([x for x in ls if x is not None])) if any(x is not None for x in ls) else math.nan
                 for ls in losses]
        ax.plot(range(len(cells)), means, marker="o", label=arm)
    ax.set_xticks(range(len(cells)), [c or "-" for c in cells], rotation=30, ha="right")
    ax.set_ylabel("report-half loss (mean over seeds)")
    ax.legend()
    return common.save(fig, out, "study.png")


"""A study file declared as data, read and checked whole before any point trains; `key` names its points."""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import re
from dataclasses import dataclass, field, replace

from keel.config import OptimConfig, RunConfig, TrainConfig, merge, validate
from keel.config.reads import Reads
from keel.data.corpus import DataConfig
from keel.errors import ConfigError, KeelError
from keel.experiments import common, maxlr, redundancy
from keel.experiments.detect import FailureRules
from keel.model.sizes import science

KEYS = ("question", "answer", "rule", "base", "arms", "axes", "tune", "seeds", "marginal_seeds", "compare", "measure",
        "curve_every", "curve_batches", "select_seeds", "best_of", "untested", "probe", "max_lr", "crossing", "stream",
        "rank")
STEP = {"arms": "some of the arms, the ones this step tunes", "below": "values falling from below the grid's lowest, "
        "grown through in order", "above": "values rising from above the grid's highest, grown through in order",
        "ties": "low or high: which of equal scores wins"}  # a tune step's optional keys
MEASURES = ("loss", "max_lr", "redundancy", "downstream")  # loss: the budget measurement (keel.experiments.budget)
LOSS_ONLY = ("tune", "best_of", "untested", "select_seeds", "marginal_seeds", "probe", "curve_every", "curve_batches",
             "crossing", "stream")
MAX_LR = {"eval_every": "select-half evaluations every this many steps (an integer >= 1; default 2)", "rules":
          f"{', '.join(vars(FailureRules()))} (keel.experiments.detect.FailureRules) -> positive numbers, integers for "
          "counts", "scale": "lr or log: what the compare pairs' t-tests compare (default lr)", "published": "arm/arm "
          "-> a published ratio of their max LRs (a positive number)"}
PER_POINT = {"run.seed": "set per point from seeds", "run.out_dir": "a study point writes no run directory",
             "run.name": "a study point writes no run directory", "model.max_seq_len": "set per point from run.seq_len"}
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*")


_CONFIGS: dict = {}  # DeclaredStudy.config's merged configs, by study and fields


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
    rank: list = field(default_factory=list)  # measure downstream: arms ranked by final loss and by final score
    smoke: dict = field(default_factory=dict)  # fields set on every point last (`smoke`); empty for a real study

    @property
    def run(self) -> RunConfig:  # how points are computed (Sweep.execution records it)
        return self.config({}).run

    def config(self, fields: dict) -> TrainConfig:
        """The base with `fields` ({dotted field: value}) set, through keel's one merge; each distinct one merged once
        (a study asks for the same few configs hundreds of times, a merge each), a copy returned."""
        key = (repr(self), json.dumps(fields, default=repr))
        if key not in _CONFIGS:
            if len(_CONFIGS) >= 4096:
                _CONFIGS.clear()
            _CONFIGS[key] = self._merged(fields)
        return copy.deepcopy(_CONFIGS[key])

    def _merged(self, fields: dict) -> TrainConfig:
        # the model's max_seq_len is set to run.seq_len below: until then, room for any run.seq_len
        base = TrainConfig(model=science(max_seq_len=2**24), data=DataConfig(), optim=OptimConfig(warmup_steps=40),
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
    excepted), its first two seeds, no marginal seeds, a stream study's init at SMOKE's depth, a downstream study's
    tasks on 8 items; seconds on a CPU."""
    seeds, init = study.seeds[:2], study.stream.get("init_blocks")
    probes = {"run.eval_tasks_items": 8} if study.measure == "downstream" else {}
    return replace(study, smoke=SMOKE | probes, seeds=seeds, select_seeds=[s for s in study.select_seeds if s in seeds],
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


def read(doc: dict, where: str, quick: bool = False) -> DeclaredStudy:
    """The study in `doc` (a study file's mapping), checked whole: every arm, axis value and grid value merged
    into the base; one ConfigError naming `where` and the field. `quick`: at its smoke-test size (`smoke`), checked
    at that size."""
    bad = lambda what: ConfigError(f"{where}: {what}")
    unknown = sorted(set(map(str, doc)) - set(KEYS))
    if unknown:
        raise bad(f"unknown key {unknown[0]!r} (allowed: {', '.join(KEYS)})")
    for key in ("base", "arms", "axes"):
        if not isinstance(doc.get(key) or {}, dict):
            raise bad(f"{key}: a mapping")
    if text := next((k for k in ("question", "answer", "rule") if not isinstance(doc.get(k, ""), str | None)), None):
        raise bad(f"{text}: text, quoted if it holds a ': ' or starts with '[' or '{{' (got {doc[text]!r})")
    arms = {str(k): dotted(v or {}) if isinstance(v, dict) else v for k, v in (doc.get("arms") or {}).items()}
    if len(arms) < 2:
        raise bad("arms: at least two arms to compare (name -> the fields it sets)")
    for name, fields in arms.items():
        if not _NAME.fullmatch(name) or not isinstance(fields, dict):
            raise bad(f"arms.{name}: an arm is a name (letters, digits, _, . and -) -> a mapping of fields")
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
    if measure in ("redundancy", "downstream") and (given := [k for k in (*LOSS_ONLY, "axes") if doc.get(k) and (
            k != "untested" or measure == "redundancy")]):
        raise bad(f"{given[0]}: not used by measure {measure} (one cell, nothing chosen, no loss curve)")
    rank = doc.get("rank") or []
    if rank and (measure != "downstream" or not isinstance(rank, list) or len(rank) < 2
                 or len(set(map(str, rank))) < len(rank) or not set(map(str, rank)) <= set(arms)):
        raise bad(f"rank: measure downstream's two or more distinct arms, ranked by loss and by score (got {rank!r})")
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
            flat = isinstance(pairs, list) and all(isinstance(p, str) for p in pairs)  # [a, b] for [[a, b]]
            stray = [x for p in pairs if isinstance(p, list) for x in _leaves(p) if isinstance(x, str) and x not in {
                *names, *pinned}] if isinstance(pairs, list) else []
            raise bad(f"{key_}: pairs of two different arms out of {', '.join(names)} (or of two such pairs), or of "
                      f"arm@cell on both sides (a cell of {', '.join(cells) or 'none: no axes'}) (got {pairs!r}"
                      + (f"; {stray[0]!r} is none of them)" if stray else "; a list of pairs: [[a, b]])" if flat
                         else ")"))
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
        probe=doc.get("probe", False), max_lr=doc.get("max_lr") or {}, crossing=crossing, stream=got, rank=rank)
    study = smoke(study) if quick else study
    _check_configs(study, bad)
    return study


def _check_max_lr(doc: dict, arms: dict, bad) -> None:
    # none of the loss measurement's keys, and its own `max_lr` mapping (MAX_LR)
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


def _ladder(values, edge: float, sign: int) -> bool:  # positive values moving away from the edge (-1: below it)
    steps = [edge, *values] if isinstance(values, list) else []
    return bool(values) and all(map(_positive, values)) and all(sign * (b - a) > 0 for a, b in zip(steps, steps[1:]))


def _check_configs(study: DeclaredStudy, bad) -> None:
    # every arm, axis value and grid value through the merge, alone and then together, before any point trains
    halves = {}  # a local data source's shortest validation half, prepared here as its first point would

    def check(where: str, fields: dict) -> TrainConfig:
        try:
            config = study.config(fields)
            source, data = config.data.source, repr(config.data)  # tokens: by tokenizer, split and field too
            if source != "stdlib" and not source.startswith("hf:"):
                if data not in halves:
                    halves[data] = min(map(len, common.splits(config.data).values()))
                if halves[data] <= config.run.seq_len:
                    raise ConfigError(f"data.source: {source}: half its validation split is {halves[data]} tokens "
                                      f"of data.tokenizer {config.data.tokenizer}, not one window of run.seq_len + 1 "
                                      f"({config.run.seq_len + 1}); add text")
            return config
        except KeelError as err:
            raise bad(f"{where}: {err}") from None
    for name in study.tuned():  # an arm a step leaves out keeps its own value
        tuning = {a for s in study.tune if s["field"] == name for a in s.get("arms", study.arms)}
        owners = [f"axes.{name}"] * (name in study.axes) + [f"arms.{a}" for a, f in study.arms.items()
                                                            if name in f and a in tuning]
        if owners:
            raise bad(f"tune: {name} is chosen per arm and cell, so {owners[0]} may not set it")
    if owner := next(((a, n) for a, f in study.arms.items() for n in f if n in study.axes), None):
        raise bad(f"axes: {owner[1]} is set per cell, so arms.{owner[0]} may not set it (the cell's value would win)")
    if not check("base", {}).run.eval_tasks and study.measure == "downstream":
        raise bad("run.eval_tasks: measure downstream scores tasks; name at least one (e.g. [brackets, indent])")
    for arm, fields in study.arms.items():
        if check(f"arms.{arm}", fields).model.loop_blocks and study.measure == "redundancy":  # blocks are shared
            raise bad(f"arms.{arm}: model.loop_blocks: measure redundancy takes out one sub-layer of its own")
    for name, values in study.axes.items():
        for value in values:
            check(f"axes.{name}", {name: value})
    tunes = lambda arm: [(i, s) for i, s in enumerate(study.tune) if arm in s.get("arms", study.arms)]
    for i, step in enumerate(study.tune):  # on the first arm it tunes (a field such as alpha is one scheme's)
        first = study.arms[next(a for a in study.arms if (i, step) in tunes(a))]
        for value in [*step["grid"], *step.get("below", []), *step.get("above", [])]:
            if isinstance(_get(check(f"tune[{i}]", {**first, step["field"]: value}), step["field"]), bool | str):
                raise bad(f"tune[{i}]: {step['field']} is not a number")
    for arm, fields in study.arms.items():
        for cell in study.cells():
            for i, step in tunes(arm) or [(None, {"field": None, "grid": [None]})]:
                for value in step["grid"]:
                    check(f"arms.{arm} at {_cell_name(cell) or 'the base'}" + (f", tune[{i}] {step['field']}={value}"
                                                                               if step["field"] else ""),
                          {**fields, **cell, **({} if step["field"] is None else {step["field"]: value})})


def _get(config, key: str):
    return functools.reduce(getattr, key.split("."), config)


def _leaves(side) -> list:  # the arms a side of a pair names (a side may be a pair: its difference)
    return [a for x in side for a in _leaves(x)] if isinstance(side, list) else [side]


def _pinned(best_of: dict, name: str) -> bool:
    # whether `name` (an arm, arm@cell or a best_of) is at one cell whatever the cell a test is in
    return "@" in name or "@" in best_of.get(name, [""])[0]


def _cell_name(cell: dict) -> str:
    return "-".join(f"{k.rsplit('.', 1)[-1]}{v}" for k, v in cell.items())


def key(arm: str, cell: dict, hp: dict, seed: int) -> str:
    parts = [arm, _cell_name(cell), *(f"{k.rsplit('.', 1)[-1]}{v:g}" for k, v in hp.items()), f"seed{seed}"]
    return re.sub(r"[^A-Za-z0-9._-]", "_", "-".join(p for p in parts if p))

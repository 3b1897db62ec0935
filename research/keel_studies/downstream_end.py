"""downstream-end (the paper's Appendix B again): does Keel score higher downstream than Pre-LN at equal loss when
both are read at the end of their own schedule?

`keel experiment downstream` reads both arms where their curves first reach l*: Keel part-way through its 2000-step
run (LR still high), Pre-LN near its end (annealed). Here each arm is read at the end of a schedule of its own:
  - the reference arm (`reference`) runs `run.steps` steps (its committed points in `reference_dir`, read only;
    None: trained here); the target T is the mean over `seeds` of its final report loss;
  - the tested arm (`arm`) runs warm-up then cosine over S steps, S on the grid round(search_start *
    search_factor**k), k any integer (`search`): S = search_start first, on `search_seeds` (never reported); while the
    mean final loss m(S) is above T the next larger S, else the next smaller, until two adjacent evaluated values
    bracket T (one above, one at or below) or `search_max` values were run (the last is then a bound); then, with
    `bisect` > 0 (the grid's factor can leave even the bracket's nearer end further from T than `loss_tolerance`, so
    that the premise, equal loss, fails by the grid's coarseness alone), the bracket is halved up to `bisect` times,
    its midpoint run on the search seeds and put in place of the end on its side of T, stopping once a midpoint's
    m(S) is within `bisect_tolerance` of T; the chosen S is the value of the final pair (or the bound) with m(S)
    nearest T;
  - `arm` at the chosen S on every seed of `seeds`. Per seed, d_score = final score(arm) - final score(reference),
    d_loss likewise; paired two-sided t-tests (keel.experiments.stats), Holm over the two (`judge`).
The score is downstream's: the mean accuracy over `run.eval_tasks` at the last evaluation (keel_studies.downstream
trains every point, with its curve every `run.eval_tasks_every` steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import numpy as np
import yaml

from keel import evals
from keel.config import OptimConfig, RunConfig
from keel.errors import ConfigError
from keel.experiments import declared, downstream, stats, store
from keel.experiments.common import (
    corpus,
    experiment_run,
    markdown_table,
    pm,
    point_config,
    pyplot,
    save,
    write_outputs,
)
from keel.experiments.downstream import final
from keel.experiments.downstream import mean as _mean
from keel.experiments.study_file import dotted
from keel.experiments.sweep import EXECUTION_FIELDS, Sweep
from keel.model.schemes import SCHEMES
from keel_studies.common import ExperimentConfig, tiny_quick

# fields recorded with this study's points (its config was downstream's before downstream became a study file) that it
# has no use for: it trains `arm` and `reference` only
_UNUSED = ("schemes", "depths", "deep_sublayers", "wide_sublayers", "wide_d_model", "wide_heads", "wide_kv_heads")


def _lrs() -> dict[str, float]:  # downstream's LRs (results/downstream/study.yaml)
    return {"post_ln-32": 3e-3, "pre_ln-32": 3e-3, "keel-32": 3e-3,
            "post_ln-64": 3e-3, "pre_ln-64": 1e-3, "keel-64": 3e-3, "wide-pre_ln": 3e-3}


@dataclass
class DownstreamEndConfig(ExperimentConfig):
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(warmup_steps=100))
    # eager: the method was fixed for (and its cost measured on) eager runs that reproduce depth-long-32's losses
    run: RunConfig = field(default_factory=lambda: experiment_run(
        steps=2000, batch_size=8, seq_len=64, eval_batches=16, eval_tasks=list(evals.PROBES), eval_tasks_every=250,
        eval_tasks_items=200, compile=False))
    schemes: list[str] = field(default_factory=lambda: ["post_ln", "pre_ln", "keel"])
    depths: list[int] = field(default_factory=lambda: [32, 64])
    lrs: dict[str, float] = field(default_factory=_lrs)  # arm ("<scheme>-<sub-layers>") -> LR
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    deep_sublayers: int = 32
    wide_sublayers: int = 8
    wide_d_model: int = 128
    wide_heads: int = 8
    wide_kv_heads: int = 4
    chance_margin: float = 0.05  # a comparison where neither arm's mean score exceeds chance by this is moot
    arm: str = "keel-64"  # "<scheme>-<sub-layers>": the arm whose schedule is searched
    reference: str = "pre_ln-64"  # the arm read at the end of its run.steps-step runs
    reference_dir: str | None = "results/downstream"  # the reference's points (read only); None: train them here
    search_seeds: list[int] = field(default_factory=lambda: [90, 91])  # the search's seeds, never reported
    search_start: int = 1250  # the first step count the search runs
    search_factor: float = 1.25  # between adjacent step counts of the search's grid
    search_max: int = 5  # most step counts the search runs
    loss_tolerance: float = 0.02  # nats: a larger mean final-loss gap makes the comparison inconclusive
    bisect: int = 0  # times the bracket is halved after it is found (0: S is the nearer of the grid's pair)
    bisect_tolerance: float = 0.01  # nats: a midpoint this near the target ends the halving

    PER_POINT: ClassVar[dict[str, str]] = ExperimentConfig.PER_POINT | {
        "model.scheme": "arm and reference", "model.n_blocks": "arm and reference"}

    def fixed_fields(self) -> dict[str, str]:
        fixed = {k: v for k, v in super().fixed_fields().items()
                 if k not in ("run.eval_tasks", "run.eval_tasks_every", "run.eval_tasks_items")}  # its subject
        return fixed | {name: "downstream-end trains `arm` and `reference` only" for name in _UNUSED}

    def arm_schemes(self) -> set[str]:
        return {self.arm.rsplit("-", 1)[0], self.reference.rsplit("-", 1)[0]}

    @classmethod
    def quick(cls) -> DownstreamEndConfig:
        q = tiny_quick(cls, 8, arm="keel-4", reference="pre_ln-4", reference_dir=None, seeds=[0, 1],
                       search_seeds=[90], search_start=6, search_factor=1.5, search_max=3,
                       lrs={"keel-4": 3e-3, "pre_ln-4": 3e-3})
        q.run = replace(q.run, eval_tasks_every=4, eval_tasks_items=8)
        return q

    def arm_model(self, arm: str):
        scheme, n = arm.rsplit("-", 1)
        return self.point_model(scheme, int(n))

    def at_steps(self, steps: int) -> DownstreamEndConfig:
        return replace(self, run=replace(self.run, steps=steps))


def end_key(arm: str, steps: int, lr: float, seed: int) -> str:
    return f"{arm}-steps{steps}-lr{lr:g}-seed{seed}"


def check(cfg: DownstreamEndConfig) -> None:
    """The config's own fields make sense (one ConfigError naming the field), before anything is read or trained."""
    for name in ("arm", "reference"):
        arm = getattr(cfg, name)
        scheme, _, n = arm.rpartition("-")
        if scheme not in SCHEMES or not n.isdigit() or int(n) < 2 or int(n) % 2:
            raise ConfigError(f"{name}: {arm!r} is not '<scheme>-<even sub-layers>' (schemes: {', '.join(SCHEMES)})")
        if arm not in cfg.lrs:
            raise ConfigError(f"lrs: no LR for {arm} ({name})")
    if not cfg.run.eval_tasks:
        raise ConfigError("run.eval_tasks: downstream-end scores tasks; name at least one (e.g. [brackets,indent])")
    if cfg.bisect < 0 or not cfg.bisect_tolerance >= 0:
        raise ConfigError(f"bisect >= 0 and bisect_tolerance >= 0, got {cfg.bisect} and {cfg.bisect_tolerance}")
    if cfg.search_start < 1 or cfg.search_factor <= 1 or cfg.search_max < 1:
        raise ConfigError("search_start >= 1, search_factor > 1 and search_max >= 1, got "
                          f"{cfg.search_start}, {cfg.search_factor} and {cfg.search_max}")
    if set(cfg.search_seeds) & set(cfg.seeds):
        raise ConfigError(f"search_seeds: {sorted(set(cfg.search_seeds) & set(cfg.seeds))} also in seeds; the "
                          "search's seeds are never reported")


def key(arm: str, lr: float, seed: int) -> str:  # a reference point trained here
    return f"{arm}-lr{lr:g}-seed{seed}"


def point(cfg: DownstreamEndConfig, model_cfg, lr: float, seed: int) -> dict:
    return downstream.point(point_config(cfg, model_cfg, seed, lr=lr))


def reference_points(cfg: DownstreamEndConfig) -> dict[str, dict]:
    """The reference arm's committed points in `reference_dir` (a study file's folder, keel.experiments.declared),
    by seed, after checking that its study trains that arm as this config would (every TrainConfig field but how a
    point is computed). A missing file is one ConfigError naming every missing path."""
    folder, lr = Path(cfg.reference_dir), cfg.lrs[cfg.reference]
    file = folder / "study.yaml"
    study = declared.read(yaml.safe_load(file.read_text()), str(file)) if file.is_file() else None
    if study is None or cfg.reference not in study.arms:
        raise ConfigError(f"reference_dir: {file} is not a study file with an arm {cfg.reference} "
                          "(reference_dir=null trains the reference arm here)")
    paths = {s: store.path_of(folder / "points", declared.key(cfg.reference, {}, {}, s)) for s in cfg.seeds}
    missing = [str(folder / "points" / f"{declared.key(cfg.reference, {}, {}, s)}{store.SUFFIX}")
               for s, p in paths.items() if p is None]
    if missing:
        raise ConfigError(f"reference_dir: the reference arm's points are missing: {', '.join(missing)} "
                          "(reference_dir=null trains the reference arm here)")
    theirs = study.config(study.arms[cfg.reference])
    flat = lambda c: dotted(asdict(point_config(c, c.model, 0)))
    mine, recorded = flat(point_config(cfg, cfg.arm_model(cfg.reference), 0, lr=lr)), flat(theirs)
    differ = [k for k in mine if mine[k] != recorded.get(k) and k not in EXECUTION_FIELDS]
    if differ:
        raise ConfigError(f"reference_dir: {file} trains {cfg.reference} with another {', '.join(differ)}; set them "
                          "as it does, or reference_dir=null to train the reference arm here")
    return {key(cfg.reference, lr, s): store.read(p) for s, p in paths.items()}


# ---- the search ----------------------------------------------------------------------------------------

def search(mean_loss: Callable[[int], float], target: float, start: int, factor: float, max_steps: int,
           bisect: int = 0, tolerance: float = 0.0) -> dict:
    """The step count whose mean final loss is nearest `target`, on the grid round(start * factor**k).

    Runs `mean_loss(start)`, then walks the grid up while the loss is above the target and down while it is at or
    below, until the last two values bracket the target or `max_steps` values were run (or the grid falls below
    1 step): then the last value is a bound ("high": more steps than tried are needed; "low": fewer). A bracket is
    then halved up to `bisect` times (`_halve`). Returns {"evaluated": [[steps, loss], ...] in the order run,
    "bracket": [above, at or below] or None, "bound", "chosen"}. A loss that is not finite counts as above the
    target."""
    evaluated, k, direction = [], 0, 0
    steps = start
    while True:
        loss = mean_loss(steps)
        evaluated.append([steps, loss])
        above = not loss <= target  # NaN is above
        if direction and above != (direction > 0):  # crossed: the last two bracket the target
            hi, lo = evaluated[-2:] if direction > 0 else evaluated[:-3:-1]
            hi, lo = _halve(mean_loss, target, hi, lo, evaluated, bisect, tolerance)
            chosen = min((lo, hi), key=lambda e: _gap(e[1], target))[0]  # a tie goes to the one at or below
            return {"evaluated": evaluated, "bracket": [hi[0], lo[0]], "bound": None, "chosen": chosen}
        direction = direction or (1 if above else -1)
        nxt = steps
        while nxt == steps:  # rounding may repeat a value at small counts: the next distinct one
            k += direction
            nxt = round(start * factor ** k)
        if len(evaluated) >= max_steps or nxt < 1:
            return {"evaluated": evaluated, "bracket": None, "bound": "high" if direction > 0 else "low",
                    "chosen": steps}
        steps = nxt


def _halve(mean_loss: Callable[[int], float], target: float, hi: list, lo: list, evaluated: list, times: int,
           tolerance: float) -> tuple[list, list]:
    """Bisect the bracket ([steps, loss] above the target, [steps, loss] at or below it) up to `times` times: run the
    midpoint (in steps, rounded), append it to `evaluated` and put it in place of the end on its side, until a
    midpoint is within `tolerance` of the target or the ends are adjacent step counts. The final pair."""
    for _ in range(times):
        mid = round((hi[0] + lo[0]) / 2)
        if mid in (hi[0], lo[0]):
            break
        point = [mid, mean_loss(mid)]
        evaluated.append(point)
        if not point[1] <= target:
            hi = point
        else:
            lo = point
        if _gap(point[1], target) <= tolerance:
            break
    return hi, lo


def _gap(loss: float, target: float) -> float:
    return abs(loss - target) if math.isfinite(loss) else math.inf


def mean_final_loss(points: list[dict]) -> float:
    """The mean final report loss over seeds, a diverged seed counting as +inf (frontier's rule)."""
    return float(np.mean([v if v is not None and math.isfinite(v) else math.inf
                          for v in (final(p, "loss") for p in points)]))


# ---- the verdict ---------------------------------------------------------------------------------------

def judge(cfg: DownstreamEndConfig, arm: dict, ref: dict, chance: float) -> dict:
    """`arm` and `ref`: {"loss": [...], "score": [...]} per seed, each at the end of its own schedule. Paired tests of
    arm - ref in loss and in score, Holm over the two. The losses differ (inconclusive) when the loss test is
    significant at its raw p (the stricter reading of a precondition) or |mean d_loss| > loss_tolerance; moot when
    neither arm's mean score is chance_margin above chance; else the score test at its Holm-adjusted p."""
    loss = stats.paired(arm["loss"], ref["loss"])
    score = stats.paired(arm["score"], ref["score"])
    p_loss, p_score = stats.holm([loss["p"], score["p"]])
    means = {"arm": _mean(arm["score"]), "reference": _mean(ref["score"])}
    if stats.significant(loss) or not abs(loss["mean"]) <= cfg.loss_tolerance:  # a NaN mean (no pairs) too
        verdict = "inconclusive (final losses differ)"
    elif all(m is None or m < chance + cfg.chance_margin for m in means.values()):
        verdict = "inconclusive (both at chance)"
    else:
        verdict = stats.verdict(score | {"p": p_score}, "disagrees (scores lower)", "agrees (scores higher)")
    return {"loss": loss | {"p_holm": p_loss}, "score": score | {"p_holm": p_score}, "mean_score": means,
            "chance": chance, "verdict": verdict}


# ---- the run and its report ----------------------------------------------------------------------------

def run(cfg: DownstreamEndConfig, out: Path, command: str) -> dict:
    check(cfg)
    ref_lr, lr = cfg.lrs[cfg.reference], cfg.lrs[cfg.arm]
    committed = reference_points(cfg) if cfg.reference_dir is not None else None
    # a bad task name, or a corpus too small for a probe, fails before any training
    evals.prepare(evals.resolve(cfg.run.eval_tasks), cfg.data, corpus(cfg.data).tokenizer)
    sweep, model = Sweep(out, cfg), cfg.arm_model(cfg.arm)
    points: dict = {}
    if committed is None:
        ref_model = cfg.arm_model(cfg.reference)
        points |= sweep.run({key(cfg.reference, ref_lr, s): (lambda s=s: point(cfg, ref_model, ref_lr, s))
                             for s in cfg.seeds}, "downstream-end reference")
    refs = committed or points
    ref_runs = [refs[key(cfg.reference, ref_lr, s)] for s in cfg.seeds]
    target = _mean([final(p, "loss") for p in ref_runs])
    if target is None:
        raise ConfigError(f"{cfg.reference}: every reference run diverged; no target loss")

    def arm_at(steps: int, seeds: list[int], desc: str) -> list[dict]:
        at = cfg.at_steps(steps)
        jobs = {end_key(cfg.arm, steps, lr, s): (lambda s=s: point(at, model, lr, s)) for s in seeds}
        points.update(sweep.run(jobs, desc))
        return [points[k] for k in jobs]

    found = search(lambda steps: mean_final_loss(arm_at(steps, cfg.search_seeds, f"downstream-end search {steps}")),
                   target, cfg.search_start, cfg.search_factor, cfg.search_max, cfg.bisect, cfg.bisect_tolerance)
    runs = arm_at(found["chosen"], cfg.seeds, f"downstream-end {cfg.arm} at {found['chosen']} steps")
    per = {name: {"loss": [final(p, "loss") for p in rs], "score": [final(p, "score") for p in rs]}
           for name, rs in (("arm", runs), ("reference", ref_runs))}
    res = {"target": target, "search": found | {"per_seed": {
               str(s): [final(points[end_key(cfg.arm, s, lr, seed)], "loss") for seed in cfg.search_seeds]
               for s, _ in found["evaluated"]}},
           "reference_from": str(Path(cfg.reference_dir) / "points") if committed else "trained here",
           "final": per, "comparison": judge(cfg, per["arm"], per["reference"], downstream.chance(runs[0]))}
    res["search"]["evaluated"] = [[s, m if math.isfinite(m) else None] for s, m in found["evaluated"]]
    table, notes = _tables(cfg, res)
    plots = [_plot(cfg, res, runs, ref_runs, out)]
    write_outputs(out, "downstream-end", cfg, command, {"points": points, **res}, table, plots, notes)
    return res


def _tables(cfg: DownstreamEndConfig, res: dict) -> tuple[str, str]:
    found, target, c = res["search"], res["target"], res["comparison"]
    rows = [[s, f"{s * cfg.tokens_per_step():,}", f"{m:.4f}" if m is not None else "diverged",
             ", ".join(f"{v:.4f}" if v is not None else "diverged" for v in found["per_seed"][str(s)]),
             "above" if m is None or m > target else "at or below",
             "chosen" if s == found["chosen"] else ""] for s, m in found["evaluated"]]
    table = markdown_table(["steps S (in the order run)", "tokens", f"mean final loss ({cfg.search_seeds})",
                            "each search seed", "vs target", ""], rows)
    steps = {"arm": found["chosen"], "reference": cfg.run.steps}
    arm_rows = [[getattr(cfg, name), f"{cfg.lrs[getattr(cfg, name)]:g}", steps[name],
                 pm(res["final"][name]["loss"], 4), pm(res["final"][name]["score"])] for name in ("arm", "reference")]
    arms = markdown_table(["arm", "LR", "steps (its own schedule)", "final report loss", "final score"], arm_rows)
    tests = markdown_table(["arm - reference, per seed", "mean [95% CI], raw p", "Holm p (over these 2)"],
                           [[what, stats.describe(c[what], 4), f"{c[what]['p_holm']:.2g}"
                             if c[what]["p_holm"] is not None else "n/a"] for what in ("loss", "score")])
    if found["bound"]:
        chosen = (f"**{found['chosen']} steps, a bound**: {cfg.search_max} step counts run without bracketing the "
                  f"target ({'more' if found['bound'] == 'high' else 'fewer'} steps would be needed)")
    else:
        above, below = found["bracket"]
        chosen = (f"**{found['chosen']} steps**: {above} and {below} steps bracket the target"
                  f"{' after halving' if cfg.bisect else ''}; the nearer of the two")
    halving = (f", then its bracket halved up to {cfg.bisect} times, stopping at a midpoint within "
               f"{cfg.bisect_tolerance:g} nats of T" if cfg.bisect else "")
    notes = (f"Target T = {target:.4f} nats: the mean final report loss of {cfg.reference} over seeds {cfg.seeds} "
             f"after its own {cfg.run.steps} steps ({res['reference_from']}). {cfg.arm} runs warm-up "
             f"{cfg.optim.warmup_steps} then cosine over S steps; S searched on the grid round({cfg.search_start} x "
             f"{cfg.search_factor:g}^k) on seeds {cfg.search_seeds} (at most {cfg.search_max} values){halving}. "
             f"Chosen: {chosen}.\n\n{arms}\n\nEach arm read at the end of its own schedule: report-half loss on "
             f"{cfg.run.eval_batches} fixed batches; score = mean accuracy over {', '.join(cfg.run.eval_tasks)} "
             f"({cfg.run.eval_tasks_items} items each). Paired two-sided t-tests over seeds {cfg.seeds}, Holm over "
             f"the two.\n\n{tests}\n\nVerdict on \"Keel scores higher downstream than Pre-LN at equal loss, each at "
             f"the end of its own schedule\" ({cfg.arm} vs {cfg.reference}): **{c['verdict']}**. Inconclusive when the "
             f"final losses differ (loss test at raw p < {stats.ALPHA} or |mean| > {cfg.loss_tolerance} nats) or "
             f"neither mean score is {cfg.chance_margin} above chance ({c['chance']:.3f}); else the score test at "
             "its Holm p.")
    return table, notes


def _plot(cfg: DownstreamEndConfig, res: dict, runs: list[dict], ref_runs: list[dict], out: Path) -> str:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    found = res["search"]
    done = sorted((s, m) for s, m in found["evaluated"] if m is not None)
    for s, _ in found["evaluated"]:
        seeds = [v for v in found["per_seed"][str(s)] if v is not None]
        left.scatter([s] * len(seeds), seeds, color="grey", s=10, alpha=0.6)
    left.plot([s for s, _ in done], [m for _, m in done], color="C0", marker="o", label=f"{cfg.arm}: mean final loss")
    left.axhline(res["target"], color="black", ls=":", lw=0.8, label=f"target ({cfg.reference}'s final loss)")
    left.axvline(found["chosen"], color="C0", ls="--", lw=0.8, label="chosen S" + (" (a bound)" if found["bound"]
                                                                                  else ""))
    left.set_xscale("log")
    left.set_xticks([s for s, _ in done], [str(s) for s, _ in done])
    left.minorticks_off()
    left.set_xlabel("steps S of the arm's own schedule")
    left.set_ylabel("final report-half loss (dots: each search seed)")
    for i, (name, rs) in enumerate(((f"{cfg.arm}, {found['chosen']} steps", runs),
                                    (f"{cfg.reference}, {cfg.run.steps} steps", ref_runs))):
        for j, p in enumerate(rs):
            right.plot(p["curve"]["loss"], p["curve"]["score"], color=f"C{i}", alpha=0.4, lw=0.8, marker=".", ms=3,
                       label=name if j == 0 else None)
            if not p["diverged"]:
                right.scatter([p["curve"]["loss"][-1]], [p["curve"]["score"][-1]], color=f"C{i}", s=25, zorder=3)
    right.axhline(res["comparison"]["chance"], color="grey", ls="--", lw=0.8, label="chance")
    right.axvline(res["target"], color="black", ls=":", lw=0.8, label="target")
    right.invert_xaxis()
    right.set_xlabel("report-half loss (nats; training goes right; big dots: the end)")
    right.set_ylabel("score: mean probe accuracy (each line one seed)")
    for ax in (left, right):
        ax.legend(fontsize=7)
    fig.suptitle(f"each arm at the end of its own schedule, d={cfg.model.d_model}: {res['comparison']['verdict']}",
                 fontsize=10)
    return save(fig, out, "downstream-end.png")

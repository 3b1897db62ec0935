"""equal-tuning: every scheme at 128 and 256 sub-layers tuned by the same search, and Keel with its alpha tuned too.

Each arm of `schemes` gets one round of coordinate search at each depth (`depth_sweep.tune_arm` with the warm-up
tuned for every arm, not for one): its LR at the base warm-up, then at that LR the warm-up grid, then, if the
warm-up moved, its LR again; the grids grow past an edge choice. A second Keel arm, "Keel tuned", starts from
Keel's choice (alpha = L) and takes alpha from `alphas`, then, if alpha moved, its LR again at that alpha.
Choices are made on `seeds` (select half); every arm's choice then also runs `final_seeds`, and every test is
on all of them: Keel - X and Keel tuned - X for X in Post-LN, DeepNorm, Pre-LN, paired over seeds on the report
half, Holm over the study's distinct tests (a Keel tuned arm that chose Keel's own runs shares Keel's tests).

Points at identical settings already run by the studies in `reuse` (their recorded config equal in every
section but how a point is computed) are read from there, not run again, and the report lists them as shared.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import ClassVar

from keel.errors import ConfigError
from keel.experiments import stats, store
from keel.experiments.budget import budget_point
from keel.experiments.common import markdown_table, mean_sd, pm, pyplot, save, write_outputs
from keel.experiments.grid import Grid, run_searches, search_grid
from keel.experiments.sweep import EXECUTION_FIELDS, Sweep, _differences
from keel_studies import depth_sweep as ds
from keel_studies.common import tiny_quick, tokens, unigram_level

TUNED = "keel_tuned"  # the Keel arm whose alpha is tuned too
OTHERS = ("post_ln", "deepnorm", "pre_ln")  # every test is Keel - X or Keel tuned - X
NAMES = ds.NAMES | {TUNED: "Keel tuned"}


@dataclass
class EqualTuningConfig(ds.DepthSweepConfig):
    depths: list[int] = field(default_factory=lambda: [128, 256])
    alphas: list = field(default_factory=lambda: ["L", "sqrtL", 2.0])  # Keel tuned's alpha grid (model.alpha)
    final_seeds: list[int] = field(default_factory=lambda: [3, 4])  # run on every arm's choice; tests on all seeds
    marginal_seeds: list[int] = field(default_factory=list)  # unused: every test is on seeds + final_seeds
    warmup_scheme: str = "every arm"  # unused: every arm's warm-up is tuned
    # finished studies whose points at identical settings are read, not run again (shared, and reported so)
    reuse: list[str] = field(default_factory=lambda: ["results/depth-sweep"])

    PER_POINT: ClassVar[dict[str, str]] = ds.DepthSweepConfig.PER_POINT | {"model.alpha": "alphas"}

    @classmethod
    def quick(cls) -> EqualTuningConfig:
        return tiny_quick(cls, 6, depths=[2, 4], seeds=[0, 1], final_seeds=[2], lrs=[3e-3, 1e-2], max_extensions=1,
                          warmups=[2, 3, 4], warmups_below=[1], warmups_above=[6], curve_every=2, curve_batches=1,
                          alphas=["L", 2.0], reuse=[])


def check(cfg: EqualTuningConfig) -> None:
    """The study as a whole, before any point trains: one line naming the field."""
    ds.check(cfg)
    problems = [
        (not cfg.depths or any(not isinstance(d, int) or d < 2 or d % 2 for d in cfg.depths),
         f"depths must be even sub-layer counts >= 2, got {cfg.depths}"),
        (len(cfg.seeds) < 2, f"seeds must hold at least 2 seeds (a paired test), got {cfg.seeds}"),
        (bool(set(cfg.seeds) & set(cfg.final_seeds)), "final_seeds must be new seeds"),
        (not set(OTHERS) <= set(cfg.schemes), f"schemes must hold keel and {', '.join(OTHERS)}"),
        (not cfg.alphas or cfg.alphas[0] != "L", "alphas must start with L (Keel's own runs)"),
    ]
    for bad, why in problems:
        if bad:
            raise ConfigError(f"equal-tuning: {why}")
    for where in cfg.reuse:
        _reusable_config(cfg, Path(where))


def _sections(recorded: dict) -> dict:
    """What a point's result depends on besides its key: keel train's sections, less how it is computed."""
    out = {k: dict(recorded[k]) for k in ("model", "data", "optim", "guard", "run")}
    for dotted in EXECUTION_FIELDS:
        section, name = dotted.split(".")
        out[section].pop(name, None)
    for name in ("curve_every", "curve_batches", "probe", "probe_batches"):
        out[name] = recorded.get(name)
    return out


def _reusable_config(cfg: EqualTuningConfig, where: Path) -> Path:
    recorded = where / "points" / "config.json"
    if not recorded.is_file():
        raise ConfigError(f"equal-tuning: reuse: {where} holds no points/config.json")
    theirs = _sections(json.loads(recorded.read_text()))
    mine = _sections(json.loads(json.dumps(asdict(cfg))))
    # a field added to the code after those points were recorded is no difference while it holds its default
    defaults = _sections(json.loads(json.dumps(asdict(type(cfg)()))))
    differ = sorted({name.split(".")[0] for name in _differences(mine, theirs, defaults)})
    if differ:
        raise ConfigError(f"equal-tuning: reuse: {where}'s points differ in {', '.join(differ)}; drop it from reuse")
    return where / "points"


def arm_key(arm: str, depth: int, lr: float, warmup: int, alpha, seed: int) -> str:
    """A point's name: Keel tuned at alpha = L is Keel's own run (the same key)."""
    if arm == TUNED:
        arm = "keel" if alpha == "L" else f"keel_a{alpha:g}" if isinstance(alpha, float) else f"keel_a{alpha}"
    return ds.key(arm, depth, lr, warmup, seed)


def _model(cfg: EqualTuningConfig, arm: str, depth: int, alpha):
    if arm == TUNED:
        return cfg.point_model("keel", depth, alpha=None if alpha == "L" else alpha)
    return cfg.point_model(arm, depth)


def _at_alpha(search, alpha):
    """A (lr, warm-up) search as one of (lr, warm-up, alpha) tuples."""
    hps = next(search)
    while True:
        yield [(lr, w, alpha) for lr, w in hps]
        try:
            hps = next(search)
        except StopIteration as stop:
            return stop.value


def tune_alpha(cfg: EqualTuningConfig, keel: dict, score, lrs: list[float], lattice: list[float]):
    """Keel tuned: alpha over `alphas` at Keel's chosen LR and warm-up, then, if alpha moved, the LR again there."""
    lr, warmup = keel["lr"], keel["warmup"]
    yield [(lr, warmup, a) for a in cfg.alphas]
    alpha = min(cfg.alphas, key=lambda a: ds._finite(score(lr, warmup, a)))  # the first (L) wins a tie
    tuned = {"alpha": alpha, "lr": lr, "warmup": warmup, "alphas_at": [lr, warmup]}
    if alpha != "L":
        grid = Grid(list(lrs), cfg.max_extensions, known=lattice)
        tuned["lr"] = yield from search_grid(grid, lambda v: (v, warmup, alpha), score)
        tuned["lr_grid_again"] = grid.describe()
    return tuned


class Points:
    """This study's points: run in `out` (two processes share them), or read from a reused study's points."""

    def __init__(self, cfg: EqualTuningConfig, out: Path):
        self.cfg, self.sweep, self.got, self.shared = cfg, Sweep(out, cfg), {}, {}
        self.reused = [_reusable_config(cfg, Path(w)) for w in cfg.reuse]

    def _reuse(self, key: str) -> bool:
        for where in self.reused:
            if store.exists(where, key):
                self.got[key], self.shared[key] = store.load(where, key), str(where.parent)
                return True
        return False

    def run(self, jobs: dict, desc: str, enough=None) -> dict:
        """`jobs` {key: (arm, depth, lr, warmup, alpha, seed)}: every point done, or as soon as `enough(done)`."""
        need = {k: j for k, j in jobs.items() if k not in self.got and not self._reuse(k)}
        ready = {k: self.got[k] for k in jobs if k in self.got}
        if need and not (enough is not None and enough(ready)):
            fns = {k: (lambda j=j: budget_point(*self._at(*j))) for k, j in need.items()}
            self.got |= self.sweep.run(fns, desc, None if enough is None else lambda done: enough(ready | done))
        return {k: self.got[k] for k in jobs if k in self.got}

    def _at(self, arm, depth, lr, warmup, alpha, seed):
        at = replace(self.cfg, optim=replace(self.cfg.optim, warmup_steps=warmup))
        return at, _model(at, arm, depth, alpha), lr, seed

    def select(self, arm, depth, lr, warmup, alpha) -> float:
        keys = [arm_key(arm, depth, lr, warmup, alpha, s) for s in self.cfg.seeds]
        return float(statistics.fmean([ds._finite(self.got[k].get("select_loss")) for k in keys]))


def _job(arm: str, depth: int, hp: tuple, seed: int) -> tuple[str, tuple]:
    """(key, job) for an arm's (lr, warm-up, alpha): alpha None is a plain arm's point (Keel's, for Keel tuned)."""
    lr, warmup, alpha = hp
    if alpha is None:
        arm = "keel" if arm == TUNED else arm
    else:
        arm = TUNED
    return arm_key(arm, depth, lr, warmup, alpha, seed), (arm, depth, lr, warmup, alpha, seed)


def tune_depth(cfg: EqualTuningConfig, pts: Points, depth: int, tuned: dict) -> dict[str, dict]:
    """Every arm's search at `depth`, run side by side; Keel tuned follows Keel's choice in the same loop."""
    starts = ds.start_lrs(cfg, depth, tuned)

    def plain(s):
        search = ds.tune_arm(cfg, s, lambda lr, w, s=s: pts.select(s, depth, lr, w, None), *starts[s],
                             tune_warmup=True)
        return _at_alpha(search, None)

    def keel_then_alpha():
        keel = yield from plain("keel")
        return (yield from tune_alpha(cfg, keel, lambda lr, w, a: pts.select(TUNED, depth, lr, w, a),
                                      *starts["keel"]))

    searches = {s: plain(s) for s in cfg.schemes} | {TUNED: keel_then_alpha()}

    def run_round(asked: dict) -> set[str]:
        jobs = {arm: dict(_job(arm, depth, hp, seed) for hp in hps for seed in cfg.seeds)
                for arm, hps in asked.items()}

        def complete(done):
            return {arm for arm, js in jobs.items() if js.keys() <= done.keys()}
        got = pts.run({k: j for js in jobs.values() for k, j in js.items()}, f"equal-tuning {depth} sub-layers",
                      enough=lambda done: bool(complete(done)))
        return complete(got)
    return run_searches(searches, run_round)


def final_seeds(cfg: EqualTuningConfig, pts: Points, depth: int, arms: dict) -> None:
    jobs = {}
    for arm, t in arms.items():
        alpha = t.get("alpha", "L") if arm == TUNED else None
        jobs |= {arm_key(arm, depth, t["lr"], t["warmup"], alpha, s): (arm, depth, t["lr"], t["warmup"], alpha, s)
                 for s in cfg.final_seeds}
    pts.run(jobs, f"equal-tuning {depth} sub-layers, final seeds")


def analyse(cfg: EqualTuningConfig, pts: Points, tuned: dict) -> dict:
    seeds = [*cfg.seeds, *cfg.final_seeds]
    arms, tests = {}, []
    for d, by_arm in tuned.items():
        arms[d] = {}
        for arm, t in by_arm.items():
            alpha = t.get("alpha", "L") if arm == TUNED else None
            keys = {s: arm_key(arm, d, t["lr"], t["warmup"], alpha, s) for s in seeds}
            losses = {s: pts.got[k].get("report_loss") for s, k in keys.items() if k in pts.got}
            arms[d][arm] = t | {"keys": keys, "report_by_seed": losses}
        for ref in ("keel", TUNED):
            same = ref == TUNED and arms[d][TUNED]["keys"] == arms[d]["keel"]["keys"]
            for x in OTHERS:
                a, b = arms[d][ref]["report_by_seed"], arms[d][x]["report_by_seed"]
                tests.append({"id": f"{ref}-{x}@{d}", "what": f"{NAMES[ref]} - {NAMES[x]} at {d}", "shares": same,
                              "test": stats.paired([a.get(s) for s in seeds], [b.get(s) for s in seeds])})
    distinct = [t for t in tests if not t["shares"]]
    for t, p_holm in zip(distinct, stats.holm([t["test"]["p"] for t in distinct])):
        t["p_holm"] = p_holm
    for t in tests:
        if t["shares"]:
            t["p_holm"] = next(u["p_holm"] for u in distinct if u["id"] == t["id"].replace(TUNED, "keel", 1))
        p = t["p_holm"]
        t["verdict"] = ("inconclusive" if p is None or p >= stats.ALPHA
                        else f"{t['what'].split(' - ')[0]} {'better' if t['test']['mean'] < 0 else 'worse'}")
    n_final = all(len(a["report_by_seed"]) == len(seeds) for by in arms.values() for a in by.values())
    return {"status": "final" if n_final and set(tuned) == set(cfg.depths) else "interim", "arms": arms,
            "tests": tests, "family_size": sum(t["test"]["p"] is not None for t in distinct),
            "shared": dict(sorted(pts.shared.items())),
            "core_hours": sum(p["seconds"] for k, p in pts.got.items() if k not in pts.shared) / 3600}


def _hp(arm: dict) -> str:
    text = f"LR {arm['lr']:g}, warm-up {arm['warmup']}" + (f", alpha {arm['alpha']}" if "alpha" in arm else "")
    grids = [f"{name} {', '.join(f'{v:g}' for v in arm[g]['values'])}" + (f" (bound {arm[g]['bound']})"
                                                                         if arm[g]["bound"] else "")
             for name, g in (("LR", "lr_grid"), ("warm-up", "warmup_grid"), ("LR again", "lr_grid_again"))
             if g in arm]
    return text + (f" (grids: {'; '.join(grids)})" if grids else "")


def write_report(cfg: EqualTuningConfig, out: Path, command: str, pts: Points, res: dict) -> None:
    rows = [[d, NAMES[arm], _hp(a), pm(list(a["report_by_seed"].values()))]
            for d, by in res["arms"].items() for arm, a in by.items()]
    vrows = [[t["what"], stats.describe(t["test"]), "n/a" if t["p_holm"] is None else f"{t['p_holm']:.2g}",
              t["verdict"] + (" (Keel tuned chose Keel's own runs: Keel's test)" if t["shares"] else "")]
             for t in res["tests"]]
    banner = (f"**{res['status'].upper()}**: depths {list(res['arms'])} of {cfg.depths}; Holm over the "
              f"{res['family_size']} distinct tests run so far.")
    table = "\n\n".join([banner, markdown_table(["sub-layers", "arm", "choice", "report loss (mean ± SD)"], rows),
                         markdown_table(["test (report loss, paired over seeds)", "mean [95% CI], raw p", "Holm p",
                                         "verdict"], vrows)])
    shared = res["shared"]
    notes = (f"d={cfg.model.d_model}, {cfg.run.steps} steps x {cfg.run.batch_size}x{cfg.run.seq_len} = "
             f"{tokens(cfg):,} tokens. Every arm: LR from {cfg.lrs} at warm-up {cfg.optim.warmup_steps} (at "
             f"{cfg.lrs_from_previous} from its choice a depth before), then warm-up from {cfg.warmups}, then LR "
             f"again; Keel tuned: alpha from {cfg.alphas} at Keel's choice, then LR again. Chosen on seeds "
             f"{cfg.seeds} (select half), tested on seeds {cfg.seeds + cfg.final_seeds} (report half). Cost of the "
             f"points run here: {res['core_hours']:.1f} core-hours. {len(shared)} points shared with "
             f"{sorted(set(shared.values())) or 'no other study'} (the same runs, read from there): "
             f"{', '.join(shared) or 'none'}.")
    tmp = Path(tempfile.mkdtemp(prefix=".report.tmp-", dir=out))
    try:
        own = {k: v for k, v in pts.got.items() if k not in pts.shared}  # named here; the shared ones under "shared"
        write_outputs(tmp, "equal-tuning", cfg, command, {"points": own, **res}, table, [_plot(res, tmp)], notes)
        for f in tmp.iterdir():
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _plot(res: dict, out: Path) -> str:
    """Left: each arm's report loss per depth (mean ± SD over seeds). Right: each test's paired difference with its
    95% interval, filled where the Holm-adjusted p is below 0.05."""
    plt = pyplot()
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(10, 4))
    depths = list(res["arms"])
    for i, arm in enumerate(NAMES_ORDER):
        got = [(d, mean_sd(list(res["arms"][d][arm]["report_by_seed"].values()))) for d in depths
               if arm in res["arms"][d]]
        ax.errorbar([str(d) for d, _ in got], [m for _, (m, _) in got], yerr=[sd for _, (_, sd) in got],
                    marker="o", capsize=3, color=f"C{i}", label=NAMES[arm])
    ax.set_xlabel("sub-layers")
    ax.set_ylabel("report loss")
    ax.legend(fontsize=8)
    tests = [t for t in res["tests"] if t["test"]["n"] and not t["shares"]]
    for k, t in enumerate(tests):
        mean, ci = t["test"]["mean"], t["test"]["ci95"]
        filled = t["p_holm"] is not None and t["p_holm"] < stats.ALPHA
        dx.errorbar([mean], [k], xerr=None if ci is None else [[mean - ci[0]], [ci[1] - mean]], marker="o",
                    capsize=3, color="C0", mfc="C0" if filled else "white")
    dx.set_yticks(range(len(tests)), [t["what"] for t in tests], fontsize=7)
    dx.axvline(0, color="grey", lw=0.8)
    dx.set_xlabel("paired difference in report loss (below 0: Keel better)")
    fig.suptitle(f"equal tuning ({res['status']})", fontsize=10)
    return save(fig, out, "equal-tuning.png")


NAMES_ORDER = ("keel", TUNED, "pre_ln", "post_ln", "deepnorm")


def run(cfg: EqualTuningConfig, out: Path, command: str) -> dict:
    check(cfg)
    unigram_level(cfg)  # the corpus read (and its errors raised) before any point
    pts, tuned = Points(cfg, out), {}
    for depth in cfg.depths:  # each depth whole, its final seeds included, before the next
        tuned[depth] = tune_depth(cfg, pts, depth, tuned)
        final_seeds(cfg, pts, depth, tuned[depth])
        res = analyse(cfg, pts, tuned)
        write_report(cfg, out, command, pts, res)
    return res
